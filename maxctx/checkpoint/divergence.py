"""Divergence: which training states are known good, judged from each step's loss and gradient norm, so that
retention never deletes the last good checkpoint and the NaN guard can name the checkpoint to go back to.

Step n's metrics (logged as step n) hold the loss and gradient norm of the state after n-1 updates, and `finite`:
whether the state after n updates (parameters and optimizer moments) is all finite, checked on device in the
step. A step is suspect when its loss or gradient norm is not finite, its loss exceeds the best loss so far by
more than max(LOSS_JUMP_NATS, LOSS_JUMP_FRACTION x best), its gradient norm exceeds GRAD_NORM_JUMP x the median
of the last GRAD_NORM_WINDOW steps, or its gradient norm is exactly 0 with a positive loss (a model blown up into
saturation: finite, but it no longer learns, as after learning_rate=1e6); its state n-1 is then suspect too (it
produced that loss and gradient). A
non-finite state n is never saved (maxctx.metrics.check_finite stops the run first).

`good_until` is the newest state known good: n-1 after a step n that is not suspect. A checkpoint of a newer
state is not yet known good (its loss is computed by the next step), so retention keeps the newest checkpoint at
or before `good_until` besides the latest max_num_checkpoints_to_keep (`KeepLastGood`), and after a divergence
the checkpoints newer than it are set aside as `<step>.suspect`.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence

LOSS_JUMP_NATS, LOSS_JUMP_FRACTION = 1.0, 0.2
GRAD_NORM_JUMP, GRAD_NORM_WINDOW, GRAD_NORM_MIN_HISTORY = 10.0, 20, 3


class DivergenceWatch:
    """Fed every step's host metrics (`observe`); `good_until` is the newest state known good, `suspect_since`
    the first suspect step of the current run of suspect steps (None when the last step was fine)."""

    def __init__(self, start_step: int) -> None:
        self.good_until = start_step  # a resumed (verified) or initial state
        self.suspect_since: int | None = None
        self.reason = ""
        self._best_loss = math.inf
        self._grad_norms: deque[float] = deque(maxlen=GRAD_NORM_WINDOW)

    def observe(self, step: int, metrics: dict[str, float]) -> None:
        """Step `step` (steps completed) finished with `metrics` (loss, grad_norm, ...)."""
        reason = self._suspect(metrics)
        if reason:
            if self.suspect_since is None:
                self.suspect_since, self.reason = step, reason
            return
        self.suspect_since, self.reason = None, ""
        self.good_until = max(self.good_until, step - 1)
        self._best_loss = min(self._best_loss, metrics.get("loss", math.inf))
        if "grad_norm" in metrics:
            self._grad_norms.append(metrics["grad_norm"])

    def _suspect(self, metrics: dict[str, float]) -> str:
        loss, grad_norm = metrics.get("loss", 0.0), metrics.get("grad_norm", 0.0)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return f"loss {loss:.4g}, gradient norm {grad_norm:.4g}"
        if loss - self._best_loss > max(LOSS_JUMP_NATS, LOSS_JUMP_FRACTION * self._best_loss):
            return f"loss {loss:.4g} after a best of {self._best_loss:.4g}"
        if grad_norm == 0.0 and loss > 0.0:
            return f"gradient norm 0 at loss {loss:.4g}: the model no longer learns"
        if len(self._grad_norms) >= GRAD_NORM_MIN_HISTORY:
            median = statistics.median(self._grad_norms)
            if grad_norm > GRAD_NORM_JUMP * median:
                return f"gradient norm {grad_norm:.4g}, {grad_norm / median:.0f}x the recent median {median:.4g}"
        return ""


@dataclasses.dataclass
class KeepLastGood:
    """Orbax preservation policy: keeps the newest checkpoint at or before `good_until()` (combined with
    LatestN, so max_num_checkpoints_to_keep never deletes the last good checkpoint in favour of newer suspect
    ones)."""

    good_until: Callable[[], int]

    def should_preserve(self, checkpoints: Sequence, *, context=None) -> list[bool]:
        limit = self.good_until()
        good = [c.step for c in checkpoints if c.step <= limit]
        keep = max(good) if good else None
        return [c.step == keep for c in checkpoints]
