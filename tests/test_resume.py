"""Resuming anywhere, in one process: the data position is global, so another global batch (and, through the
checkpoint's data item, another process count) reads on from exactly where the run stopped. Documents here carry
their id as their first token, so a batch says which documents it holds."""

import json

import numpy as np
import pytest

from maxctx.data.pipeline import create_data_iterator
from maxctx.data.sources import encode_tokens
from maxctx.loader import load_config
from maxctx.mesh import create_mesh
from tests.support import fixtures as F

SEQ, DOC_IDS = 32, range(10, 210)


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    rng = np.random.default_rng(0)
    docs = [[i, *rng.integers(300, 400, size=rng.integers(3, 12))] for i in DOC_IDS]
    path = tmp_path_factory.mktemp("resume") / "docs.array_record"
    return F.write_arrayrecord(str(path), [encode_tokens(d) for d in docs])


def iterator(path, packing, batch, *extra):
    args = ["dataset_type=arrayrecord", f"grain_train_files={path}", f"max_target_length={SEQ}", f"packing={packing}",
            "vocab_size=512", "grain_prefetch_buffer_size=0", "ici_fsdp_parallelism=-1", "ici_context_parallelism=1",
            f"per_device_batch_size={batch}", *extra]
    config = load_config([f"{k}={v}" for k, v in dict(a.split("=", 1) for a in args).items()])  # later wins
    return create_data_iterator(config, create_mesh(config), "train")


def document_ids(it, steps: int) -> list[int]:
    """The documents of `steps` batches in the order read: each segment's first input after BOS is its id."""
    ids = []
    for _ in range(steps):
        batch = {k: np.asarray(v) for k, v in next(it).items()}
        for inputs, positions in zip(batch["inputs"], batch["positions"]):
            ids += [int(t) for t, p in zip(inputs, positions) if p == 1 and t in DOC_IDS]
    return ids


@pytest.mark.parametrize("packing", ["none", "first_fit"])
def test_another_global_batch_reads_on_with_nothing_twice_or_skipped(documents, packing):
    """8 rows a step for 3 steps, then the saved state resumed at 16 rows a step (per_device_batch_size 1 -> 2)
    and at 24 (gradient_accumulation_steps=3): the documents read are exactly the straight 8-row run's, in order."""
    straight = iterator(documents, packing, 1)
    expected = document_ids(straight, 9)
    straight.close()
    first = iterator(documents, packing, 1)
    before = document_ids(first, 3)
    state = json.loads(json.dumps(first.get_state()))  # as the checkpoint stores it
    first.close()
    assert "process_count" not in state  # global: no process's own
    for extra, steps in ((("per_device_batch_size=2",), 3), (("gradient_accumulation_steps=3",), 2)):
        resumed = iterator(documents, packing, 1, *extra)
        resumed.set_state(state)
        after = document_ids(resumed, steps)
        resumed.close()
        assert before + after == expected[:len(before) + len(after)]
        read = (before + after)[:150]  # well inside the first epoch (first-fit bins straddle its end)
        assert len(set(read)) == len(read)  # each document once


def test_synthetic_position_is_rows_and_another_batch_reads_on_in_the_same_stream():
    config = load_config(["per_device_batch_size=1", f"max_target_length={SEQ}"])
    mesh = create_mesh(config)
    it = create_data_iterator(config, mesh, "train")
    first = [np.asarray(next(it)["inputs"]) for _ in range(3)]
    assert it.get_state() == {"position": "global", "rows": 3 * 8, "block": 8}
    old = create_data_iterator(config, mesh, "train")
    old.set_state({"process_index": 0, "process_count": 1, "step": 1})  # an older version's per-process state
    np.testing.assert_array_equal(np.asarray(next(old)["inputs"]), first[1])
    wide = create_data_iterator(load_config(["per_device_batch_size=2", f"max_target_length={SEQ}"]), mesh, "train")
    wide.set_state({"position": "global", "rows": 8, "block": 8})
    np.testing.assert_array_equal(np.asarray(next(wide)["inputs"]), np.concatenate(first[1:]))


def test_an_older_per_process_state_resumes_on_its_own_pipeline(documents):
    """A state an older version saved (each process its own, of its loading group's documents) still resumes, on
    that older pipeline, when the process count is the same; the new state is global."""
    it = iterator(documents, "first_fit", 1)
    older = it.per_group()  # the grain iterator an older version read
    for _ in range(3):
        next(older)
    state = {"process_index": 0, "process_count": 1, "grain": json.loads(json.dumps(older.get_state()))}
    expected = next(older)
    it.set_state(state)
    np.testing.assert_array_equal(np.asarray(next(it)["inputs"]), expected["inputs"])
    assert "process_count" in it.get_state()  # it goes on saving in the format it reads
    it.close()


@pytest.mark.parametrize("how, moved_to", [("steps", 8), ("tokens", 4)])
def test_a_doubled_batch_goes_on_by_step_or_by_tokens(how, moved_to):
    """Saved at step 8 with 2 sequences a step, resumed with 4: `steps` keeps the schedule at its step 8;
    `tokens` moves it to step 4, where a run with 4 a step has read the same 16 sequences. The optimizer's next
    update takes that step's learning rate (Adam's first update with zero moments is -lr x sign(g)), and the line
    says which."""
    import jax
    import jax.numpy as jnp

    from maxctx.checkpoint.compatibility import resume_changes, resume_record
    from maxctx.optimizer import learning_rate_schedule, make_optimizer, schedule_step, with_schedule_step

    config = load_config(["steps=20", "warmup_steps_fraction=0.5", "gradient_clipping_threshold=0",
                          f"schedule_on_batch_change={how}"])
    params = {"w": jnp.zeros(2)}
    optimizer = make_optimizer(config, {"w": ("embed",)})
    opt_state = with_schedule_step(optimizer.init(params), jnp.asarray(8, jnp.int32))  # Adam's moments still zero
    state = {"step": jnp.asarray(8, jnp.int32), "params": params, "opt_state": opt_state}
    resumed, (line,) = resume_changes(state, resume_record(config, 2), config, 4)
    assert int(schedule_step(resumed["opt_state"])) == moved_to
    rate = float(learning_rate_schedule(config)(moved_to))
    assert rate != float(learning_rate_schedule(config)(8 if how == "tokens" else 4))  # warmup: the rate tells
    update, _ = optimizer.update({"w": jnp.ones(2)}, resumed["opt_state"], params)
    np.testing.assert_allclose(np.asarray(update["w"]), -rate, rtol=1e-6)
    assert line.startswith("resuming at step 8 with a global batch of 4 sequences") and "not the 2" in line, line
    expected = (f"by tokens (schedule_on_batch_change=tokens): from its step 8 to 4, the learning rate "
                f"{float(learning_rate_schedule(config)(8)):.3g} -> {rate:.3g}" if how == "tokens" else
                f"by step at its step 8 (learning rate {rate:.3g}; schedule_on_batch_change=tokens would move it "
                f"to step 4,")
    assert f"the learning-rate schedule goes on {expected}" in line, line
    assert resume_changes(state, resume_record(config, 4), config, 4) == (state, [])  # same batch: nothing
    assert jax.device_get(resumed["step"]) == 8


def test_a_schedule_length_notice_reads_the_schedule_at_its_own_step():
    """A resume at step 10 whose schedule is at its step 5 (moved by an earlier batch change) with steps 40 -> 20:
    the learning rates the line names are the two schedules' at step 5."""
    import dataclasses

    from maxctx.checkpoint.compatibility import resume_notices
    from maxctx.optimizer import learning_rate_schedule

    config = load_config(["steps=20"])
    old = learning_rate_schedule(dataclasses.replace(config, learning_rate_schedule_steps=40))
    (line,) = resume_notices({"schedule_steps": 40}, config, 10, schedule_at=5)
    assert f"goes from {float(old(5)):.3g} to {float(learning_rate_schedule(config)(5)):.3g};" in line, line
