"""DivergenceWatch: which states are known good from each step's loss and gradient norm; KeepLastGood keeps the
newest checkpoint among them. (The end-to-end divergence run is in tests/test_faults.py.)"""

import math
from types import SimpleNamespace

from maxctx.checkpoint.divergence import DivergenceWatch, KeepLastGood


def feed(watch, start, values):
    for step, (loss, grad_norm) in enumerate(values, start=start):
        watch.observe(step, {"loss": loss, "grad_norm": grad_norm})


def test_good_until_follows_healthy_steps():
    watch = DivergenceWatch(start_step=10)
    assert watch.good_until == 10
    feed(watch, 11, [(5.0, 1.0), (4.5, 0.8), (4.7, 0.9)])  # a small rise is no divergence
    assert watch.good_until == 12 and watch.suspect_since is None


def test_loss_jump_marks_the_state_before_it_suspect():
    watch = DivergenceWatch(0)
    feed(watch, 1, [(5.0, 1.0), (4.0, 1.0), (4.1, 1.0), (9.0, 1.0), (math.nan, math.nan)])
    # step 4's loss is the state after 3 updates: 3 is suspect, 2 is the last good state
    assert watch.suspect_since == 4 and watch.good_until == 2 and "loss 9" in watch.reason


def test_gradient_norm_jump_and_recovery():
    watch = DivergenceWatch(0)
    feed(watch, 1, [(5.0, 1.0), (4.9, 1.2), (4.8, 0.9), (4.7, 30.0)])
    assert watch.suspect_since == 4 and "gradient norm 30" in watch.reason and watch.good_until == 2
    feed(watch, 5, [(4.6, 1.0)])  # back to normal: the streak ends and state 4 is known good
    assert watch.suspect_since is None and watch.good_until == 4


def test_a_dead_model_is_suspect():
    # learning_rate=1e6 on the tiny model: one update saturates it; the loss stays at ln(V) with gradient norm
    # exactly 0, finite, until NaN. The state that produced it is not good (it was, before this rule).
    watch = DivergenceWatch(0)
    feed(watch, 1, [(5.545, 1.3), (5.545, 0.9), (5.545, 0.0), (5.545, 0.0)])
    assert watch.suspect_since == 3 and watch.good_until == 1 and "no longer learns" in watch.reason


def test_keep_last_good_preserves_the_newest_checkpoint_at_or_before_good_until():
    checkpoints = [SimpleNamespace(step=s) for s in (4, 6, 7, 8, 9)]
    assert KeepLastGood(lambda: 6).should_preserve(checkpoints) == [False, True, False, False, False]
    assert KeepLastGood(lambda: 5).should_preserve(checkpoints) == [True, False, False, False, False]
    assert KeepLastGood(lambda: 3).should_preserve(checkpoints) == [False] * 5
