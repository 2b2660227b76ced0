"""Host-side step logging: one-step-late fetch, NaN guard, progress line, profiler window, device memory."""

import glob
import os
import time

import jax
import jax.numpy as jnp
import pytest

from maxctx.metrics import (
    NonFiniteLossError,
    PendingMetrics,
    Profiler,
    check_finite,
    device_memory,
    format_progress,
)


def test_pending_metrics_are_one_step_late():
    pending = PendingMetrics()
    assert pending.push(0, {"loss": jnp.float32(3.0)}) is None
    done = pending.push(1, {"loss": jnp.float32(2.0)})
    assert done.step == 0 and done.metrics == {"loss": 3.0} and done.seconds is None
    done = pending.push(2, {"loss": jnp.float32(1.0)})
    assert done.step == 1 and done.metrics == {"loss": 2.0} and done.seconds >= 0
    assert isinstance(done.metrics["loss"], float)
    done = pending.flush()
    assert done.step == 2 and done.metrics == {"loss": 1.0}
    assert pending.flush() is None


def test_push_does_not_fetch_the_step_just_dispatched():
    fetched = []

    class Probe:
        """Records when the host converts it, as jax.device_get + float() would."""

        def __init__(self, step):
            self.step = step

        def __float__(self):
            fetched.append(self.step)
            return float(self.step)

    pending = PendingMetrics()
    pending.push(0, {"loss": Probe(0)})
    assert fetched == []
    pending.push(1, {"loss": Probe(1)})
    assert fetched == [0]


def test_a_step_that_ran_as_it_was_dispatched_is_timed_by_its_dispatch():
    """A program whose dispatch returns only once it ran (on GPU: host-driven loops) finished before its push; its
    time must not go to the next step, nor the last step's be near zero (the H200 log: 11.9, 12.7, 9.5, 0.06 s)."""
    pending = PendingMetrics()
    times = []
    for step in range(4):
        time.sleep(0.1)  # the step running inside its own dispatch
        done = pending.push(step, {"loss": jax.block_until_ready(jnp.float32(step))})
        if done is not None and done.seconds is not None:
            times.append(done.seconds)
    times.append(pending.flush().seconds)
    assert len(times) == 3 and min(times) >= 0.1


def test_a_step_still_running_at_its_push_is_timed_by_its_fetch():
    class Slow:
        """A metric whose fetch waits for its step, as jax.device_get does on a step still running."""

        def __float__(self):
            time.sleep(0.1)
            return 1.0

    pending = PendingMetrics()
    pending.push(0, {"loss": Slow()})
    pending.push(1, {"loss": Slow()})
    assert pending.flush().seconds >= 0.1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_guard_names_the_step(bad):
    check_finite(5, {"loss": 2.0, "grad_norm": 1.0})
    with pytest.raises(NonFiniteLossError, match=r"step 41: loss=(nan|inf|-inf).*learning_rate=10"):
        check_finite(41, {"loss": bad, "learning_rate": 10.0})
    with pytest.raises(FloatingPointError, match="step 7: grad_norm"):
        check_finite(7, {"loss": 1.0, "grad_norm": bad})


def test_progress_line():
    line = format_progress(120, 1000, {"loss": 3.45123, "tokens_per_s": 52100.0, "mfu": 0.4123}, 0.315)
    assert line == "step 120/1000 | loss 3.4512 | 52.10k tok/s | MFU 41.2% | 0.315 s/step | ETA 4m37s"
    assert format_progress(10, 10, {}, 1.0).endswith("ETA 0m00s")
    assert "ETA 2h00m" in format_progress(0, 7200, {"loss": 1.0}, 1.0)
    assert "MFU" not in format_progress(1, 2, {"mfu": float("nan")}, 1.0)  # unknown peak


def test_profiler_traces_the_chosen_steps(tmp_path):
    profiler = Profiler(str(tmp_path), start_step=2, num_steps=2)
    x = jnp.ones((64, 64))
    f = jax.jit(lambda a: a @ a)
    for step in range(6):
        profiler.step(step, block_on=x)
        assert profiler.active == (2 <= step < 4)
        x = f(x) / 64
    profiler.stop(x)
    assert glob.glob(os.path.join(str(tmp_path), "plugins", "profile", "*", "*"))
    off = Profiler(str(tmp_path / "off"), start_step=-1, num_steps=3)
    off.step(-1)
    assert not off.active and not (tmp_path / "off").exists()


def test_device_memory_is_empty_on_cpu():
    assert device_memory() == {}

    class FakeDevice:
        def memory_stats(self):
            return {"bytes_in_use": 2 * 1024**3, "peak_bytes_in_use": 3 * 1024**3, "bytes_limit": 16 * 1024**3}

    assert device_memory([FakeDevice(), FakeDevice()]) == {
        "memory_in_use_gib": 2.0, "peak_memory_in_use_gib": 3.0, "memory_limit_gib": 16.0}
