"""AdamW with linear warmup then cosine decay, global-norm gradient clipping, and decoupled weight decay on
matrices only (norm scales are not decayed).

The schedule is evaluated at its own count in the optimizer state (optax's scale_by_schedule), saved with the
state: the optimizer step, unless a resume changed the global batch with schedule_on_batch_change=tokens, which
moves it (`resumed_schedule_step`) and so every later step's learning rate, and every later resume's.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from maxctx.config import Config


def learning_rate_schedule(config: Config) -> optax.Schedule:
    """Linear warmup over `warmup_steps_fraction` of the schedule, then cosine decay to
    `cosine_learning_rate_final_fraction` x peak at `learning_rate_schedule_steps` (default: `steps`)."""
    total = max(1, config.schedule_steps)
    warmup = int(config.warmup_steps_fraction * total)
    peak, final = config.learning_rate, config.learning_rate * config.cosine_learning_rate_final_fraction
    cosine = optax.cosine_decay_schedule(peak, max(1, total - warmup), alpha=final / peak if peak else 0.0)
    if warmup == 0:
        return cosine
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), cosine], [warmup])


def schedule_step(opt_state: Any) -> jax.Array:
    """int32[]: the step the learning-rate schedule is at (the count of `make_optimizer`'s scale_by_schedule)."""
    counts = [s.count for s in _schedule_states(opt_state)]
    if len(counts) != 1:
        raise ValueError(f"expected one learning-rate schedule in the optimizer state, found {len(counts)}")
    return counts[0]


def with_schedule_step(opt_state: Any, step: jax.Array) -> Any:
    """`opt_state` with the schedule's count replaced by `step` (Adam's own count, for bias correction, kept)."""
    return jax.tree.map(lambda s: s._replace(count=step) if isinstance(s, optax.ScaleByScheduleState) else s,
                        opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByScheduleState))


def _schedule_states(opt_state: Any) -> list:
    return [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByScheduleState))
            if isinstance(s, optax.ScaleByScheduleState)]


def resumed_schedule_step(step: int, was: int, now: int, how: str) -> int:
    """The schedule's step after a resume at schedule step `step` that changes the global batch from `was` to `now`
    sequences. `steps`: unchanged (the schedule ends at `steps`, whatever the batch). `tokens`: the step at which a
    run with the new batch would have read as many tokens (step x was / now, rounded), so the learning rate goes on
    from where the tokens read put it."""
    if how == "steps" or was == now:
        return step
    return round(step * was / now)


def decay_mask(param_axes: dict) -> dict:
    """True for parameters that get weight decay: everything but norm scales."""
    return jax.tree.map(lambda names: "norm" not in names, param_axes, is_leaf=lambda x: isinstance(x, tuple))


def make_optimizer(config: Config, param_axes: dict) -> optax.GradientTransformation:
    parts = []
    if config.gradient_clipping_threshold > 0:
        parts.append(optax.clip_by_global_norm(config.gradient_clipping_threshold))
    parts.append(optax.adamw(learning_rate_schedule(config), b1=config.adam_b1, b2=config.adam_b2,
                             eps=config.adam_eps, weight_decay=config.adam_weight_decay,
                             mask=decay_mask(param_axes)))
    return optax.chain(*parts)
