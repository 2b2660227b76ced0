"""The pure, jitted training step and everything it needs: abstract state, shardings, init, AOT compile.

State: {"step": int32[], "params": nested dict of arrays, "opt_state": optax state}, parameters sharded by their
logical axes (maxctx.parallelism.LOGICAL_RULES), optimiser moments like their parameters, scalars replicated.
Batch: dict of [B, S] arrays x[B_(data,fsdp), S_(context,context_a2a)] (see maxctx.data).

The loss is the weighted mean of token cross-entropy over every token of the global batch (all micro-batches of
gradient accumulation together), whatever the mesh: sums are reduced first, divided once. A family's auxiliary
terms (maxctx.model.decoder.Decoder.loss_terms: MoE load balancing) add sum(weight x term) to it, each term the
token-weighted mean of its micro-batches' values, and each is logged under its name.

With skip_nonfinite_steps, a step whose loss or gradient norm is not finite, or whose update would leave a
non-finite parameter or moment, keeps the previous parameters and optimizer state (the step counter and the data
still advance) and reports `skipped` = 1; maxctx.metrics.StepLogger counts the skips instead of stopping.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxctx.config import Config, ConfigError
from maxctx.data import BATCH_KEYS
from maxctx.mesh import batch_sharding, logical_to_spec
from maxctx.metrics.flops import document_pairs
from maxctx.model.decoder import Decoder, param_axes, sign_updated
from maxctx.model.layers import ModelConfig
from maxctx.optimizer import learning_rate_schedule, make_optimizer, schedule_step

HOST = "pinned_host"  # jax's memory kind of pinned host memory (CPU, GPU and TPU)


@dataclasses.dataclass(frozen=True)
class TrainSetup:
    """Static pieces of a run: the model's graph, the optimiser, shardings and abstract shapes."""

    config: Config
    mesh: Mesh
    model_config: ModelConfig
    graphdef: Any
    param_axes: dict
    optimizer: optax.GradientTransformation
    abstract_state: dict
    state_shardings: dict
    batch_shardings: dict
    sign_updated: dict | None = None  # maxctx.model.decoder.sign_updated: parameters moved by their gradient's sign

    @property
    def global_batch(self) -> int:
        return self.config.global_batch_size(self.mesh.devices.size) * self.config.gradient_accumulation_steps

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        shape = (self.global_batch, self.config.max_target_length)
        return {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "weights" else jnp.int32,
                                        sharding=self.batch_shardings[k]) for k in BATCH_KEYS}


def make_setup(config: Config, mesh: Mesh) -> TrainSetup:
    model_config = ModelConfig.from_config(config)
    abstract_model = nnx.eval_shape(lambda: Decoder(model_config, nnx.Rngs(config.seed), mesh))
    graphdef, abstract_params = nnx.split(abstract_model)
    abstract_params = nnx.to_pure_dict(abstract_params)
    axes = param_axes(abstract_model)
    optimizer = make_optimizer(config, axes)
    param_shardings = jax.tree.map(
        lambda names, p: NamedSharding(mesh, logical_to_spec(names, p.shape, mesh)), axes, abstract_params,
        is_leaf=lambda x: isinstance(x, tuple))
    replicated = NamedSharding(mesh, P())
    abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
    # MaxText's host offload keys: the parameter-shaped state (Adam's moments; the parameters) in pinned host memory.
    host = jax.tree.map(lambda s: s.with_memory_kind(HOST), param_shardings)
    opt_shardings = optax.tree_map_params(optimizer, lambda _, s: s, abstract_opt,
                                          host if config.optimizer_memory_host_offload else param_shardings,
                                          transform_non_params=lambda _: replicated)
    if config.parameter_memory_host_offload:
        param_shardings = host
    state_shardings = {"step": replicated, "params": param_shardings, "opt_state": opt_shardings}
    abstract_state = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": abstract_params,
                      "opt_state": abstract_opt}
    abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                  abstract_state, state_shardings)
    batch_shardings = {k: batch_sharding(mesh) for k in BATCH_KEYS}
    return TrainSetup(config, mesh, model_config, graphdef, axes, optimizer, abstract_state, state_shardings,
                      batch_shardings, sign_updated(abstract_model))


def init_state(setup: TrainSetup) -> dict:
    """Fresh parameters (seeded by `seed`) and optimiser state, created directly in their shardings."""

    def init():
        model = Decoder(setup.model_config, nnx.Rngs(setup.config.seed), setup.mesh)
        params = nnx.to_pure_dict(nnx.state(model))
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": setup.optimizer.init(params)}

    return jax.jit(init, out_shardings=setup.state_shardings)()


def loss_sums(graphdef, params, batch) -> tuple[jax.Array, jax.Array]:
    """(sum of weighted token cross-entropy, with the auxiliary terms as `loss_terms` adds them; sum of weights)
    over a batch."""
    total, (weight, _) = loss_terms(graphdef, params, batch)
    return total, weight


def loss_terms(graphdef, params, batch):
    """(the objective's sum, (sum of weights, {term: weight sum x term})) over a batch: the cross-entropy sum plus
    sum(weight x term) counted once per unit of token weight, so that dividing by the total weight gives the mean
    cross-entropy plus the weighted terms. Without terms the objective is the cross-entropy sum itself."""
    model = nnx.merge(graphdef, params)
    loss, weight, terms = model.loss_terms(batch["inputs"], batch["positions"], batch["segment_ids"],
                                           batch["targets"], batch["weights"])
    scaled = [w * value for w, value in terms.values() if w]
    if scaled:
        loss = loss + jax.lax.stop_gradient(weight) * sum(scaled)
    return loss, (weight, {name: value * weight for name, (_, value) in terms.items()})


def all_finite(tree: Any) -> jax.Array:
    """bool[]: every floating-point value of `tree` is finite (one fused reduction per array; a state that fails
    is never saved)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack(leaves))


def train_step_fn(setup: TrainSetup):
    """The pure step `(state, batch) -> (state, metrics)` (unjitted)."""
    graphdef, optimizer = setup.graphdef, setup.optimizer
    accum, skip_nonfinite = setup.config.gradient_accumulation_steps, setup.config.skip_nonfinite_steps
    schedule = learning_rate_schedule(setup.config)
    grad_fn = jax.value_and_grad(lambda p, b: loss_terms(graphdef, p, b), has_aux=True)

    def step(state, batch):
        # State kept in host memory (the host offload keys) comes to the device for the step and goes back by the
        # step's out_shardings; XLA schedules each array's copy near its first use (the moments: the update).
        state = on_device(state, setup.state_shardings)
        params = state["params"]
        if accum == 1:
            (loss_sum, (weight_sum, term_sums)), grad_sum = grad_fn(params, batch)
        else:
            # Micro-batch a takes rows a, a + A, a + 2A, ... so every data shard feeds every micro-batch.
            micro = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, accum, *x.shape[1:]), 0, 1), batch)

            def body(carry, mb):
                (loss, (weight, terms)), g = grad_fn(params, mb)
                return jax.tree.map(jnp.add, carry, (loss, weight, terms, g)), None

            first = jax.tree.map(lambda x: x[0], micro)
            term_shapes = jax.eval_shape(lambda p, b: loss_terms(graphdef, p, b)[1][1], params, first)
            zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
                     jax.tree.map(lambda t: jnp.zeros(t.shape, jnp.float32), term_shapes),
                     jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
            (loss_sum, weight_sum, term_sums, grad_sum), _ = jax.lax.scan(body, zeros, micro)
        denom = jnp.maximum(weight_sum, 1.0)
        grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), grad_sum, params)
        grads, signed = split_signed(grads, setup.sign_updated)
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        new_params = signed(params, optax.apply_updates(params, updates), setup.config.routed_bias_update_rate)
        loss, grad_norm, finite = loss_sum / denom, optax.tree.norm(grads), all_finite((new_params, opt_state))
        # A term named with a leading "_" is in the objective for its gradient only (maxctx.model.deepseek.layers).
        metrics = {name: value / denom for name, value in term_sums.items() if not name.startswith("_")}
        if skip_nonfinite:  # keep the previous state (finite: it was saved or checked) instead of a bad update
            keep = ~(jnp.isfinite(loss) & jnp.isfinite(grad_norm) & finite)
            new_params, opt_state = jax.tree.map(lambda new, old: jnp.where(keep, old, new),
                                                 (new_params, opt_state), (params, state["opt_state"]))
            finite, metrics["skipped"] = all_finite((new_params, opt_state)), keep.astype(jnp.float32)
        metrics.update(loss=loss, grad_norm=grad_norm, param_norm=optax.tree.norm(new_params),
                       learning_rate=schedule(schedule_step(state["opt_state"])),  # its own count: a resume may move it
                       tokens=weight_sum, finite=finite.astype(jnp.float32),
                       attention_pairs=document_pairs(batch["positions"], batch["segment_ids"], setup.config, jnp))
        return {"step": state["step"] + 1, "params": new_params, "opt_state": opt_state}, metrics

    return step


def split_signed(grads, mask):
    """(the gradients for the optimizer, with those of the parameters in `mask` zeroed, and a function
    (params, new_params, rate) -> new_params with each masked parameter moved to params - rate sign(its gradient)
    instead): the optimizer, its clipping and the logged gradient norm never see what the sign update uses."""
    if mask is None:
        return grads, lambda params, new_params, rate: new_params
    signals = grads
    grads = jax.tree.map(lambda g, m: jnp.zeros_like(g) if m else g, grads, mask)

    def signed(params, new_params, rate):
        return jax.tree.map(lambda old, new, g, m: (old - rate * jnp.sign(g)).astype(old.dtype) if m else new,
                            params, new_params, signals, mask)

    return grads, signed


def on_device(tree, shardings):
    """`tree` with every array whose sharding is in pinned host memory copied to device memory (same layout)."""
    leaves, treedef = jax.tree.flatten(tree)
    moved = [jax.device_put(x, s.with_memory_kind("device")) if s.memory_kind == HOST else x
             for x, s in zip(leaves, jax.tree.leaves(shardings), strict=True)]
    return jax.tree.unflatten(treedef, moved)


# libtpu's switch that moves gathers to the SparseCores (tpu_sparse_core_gathers=false turns it off; of libtpu's
# two, the one that does: xla_tpu_enable_offloading_gather_to_sparsecore=false leaves an embedding lookup there)
SPARSE_CORE_GATHER_FLAG = "xla_tpu_offload_gather_to_sparsecore"


def compiler_options(config, mesh: Mesh) -> dict | None:
    """XLA options of the step's compile: on TPU, the scoped VMEM limit kernels may take (tpu_scoped_vmem_limit_kib;
    -1: the generation's default in maxctx.plan.topology, 0: libtpu's own), and whether gathers may run on the
    SparseCores (tpu_sparse_core_gathers). The same options in an ahead-of-time compile for a topology and in the
    run, so that what `maxctx.compile` says fits is what runs."""
    device = mesh.devices.flat[0]
    if device.platform != "tpu":
        return None
    limit = config.tpu_scoped_vmem_limit_kib
    if limit == -1:
        from maxctx.plan import topology

        chip = next((c for c in topology.CHIPS.values() if c.device_kind == device.device_kind), None)
        limit = chip.scoped_vmem_kib if chip is not None else 0
    options = {} if config.tpu_sparse_core_gathers else {SPARSE_CORE_GATHER_FLAG: False}
    if limit > 0:
        options["xla_tpu_scoped_vmem_limit_kib"] = limit
    return options or None


def jit_train_step(setup: TrainSetup):
    replicated = NamedSharding(setup.mesh, P())
    return jax.jit(train_step_fn(setup), in_shardings=(setup.state_shardings, setup.batch_shardings),
                   out_shardings=(setup.state_shardings, replicated), donate_argnums=0)


def compile_train_step(setup: TrainSetup):
    """AOT-compiles the step for the abstract state and batch; returns the `Compiled` (callable like the step)."""
    lowered = jit_train_step(setup).lower(setup.abstract_state, setup.abstract_batch())
    return lowered.compile(compiler_options=compiler_options(setup.config, setup.mesh))


DIGEST_SUFFIX = ".sha256"  # beside a compiled_trainstep_file: sha256sum's line for the file's exact bytes


def save_compiled(compiled, path: str) -> None:
    """MaxText's compiled_trainstep_file: the serialized executable (written by `python -m maxctx.compile`, also for
    a TPU topology from a CPU machine), loaded by training instead of compiling at start. Its sha256 goes beside it,
    after it, for `read_compiled`."""
    from etils import epath
    from jax.experimental.serialize_executable import serialize

    data = pickle.dumps(serialize(compiled))
    epath.Path(path).write_bytes(data)
    epath.Path(path + DIGEST_SUFFIX).write_text(f"{hashlib.sha256(data).hexdigest()}  {epath.Path(path).name}\n")


def _rewrite(path: str) -> str:
    return f"write it with python -m maxctx.compile <this run's config> compiled_trainstep_file={path}"


def read_compiled(path: str, trusted: bool) -> bytes:
    """The bytes of a compiled_trainstep_file, unless `trusted` only when they match the sha256 `save_compiled`
    wrote beside them: unpickling them (deserialize_and_load unpickles too) runs whatever code they name, so a file
    maxctx did not write, or one changed since, is refused before anything reads it as a pickle."""
    from etils import epath

    file, digest = epath.Path(path), epath.Path(path + DIGEST_SUFFIX)
    if not file.exists():
        raise ConfigError(f"compiled_trainstep_file={path} does not exist; {_rewrite(path)}, or drop the key")
    data = file.read_bytes()
    if trusted:
        return data
    if not digest.exists():
        why = f"was not written by `python -m maxctx.compile` (no {digest.name} beside it)"
    elif digest.read_bytes().split()[:1] != [hashlib.sha256(data).hexdigest().encode()]:
        why = f"was changed since `python -m maxctx.compile` wrote it (its sha256 is not the one in {digest.name})"
    else:
        return data
    raise ConfigError(f"compiled_trainstep_file={path} {why}, and loading it runs code from it; {_rewrite(path)}, "
                      f"or set compiled_trainstep_file_trusted=true if you trust whoever wrote it")


def load_compiled(path: str, setup: TrainSetup):
    """The step saved by `save_compiled` (checked by `read_compiled` unless compiled_trainstep_file_trusted),
    checked against this run's state and batch (shapes and dtypes)."""
    from jax.experimental.serialize_executable import deserialize_and_load

    data = read_compiled(path, setup.config.compiled_trainstep_file_trusted)
    try:
        compiled = deserialize_and_load(*pickle.loads(data))
    except Exception as e:  # a different platform, jax version or topology; a damaged file
        raise ConfigError(f"compiled_trainstep_file={path} cannot be loaded here ({str(e).splitlines()[0][:200]}); "
                          f"{_rewrite(path)}") from None
    spec = lambda tree: jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), tree)  # noqa: E731
    if spec(compiled.args_info[0]) != spec((setup.abstract_state, setup.abstract_batch())):
        raise ConfigError(f"compiled_trainstep_file={path} was compiled for another model, batch or mesh; "
                          f"{_rewrite(path)}")
    return compiled
