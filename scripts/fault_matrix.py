"""The long version of tests/test_faults.py: every checkpoint damage, a full disk during an async save (under both
checkpoint_failure_policy values), and kill -9 at random moments of a run that saves every step (async), each
followed by a resume; prints one row per case and a summary.

    python scripts/fault_matrix.py [--trials 20] [--steps 10] [--seed 0] [--out DIR]

A case passes when the resume exits 0 and reproduces the straight run's losses bit for bit from the step after the
checkpoint it resumed from, or exits 2 with one line on stderr; never a traceback, and a damaged step is renamed
`<step>.corrupt`, not deleted. Runs on 2 simulated CPU devices with the tiny model and a
shared compilation cache (about 10 s a case on 2 cores).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for tests.support

from tests.support.faults import DAMAGE, copy_steps, kill_at_random_moment, saved_steps  # noqa: E402
from tests.support.processes import HOOKED_TRAIN, cpu_env, losses, run, steps_on_disk, train_command  # noqa: E402

KEYS = ["dtype=float32", "log_period=1", "per_device_batch_size=1", "max_target_length=64", "cpu_devices=2",
        "learning_rate_schedule_steps=20", "peak_tflops_per_device=1", "enable_tensorboard=false"]


def judge(proc, reference: dict[int, float], run_dir: Path, steps: int) -> tuple[bool, str, str]:
    """(passed, outcome, resumed-from) of a resume."""
    if "Traceback" in proc.stderr:
        return False, "traceback", "-"
    after = set(steps_on_disk(run_dir)) if (run_dir / "checkpoints").is_dir() else set()
    if proc.returncode == 2:
        lines = proc.stderr.strip().splitlines()
        return len(lines) == 1, f"exit 2: {lines[-1][:60] if lines else ''}", "-"
    if proc.returncode != 0:
        return False, f"exit {proc.returncode}", "-"
    marker = "resuming from checkpoint step "
    start = int(proc.stdout.split(marker)[1].split()[0]) if marker in proc.stdout else 0
    got = losses(run_dir)
    exact = all(got.get(s) == reference[s] for s in range(start + 1, steps + 1))
    aside = [s for s in after if s.endswith(".corrupt")]
    return exact, ("resumed, losses exact" if exact else "resumed, LOSSES DIFFER") + (
        f" ({', '.join(sorted(aside))} set aside)" if aside else ""), str(start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20, help="kill -9 trials")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    parser.add_argument("--out", default="", help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        env = cpu_env(compile_cache=out / "jax_cache")

        def command(run_name: str, *overrides: str, script: Path | None = None) -> list[str]:
            return train_command(*KEYS, f"steps={args.steps}", "checkpoint_period=2", f"base_output_directory={out}",
                                 f"run_name={run_name}", *overrides, script=script)

        straight = run(command("straight"), env=env)
        if straight.returncode != 0:
            print(straight.stderr[-3000:])
            return 1
        reference = losses(out / "straight")
        older, newer = saved_steps(out / "straight")[:2]  # the run keeps 3: the damaged runs resume to the end
        rows = []
        for name, (damage, _) in DAMAGE.items():
            run_dir = out / f"damage_{name}"
            copy_steps(out / "straight", run_dir, [older, newer])
            damage(run_dir / "checkpoints" / str(newer))
            proc = run(command(run_dir.name), env=env)
            passed, outcome, start = judge(proc, reference, run_dir, args.steps)
            if f"{newer}.corrupt" not in steps_on_disk(run_dir):  # set aside, never deleted
                passed, outcome = False, f"{outcome}; {newer} not set aside as {newer}.corrupt"
            rows.append((f"step {newer}: {name}", passed, outcome, start))
            print(*rows[-1], sep=" | ", flush=True)
        for policy in ("exit", "continue"):  # the save of `newer` fails as on a full disk, then a plain resume
            run_dir = out / f"disk_full_{policy}"
            full = run(command(run_dir.name, f"checkpoint_failure_policy={policy}", script=HOOKED_TRAIN),
                       env={**env, "ENOSPC_STEPS": str(newer)})
            proc = full if policy == "continue" else run(command(run_dir.name), env=env)
            passed, outcome, start = judge(proc, reference, run_dir, args.steps)
            said = [line for line in full.stdout.splitlines() + full.stderr.splitlines()
                    if line.startswith(("saving checkpoint step", "checkpoint error: saving checkpoint step"))]
            if full.returncode != {"exit": 2, "continue": 0}[policy] or len(said) != 1 or "Traceback" in full.stderr:
                passed, outcome = False, f"{outcome}; the failed save exited {full.returncode}, said {said}"
            rows.append((f"disk full at step {newer}, {policy}", passed, outcome, start))
            print(*rows[-1], sep=" | ", flush=True)
        rng = random.Random(args.seed)
        for trial in range(args.trials):
            run_dir = out / f"kill_{trial}"
            delay = kill_at_random_moment(command(run_dir.name, "checkpoint_period=1"), env, run_dir, rng)
            left = steps_on_disk(run_dir) if (run_dir / "checkpoints").is_dir() else []
            cut = [s.split(".")[0] for s in left if ".orbax-checkpoint-tmp" in s]  # saves the kill cut off
            proc = run(command(run_dir.name), env=env)
            passed, outcome, start = judge(proc, reference, run_dir, args.steps)
            outcome += f" (the kill cut off the save of step {', '.join(cut)})" if cut else ""
            rows.append((f"kill -9 #{trial + 1} at +{delay:.2f} s", passed, outcome, start))
            print(*rows[-1], sep=" | ", flush=True)
    width = max(len(r[0]) for r in rows)
    print(f"\n{'case':<{width}}  {'pass':<4}  {'from':>4}  outcome")
    for case, passed, outcome, start in rows:
        print(f"{case:<{width}}  {'yes' if passed else 'NO':<4}  {start:>4}  {outcome}")
    kills = [r for r in rows if r[0].startswith("kill")]
    print(f"\ndamage and disk-full cases passed: {sum(r[1] for r in rows if not r[0].startswith('kill'))}/"
          f"{len(DAMAGE) + 2}; "
          f"kill -9 trials passed: {sum(r[1] for r in kills)}/{len(kills)}")
    return 0 if all(r[1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
