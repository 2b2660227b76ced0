"""AdamW with linear warmup then cosine decay, global-norm gradient clipping, and decoupled weight decay on
matrices only (norm scales are not decayed)."""

from __future__ import annotations

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
