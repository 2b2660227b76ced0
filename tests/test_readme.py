"""The README cannot drift: its command blocks run in the order written, in a fresh folder, as a newcomer runs them
(installs and the test suite itself left out; training runs shortened to a few steps), and the docs index links
every page in docs/."""

import re
import shlex
import shutil
import sys

from tests.support.processes import ROOT, run

SKIPPED = ("pip install", "python -m pytest")  # the test's own environment is installed; the suite is running
STEPS = "steps=4"  # a few steps: what is checked is that the command runs, not how far it trains


def readme_commands(text: str) -> list[str]:
    """Every command of the README's ```bash blocks, in order: continuation lines joined, comments dropped, each
    `a && b` split into its parts."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].strip()
            commands += [part.strip() for part in line.split("&&") if part.strip()]
    return commands


def test_readme_commands_are_found():
    commands = readme_commands((ROOT / "README.md").read_text())
    assert commands[0] == "pip install -e ." and commands[1] == "python train.py configs/base.yml", commands
    assert any("run_name=cp_demo" in c for c in commands), commands


def test_readme_command_blocks_run_in_order_in_a_fresh_folder(tmp_path):
    for name in ("configs", "scripts"):
        shutil.copytree(ROOT / name, tmp_path / name)
    shutil.copy(ROOT / "train.py", tmp_path / "train.py")
    ran = []
    for command in readme_commands((ROOT / "README.md").read_text()):
        if command.startswith(SKIPPED):
            continue
        argv = shlex.split(command)
        assert argv[0] == "python", command
        if argv[1] == "train.py":
            argv.append(STEPS)
        proc = run([sys.executable, *argv[1:]], cwd=tmp_path, timeout=300)
        assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"
        ran.append(command)
    assert len(ran) >= 3, ran
    # the Quickstart's picture comes from the same outputs
    proc = run([sys.executable, "scripts/plot_metrics.py", "outputs/default_run"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 0 and (tmp_path / "metrics_plots" / "summary.png").is_file(), proc.stderr[-2000:]


def test_docs_index_links_every_page():
    index = (ROOT / "docs" / "README.md").read_text()
    linked = set(re.findall(r"\]\(([^)#]+\.md)\)", index))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages <= linked, f"docs/README.md does not link {sorted(pages - linked)}"
    for page in linked - {"../README.md"}:
        assert (ROOT / "docs" / page).is_file(), f"docs/README.md links {page}, which does not exist"
    assert "docs/README.md" in (ROOT / "README.md").read_text()
