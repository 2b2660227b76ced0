"""StepLogger: the timing window over a log period, the first step timed from the loop's start, the NaN check, the
forced log, and what reaches the writer and stdout."""

import time

import pytest

from maxctx.metrics import NonFiniteLossError, StepLogger

TOKENS, FLOPS, DEVICES, PEAK = 1000, 8e12, 4, 1e12


class Clock:
    """time.perf_counter that returns whatever the test set."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Recorder:
    """The MetricsWriter calls StepLogger makes."""

    def __init__(self, is_primary=True):
        self.is_primary = is_primary
        self.steps = []
        self.every_step = []  # metrics_file's lines: every step, logged or not

    def write_step(self, step, values):
        self.steps.append((step, values))

    def write_maxtext_step(self, step, values):
        self.every_step.append((step, values))


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    return clock


def make_logger(writer, log_period, total_steps=6):
    return StepLogger(writer, total_steps=total_steps, log_period=log_period, tokens_per_step=TOKENS,
                      flops_per_step=FLOPS, num_devices=DEVICES, peak_flops_per_device=PEAK)


def run(logger, clock, times, losses):
    """Pushes step i with losses[i] at times[i] (its dispatch returns then), then flushes, forced, at times[-1]."""
    for step, (now, loss) in enumerate(zip(times[:-1], losses, strict=True)):
        clock.now = now
        logger.push(step, {"loss": loss})
    clock.now = times[-1]
    logger.flush(force=True)


def test_step_time_is_the_mean_over_the_log_period(clock, capsys):
    writer = Recorder()
    clock.now = 100.0
    logger = make_logger(writer, log_period=3)
    # Each push fetches the previous step: step 0 at 101 (1 s after the loop began), then 2, 3, 4, 5 s apart.
    run(logger, clock, [100.5, 101.0, 103.0, 106.0, 110.0, 115.0], [6.0, 5.0, 4.0, 3.0, 2.0])
    # Logged: step 1 (the loop's first, alone), step 3 (mean of 2 and 3 s), step 5 (forced: mean of 4 and 5 s).
    assert [(step, values["step_time_s"]) for step, values in writer.steps] == [(1, 1.0), (3, 2.5), (5, 4.5)]
    assert [values["loss"] for _, values in writer.steps] == [6.0, 4.0, 2.0]
    step, values = writer.steps[1]
    assert values["tokens_per_s"] == TOKENS / 2.5 and values["mfu"] == pytest.approx(FLOPS / DEVICES / 2.5 / PEAK)
    assert (logger.first_loss, logger.last_loss) == (6.0, 2.0)
    # metrics_file (MaxText's format) gets every step, 0-based, each with its own step time
    assert [(step, values["loss"], values["step_time_s"]) for step, values in writer.every_step] == [
        (0, 6.0, 1.0), (1, 5.0, 2.0), (2, 4.0, 3.0), (3, 3.0, 4.0), (4, 2.0, 5.0)]
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["step 1/6", "step 3/6", "step 5/6"]
    assert "2.500 s/step" in lines[1]


def test_first_step_is_timed_from_the_loop_start_and_always_logged(clock):
    writer = Recorder()
    clock.now = 10.0
    logger = make_logger(writer, log_period=100)
    clock.now = 17.0  # the first batch and dispatch took 7 s
    logger.push(0, {"loss": 1.0})
    assert writer.steps == []  # one step late: nothing fetched yet
    clock.now = 20.0
    logger.push(1, {"loss": 1.0})
    assert [(step, values["step_time_s"]) for step, values in writer.steps] == [(1, 10.0)]


def test_step_after_a_pause_is_left_out_of_the_window(clock):
    writer = Recorder()
    logger = make_logger(writer, log_period=4)
    clock.now = 1.0
    logger.push(0, {"loss": 1.0})
    logger.flush()  # an eval is due: step 0 fetched (logged: the loop's first step)
    clock.now = 50.0  # the eval took 49 s
    logger.reset_clock()
    for step, now in zip(range(1, 4), (51.0, 53.0, 55.0), strict=True):
        clock.now = now
        logger.push(step, {"loss": 1.0})
    clock.now = 57.0
    logger.flush()
    # Step 1's time would include the eval: only steps 2 and 3 (2 s each) are in step 4's window.
    assert [(step, values["step_time_s"]) for step, values in writer.steps] == [(1, 1.0), (4, 2.0)]


def test_flush_logs_off_the_period_only_when_forced(clock):
    writer = Recorder()
    logger = make_logger(writer, log_period=10)
    for step in range(3):
        clock.now = float(step)
        logger.push(step, {"loss": 1.0})
    clock.now = 3.0
    logger.flush()  # step 3 of 10: not logged
    assert [step for step, _ in writer.steps] == [1]  # the loop's first step only
    clock.now = 4.0
    logger.push(3, {"loss": 1.0})
    clock.now = 5.0
    logger.flush(force=True)
    # Steps 1, 2 (1 s each) and 3 (2 s since the flush before it), though step 4 is off the period.
    assert [step for step, _ in writer.steps] == [1, 4]
    assert writer.steps[1][1]["step_time_s"] == pytest.approx(4 / 3)


@pytest.mark.parametrize("key", ["loss", "grad_norm"])
def test_non_finite_step_raises_before_anything_is_written(clock, key):
    writer = Recorder()
    logger = make_logger(writer, log_period=1)
    clock.now = 1.0
    logger.push(0, {"loss": 1.0, "grad_norm": 1.0})
    logger.push(1, {"loss": 1.0, "grad_norm": 1.0, key: float("nan")})
    with pytest.raises(NonFiniteLossError, match=f"step 2: {key}=nan"):
        logger.flush()
    assert [step for step, _ in writer.steps] == [1]
    assert logger.last_loss == 1.0


def test_only_the_primary_process_prints(clock, capsys):
    writer = Recorder(is_primary=False)
    logger = make_logger(writer, log_period=1)
    clock.now = 1.0
    logger.push(0, {"loss": 1.0})
    logger.flush()
    assert [step for step, _ in writer.steps] == [1]  # the writer itself skips non-primary processes
    assert capsys.readouterr().out == ""


def test_skipped_steps_are_counted_not_checked_and_ten_in_a_row_stop(clock, capsys):
    """skip_nonfinite_steps: a skipped step (NaN loss, state kept) gets a line and skipped_steps counts it; it is
    neither a NaN stop nor fed to on_step; MAX_SKIPS_IN_A_ROW in a row stop the run."""
    from maxctx.metrics.step_logger import MAX_SKIPS_IN_A_ROW

    writer, seen = Recorder(), []
    logger = StepLogger(writer, total_steps=30, log_period=1, tokens_per_step=TOKENS, flops_per_step=FLOPS,
                        num_devices=DEVICES, peak_flops_per_device=PEAK, on_step=lambda s, m: seen.append(s))
    nan = float("nan")
    for step, (loss, skipped) in enumerate([(5.0, 0.0), (nan, 1.0), (4.0, 0.0)]):
        clock.now = step + 1.0
        logger.push(step, {"loss": loss, "grad_norm": 1.0, "skipped": skipped})
    clock.now = 4.0
    logger.flush(force=True)
    assert [values["skipped_steps"] for _, values in writer.steps] == [0.0, 1.0, 1.0]
    assert seen == [1, 3] and logger.last_loss == 4.0
    assert "step 2: loss nan, gradient norm 1; update skipped, weights kept (skip_nonfinite_steps=true; 1 skipped " \
           "so far)" in capsys.readouterr().out
    with pytest.raises(NonFiniteLossError, match=f"step {3 + MAX_SKIPS_IN_A_ROW}: loss=nan"):
        for step in range(3, 4 + MAX_SKIPS_IN_A_ROW):
            clock.now = step + 2.0
            logger.push(step, {"loss": nan, "grad_norm": 1.0, "skipped": 1.0})
