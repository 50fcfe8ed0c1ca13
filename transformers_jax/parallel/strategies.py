"""One train step, four ways to run it: ``single``, ``pmap``, ``shard_map`` and ``jit``.

Shape legend: B global batch, b per-device batch, T length, k micro-batches (grad_accum).

Every strategy computes the same thing as one device on the whole global batch: the
token-weighted mean loss ``sum(w * loss) / sum(w)`` over *all* tokens (not a mean of per-shard
means, which differs whenever shards carry different weight totals), its gradient, and one
optimizer update. What differs is who holds what:

- ``single``: one device, plain ``jax.jit``; the reference.
- ``pmap``: state replicated on every local device, the batch split ``[devices, b, T]``; each
  device differentiates its weighted loss *sum*, and one ``lax.psum`` adds sums and gradients.
- ``shard_map``: the same data parallelism written over a mesh axis. With ``check_vma=True``
  (the default) a replicated (``P()``) input's gradient is already summed over the mapped axes,
  so the pmap idiom ``pmean(grads)`` would give N times the gradient. We differentiate the
  global loss ``psum(local sum)`` instead and let JAX insert the one all-reduce. An attention
  implementation whose kernel has no varying-axis types (``typed_under_shard_map=False``:
  Pallas) runs with ``check_vma=False`` and the pmap idiom (local gradient sums, one psum).
  A ``context`` axis (``data=D,context=C``) also splits the sequence: every batch array
  ``[B, T, ...]`` maps as ``P(data, context)``, so each device holds ``[b, T/C]``; the step
  gives the shard its tokens' global positions (``context.shard_batch``) and, while it is
  traced, routes the model's attention to ``context.local_attention_hook`` (the ring or
  all-gather body on the local q, k, v) and its bias's key positions to an all-gather
  (``nn.attention.every_key``). The sums, and so the gradient, go over ``data`` and
  ``context`` together: the same global loss, the same single all-reduce.
- ``jit``: global arrays on a ``data x fsdp x context x tensor`` mesh. Parameters and optimizer
  state are placed by the logical-axis rules (``rules.LOGICAL_RULES``): FSDP shards them over
  ``fsdp``, tensor parallelism splits heads, MLP width and vocabulary over ``tensor``;
  activations follow the model's logical constraints, their length split over ``context``
  (context parallelism: attention across the shards by ``context.attention_hook``, an
  all-gather of keys and values or a ring, zigzag or not). XLA (GSPMD) inserts the other
  collectives.

Gradient accumulation (``grad_accum=k``) scans over k micro-batches inside the step, adding
weighted loss sums and gradients of sums, and normalises once by the global weight: exactly the
large-batch step, with the activation memory of one micro-batch.

Concurrent row groups (``groups=g``, ``train.concurrent_groups``) split each (micro-)batch
again, into g interleaved groups of rows whose forward and backward passes are independent in
the program (``learning.step.grouped_sums_and_grads``), summed the same way: the same update, in
pieces that XLA:CPU runs side by side on its threads (no memory saved). They are the CPU
backend's (``backends/cpu.py``): a mesh of other devices refuses g > 1.

Dropout: the key is split from ``state.rng`` as ``learning.step`` does; pmap and shard_map fold in
the device index (shard_map: its data and context indices), micro-batches and row groups their
index, so masks (and the draws of randomised position schemes) differ from a one-device run
(same distribution). The "same numbers as one device" guarantee is for ``dropout=0``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from transformers_jax import backends
from transformers_jax.config import ConfigError
from transformers_jax.learning.step import (  # the shared step math: this module's API too
    TrainState,
    apply_update,
    finish_metrics,
    grouped_sums_and_grads,
    init_state,
    model_inputs,
    split_micro_batches,
    weighted_sums,
)
from transformers_jax.nn.attention import across_shards
from transformers_jax.parallel import multihost
from transformers_jax.parallel.context import (
    attention_hook,
    check_context,
    gather_keys,
    local_attention_hook,
    shard_batch,
)
from transformers_jax.parallel.mesh import CONTEXT_AXIS, make_mesh, mesh_shape
from transformers_jax.parallel.rules import (
    LOGICAL_RULES,
    LogicalRules,
    abstract_variables,
    batch_shardings,
    batch_spec,
    check_batch,
    check_shardable,
    mesh_shardings,
)

STRATEGIES = ("single", "pmap", "shard_map", "jit")
DATA_AXIS = "data"


# The math shared by every strategy -------------------------------------------------------------
def sums_and_grads(
    model: nn.Module,
    params: Any,
    batch: dict,
    rng: jax.Array,
    grad_accum: int = 1,
    *,
    objective: Any = None,
    vary: Callable[[Any], Any] = lambda t: t,
    constrain_grads: Callable[[Any], Any] = lambda g: g,
    groups: int = 1,
) -> tuple[dict, jax.Array, Any]:
    """``(sums, weight, grad of sums["loss"])`` over ``batch`` (see ``weighted_sums``).

    With ``grad_accum > 1`` the batch is split into micro-batches and a ``lax.scan`` adds their
    sums and gradients (one micro-batch's activations alive at a time). Each (micro-)batch is
    computed as ``groups`` independent row groups (``learning.step.grouped_sums_and_grads``).
    Inside ``shard_map``, ``vary`` marks the zero scalar accumulators as device-varying (the
    gradient accumulators take the kind of ``params``); under ``jit``, ``constrain_grads``
    keeps the gradient accumulator sharded like the parameters (FSDP).
    """

    def one(mb: dict, key: jax.Array):
        sums, weight, grads = grouped_sums_and_grads(model, params, mb, key, groups,
                                                     objective=objective)
        return sums, weight, constrain_grads(grads)

    if grad_accum == 1:
        return one(batch, rng)

    micro = split_micro_batches(batch, grad_accum)
    first = jax.tree.map(lambda x: x[0], micro)
    shapes = jax.eval_shape(lambda: one(first, rng)[:2])  # the metric names and dtypes
    zero_sums = jax.tree.map(lambda s: vary(jnp.zeros(s.shape, s.dtype)), shapes)
    init = (*zero_sums, constrain_grads(jax.tree.map(jnp.zeros_like, params)))

    def body(carry, xs):
        index, mb = xs
        return jax.tree.map(jnp.add, carry, one(mb, jax.random.fold_in(rng, index))), None

    (sums, weight, grads), _ = lax.scan(body, init, (jnp.arange(grad_accum), micro))
    return sums, weight, grads


def split_rng(rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(next state rng, dropout key)`` exactly as ``make_train_step`` splits it; the state
    keeps whichever form it had (raw ``uint32`` key data or a typed key)."""
    typed = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
    new, dropout = jax.random.split(rng if typed else jax.random.wrap_key_data(rng))
    return (new if typed else jax.random.key_data(new)), dropout


# The trainer -----------------------------------------------------------------------------------
@dataclasses.dataclass
class ParallelTrainer:
    """A strategy's compiled steps plus the placement of state and batches.

    ``state = trainer.init_state(seed)``, then ``state, metrics = trainer.step(state, batch)``
    with a host (numpy) global batch or one already placed by ``trainer.place_batch``;
    ``trainer.eval_step(state.params, batch)`` evaluates without dropout.
    ``trainer.unreplicate(state)`` gives the plain ``TrainState`` (one copy of every array);
    ``trainer.place_state(state)`` does the reverse (e.g. for a restored checkpoint).

    Ahead of time (``tjax plan``): ``trainer.abstract_state()`` gives the state's shapes and
    shardings without allocating anything (nor setting a mesh inside a trace), and
    ``trainer.lower(state, trainer.abstract_batch(batch))`` lowers the real step for the
    mesh's devices, which need not be this host's (a TPU topology from
    ``jax.experimental.topologies``). Every strategy but ``pmap`` (bound to local devices).

    Several processes: each may build only its own rows of the global batch,
    ``batch[trainer.local_rows(B)]``, and pass them as ``trainer.place_batch(rows,
    local=True)``; or every process passes the whole global batch and keeps its rows.
    """

    strategy: str
    mesh: Mesh
    grad_accum: int
    rules: LogicalRules
    init_state: Callable[[int], TrainState]
    place_state: Callable[[TrainState], TrainState]
    place_batch: Callable[..., dict]  # (batch, local=False) -> the batch as the step wants it
    local_rows: Callable[[int], slice]  # global batch size -> this process's rows
    unreplicate: Callable[[TrainState], TrainState]
    _train_step: Callable
    _eval_step: Callable
    state_shardings: Any = None  # jit/single: the NamedSharding of every state leaf
    # jit/single, before ``jax.jit``, to be traced inside ``traced()`` (``parallel.seeds``
    # vmaps them over stacked seeds): the step, ``(state, batch) -> (state, metrics)``, and the
    # initial state of a (traced) integer seed, ``seed -> state`` (``init_state``'s values)
    step_fn: Callable | None = None
    init_fn: Callable | None = None
    abstract_state: Callable[[], TrainState] | None = None  # None: pmap (local devices only)
    batch_shardings: Callable[[dict], dict] | None = None  # batch -> NamedSharding per key
    context_attention: str = "all_gather"  # with a context axis: all_gather, ring, ring_zigzag

    def traced(self):
        """The context this strategy's steps are traced in (the mesh and logical-axis rules
        of jit and single, and attention across sequence shards with a context axis; nothing
        for pmap and shard_map)."""
        if self.strategy in ("jit", "single"):
            return mesh_rules(self.mesh, self.rules, self.context_attention)
        return contextlib.nullcontext()

    def abstract_batch(self, batch: dict) -> dict:
        """``jax.ShapeDtypeStruct`` per key of a global batch (arrays or shapes), placed as
        the step wants it."""
        shardings = self.batch_shardings(batch)
        return {k: jax.ShapeDtypeStruct(np.shape(v), v.dtype, sharding=shardings[k])
                for k, v in batch.items()}

    def lower(self, state: Any, batch: dict) -> Any:
        """The train step lowered for (abstract or real) ``state`` and ``batch``;
        ``.compile()`` it for its memory and cost analysis."""
        if self.abstract_state is None:
            raise ConfigError(f"train.strategy={self.strategy!r} runs on this host's devices "
                              "only and cannot be compiled ahead of time for other devices; "
                              "use jit, shard_map or single")
        with self.traced():
            return self._train_step.lower(state, batch)

    def step(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        if _is_host_batch(batch):
            batch = self.place_batch(batch)
        with self.traced():
            return self._train_step(state, batch)

    def eval_step(self, params: Any, batch: dict) -> dict:
        """Metrics of ``params`` (as held in this strategy's state) on a global batch."""
        if _is_host_batch(batch):
            batch = self.place_batch(batch)
        with self.traced():
            return self._eval_step(params, batch)


@contextlib.contextmanager
def mesh_rules(mesh: Mesh, rules: LogicalRules = LOGICAL_RULES,
               context_attention: str = "all_gather"):
    """``jax.set_mesh(mesh)`` and ``nn.logical_axis_rules(rules)`` while a step is traced: the
    model's ``nn.with_logical_constraint`` calls then become real sharding constraints (with
    no mesh or no rules they are no-ops, which is what pmap and shard_map want). When the rules
    split the sequence over the mesh (a ``context`` axis), the model's attention runs across
    the shards by ``context_attention`` (``all_gather``, ``ring`` or ``ring_zigzag``;
    ``parallel/context.py``)."""
    hook = attention_hook(mesh, rules, context_attention)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules), across_shards(hook):
        yield


@contextlib.contextmanager
def _traced_for(mesh: Mesh, rules: LogicalRules):
    """Shapes evaluated (``jax.eval_shape``) for the mesh's devices: its abstract mesh only,
    so eager values made meanwhile (a PRNG key) stay on this host even when the mesh's
    devices are a compile target elsewhere."""
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(rules):
        yield


def _is_host_batch(batch: dict) -> bool:
    return any(isinstance(v, np.ndarray) for v in batch.values())


# The mesh axes a strategy that maps the step itself splits: batches, and for shard_map
# sequences (the trainer hands each device its shard); parameters and heads need GSPMD (jit)
_MAPPED_AXES = {"pmap": (DATA_AXIS,), "shard_map": (DATA_AXIS, CONTEXT_AXIS)}
_WHAT_AXIS_SHARDS = {"fsdp": "parameters (fsdp)",
                     "context": "sequences (context; train.strategy=shard_map splits them too)",
                     "tensor": "heads/MLP (tensor)"}


def _check_splits(batch: dict, ways: int) -> None:
    """Under shard_map each device takes 1/ways of every row: a length that does not split
    is refused here, with the fix, rather than deep inside the map."""
    for key, x in batch.items():
        if ways > 1 and np.ndim(x) >= 2 and np.shape(x)[1] % ways:
            raise ConfigError(
                f"batch[{key!r}] has rows of {np.shape(x)[1]} tokens, which do not split into "
                f"context={ways} equal shards under train.strategy='shard_map'; use a length "
                f"that is a multiple of {ways} (train.seq_len, or the evaluation length), or "
                "train.strategy=jit, which takes any length")


def _check_strategy_mesh(strategy: str, mesh: Mesh) -> None:
    allowed = _MAPPED_AXES.get(strategy)
    if allowed is None:
        return
    others = {a: size for a, size in mesh_shape(mesh).items() if a not in allowed and size != 1}
    if others:
        got = ", ".join(f"{a}={size}" for a, size in others.items())
        form = ",".join(f"{a}={a[0].upper()}" for a in allowed)
        raise ConfigError(
            f"train.strategy={strategy!r} splits only {' and '.join(allowed)}, so the mesh "
            f"must be '{form}' (got {got}); use train.strategy=jit to shard "
            f"{', '.join(_WHAT_AXIS_SHARDS[a] for a in others)}"
        )


def make_trainer(
    strategy: str,
    model: nn.Module,
    optimizer: optax.GradientTransformation,
    example_batch: dict,
    *,
    mesh: Mesh | str | None = None,
    schedule: Callable | None = None,
    grad_accum: int = 1,
    objective: Any = None,
    rules: LogicalRules = LOGICAL_RULES,
    donate: bool = True,
    groups: int = 1,
    context_attention: str = "all_gather",
) -> ParallelTrainer:
    """Build the train/eval steps of ``strategy`` for global batches shaped like
    ``example_batch`` (a host dict of ``[B, ...]`` arrays).

    ``mesh``: a ``Mesh`` or a spec string (``"data=4,fsdp=2,tensor=1"``; default: every device
    on ``data``); ``single`` ignores it and uses the first device. ``objective``: a
    ``learning.objectives.Objective`` (default: next-token LM, as ``learning.step``). ``donate``:
    the step reuses the input state's buffers (do not touch a state after passing it in).
    ``groups``: each (micro-)batch computed as this many independent row groups
    (``train.concurrent_groups``; ``learning.step.grouped_sums_and_grads``): for CPU devices only,
    a ConfigError for others. ``context_attention``: how attention crosses the sequence
    shards of a mesh with a ``context`` axis (``all_gather`` of keys and values, ``ring``, or
    ``ring_zigzag``; ``parallel/context.py``); ignored without one.
    """
    if strategy not in STRATEGIES:
        raise ConfigError(f"train.strategy={strategy!r}: valid choices: {', '.join(STRATEGIES)}")
    if grad_accum < 1:
        raise ConfigError(f"train.grad_accum={grad_accum}: must be a positive integer")
    if groups < 1:
        raise ConfigError(f"train.concurrent_groups={groups}: must be a positive integer")
    if strategy == "single":
        if jax.process_count() > 1:
            raise ConfigError(
                f"train.strategy='single' runs on one device, but this is one of "
                f"{jax.process_count()} processes; use train.strategy=jit (or pmap/shard_map)"
            )
        # one device: of the mesh given (a compile target), else this host's first
        first = mesh.devices.flat[:1] if isinstance(mesh, Mesh) else jax.devices()[:1]
        mesh = make_mesh("data=1", devices=list(first))
    elif not isinstance(mesh, Mesh):
        mesh = make_mesh(mesh)
    _check_strategy_mesh(strategy, mesh)
    check_context(strategy, mesh, rules, example_batch, model.config, context_attention)
    backends.for_devices(mesh.devices.flat).programs.check_row_groups(groups)  # XLA:CPU's only
    check_batch(int(np.shape(example_batch["inputs"])[0]), mesh, grad_accum, rules, groups)
    build = _pmap_trainer if strategy == "pmap" else (
        _shard_map_trainer if strategy == "shard_map" else _jit_trainer)
    trainer = build(_Setup(strategy, model, optimizer, example_batch, mesh, schedule,
                           grad_accum, objective, rules, (0,) if donate else (), groups,
                           context_attention))
    return dataclasses.replace(trainer, context_attention=context_attention)


@dataclasses.dataclass(frozen=True)
class _Setup:
    strategy: str
    model: nn.Module
    optimizer: optax.GradientTransformation
    example_batch: dict
    mesh: Mesh
    schedule: Callable | None
    grad_accum: int
    objective: Any
    rules: LogicalRules
    donate: tuple[int, ...]
    groups: int = 1
    context_attention: str = "all_gather"

    def fresh(self, seed: int | jax.Array) -> TrainState:
        """``learning.step.init_state`` (for any objective) of ``seed``, a Python int or a traced
        integer (the same values), to be traced."""
        example = {k: jnp.zeros(np.shape(v), np.asarray(v).dtype)
                   for k, v in self.example_batch.items()}
        return init_state(self.model, self.optimizer, seed, example, self.objective)

    def init(self, seed: int, out_shardings=None) -> TrainState:
        """``fresh(seed)`` compiled as one program: much faster than op by op, and the same
        values whichever strategy asks. With ``out_shardings`` every array is created directly
        in its shards, so a model too big for one device never has to fit on one."""
        return jax.jit(lambda: self.fresh(seed), out_shardings=out_shardings)()

    def inputs(self, batch: dict) -> dict:
        if self.objective is None:
            return model_inputs(batch)
        return self.objective.inputs(batch)


def _jit_trainer(c: _Setup) -> ParallelTrainer:
    mesh, rules = c.mesh, c.rules
    with _traced_for(mesh, rules):  # which path attention takes follows the mesh's devices
        abstract = abstract_variables(c.model, c.example_batch, c.inputs)
        abstract_state = jax.eval_shape(lambda: c.init(0))
    check_shardable(abstract["params"], mesh, rules)
    param_sh = mesh_shardings(abstract["params"], mesh, rules)
    replicated = NamedSharding(mesh, P())
    # a masked optimizer (LoRA: learning.lora.adapters_only) keeps MaskedNode, no array, where
    # it trains nothing
    opt_sh = optax.tree_utils.tree_map_params(
        c.optimizer, lambda x, s: x if isinstance(x, optax.MaskedNode) else s,
        abstract_state.opt_state, param_sh, transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, optax.MaskedNode),
    )
    state_sh = TrainState(step=replicated, params=param_sh, opt_state=opt_sh, rng=replicated)

    def step_with(constrain_grads: Callable[[Any], Any]) -> Callable:
        def train_step(state, batch):
            rng, dropout_rng = split_rng(state.rng)
            sums, weight, grads = sums_and_grads(
                c.model, state.params, batch, dropout_rng, c.grad_accum, objective=c.objective,
                constrain_grads=constrain_grads, groups=c.groups,
            )
            return apply_update(c.optimizer, state, rng, sums, weight, grads, c.schedule)

        return train_step

    train_step = step_with(lambda g: lax.with_sharding_constraint(g, param_sh))
    # single: the step other programs map over seeds, maybe on other devices than this mesh's
    # one (parallel.seeds); there the constraint, a no-op on one device, would name the wrong one
    step_fn = step_with(lambda g: g) if c.strategy == "single" else train_step

    def eval_step(params, batch):
        return finish_metrics(*weighted_sums(c.model, params, batch, deterministic=True,
                                             objective=c.objective))

    def place_batch(batch: dict, local: bool = False) -> dict:
        return multihost.global_batch(batch, batch_shardings(batch, mesh, rules), local=local)

    def local_rows(batch_size: int) -> slice:
        return multihost.local_rows(NamedSharding(mesh, batch_spec(1, rules)), (batch_size,))

    def init(seed: int) -> TrainState:
        with mesh_rules(mesh, rules, c.context_attention):
            return c.init(seed, out_shardings=state_sh)

    def placed_abstract_state() -> TrainState:
        return _with_shardings(abstract_state, state_sh)

    return ParallelTrainer(
        strategy=c.strategy, mesh=mesh, grad_accum=c.grad_accum, rules=rules, init_state=init,
        place_state=lambda state: jax.device_put(state, state_sh),
        place_batch=place_batch, local_rows=local_rows, unreplicate=lambda state: state,
        _train_step=jax.jit(train_step, out_shardings=(state_sh, replicated),
                            donate_argnums=c.donate),
        _eval_step=jax.jit(eval_step, out_shardings=replicated),
        state_shardings=state_sh, abstract_state=placed_abstract_state,
        batch_shardings=lambda batch: batch_shardings(batch, mesh, rules), step_fn=step_fn,
        init_fn=c.fresh,
    )


def _abstract_init(c: _Setup, mesh: Mesh) -> TrainState:
    """The initial state's shapes, traced for the mesh's devices (no rules: replicated)."""
    with _traced_for(mesh, ()):
        return jax.eval_shape(lambda: c.init(0))


def _with_shardings(shapes: Any, shardings: Any) -> Any:
    """``jax.ShapeDtypeStruct`` leaves carrying their shardings (one sharding for all, or a
    matching tree)."""
    if isinstance(shardings, NamedSharding):
        shardings = jax.tree.map(lambda _: shardings, shapes)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)


def _pmap_trainer(c: _Setup) -> ParallelTrainer:
    devices = jax.local_devices()
    n_local = len(devices)

    def train_step(state, batch):
        rng, dropout_rng = split_rng(state.rng)
        dropout_rng = jax.random.fold_in(dropout_rng, lax.axis_index(DATA_AXIS))
        sums, weight, grads = sums_and_grads(c.model, state.params, batch, dropout_rng,
                                             c.grad_accum, objective=c.objective,
                                             groups=c.groups)
        # One all-reduce of the sums and of the gradients of the loss *sum*; apply_update
        # divides by the global weight, so shards with more (weighted) tokens count for more.
        sums, weight, grads = lax.psum((sums, weight, grads), DATA_AXIS)
        return apply_update(c.optimizer, state, rng, sums, weight, grads, c.schedule)

    def eval_step(params, batch):
        sums = weighted_sums(c.model, params, batch, deterministic=True, objective=c.objective)
        return finish_metrics(*lax.psum(sums, DATA_AXIS))

    p_step = jax.pmap(train_step, axis_name=DATA_AXIS, donate_argnums=c.donate)
    p_eval = jax.pmap(eval_step, axis_name=DATA_AXIS)

    def local_rows(batch_size: int) -> slice:
        per = batch_size // jax.process_count()
        return slice(jax.process_index() * per, (jax.process_index() + 1) * per)

    per_device = NamedSharding(Mesh(np.array(devices), (DATA_AXIS,)), P(DATA_AXIS))

    def place_batch(batch: dict, local: bool = False) -> dict:
        """This process's rows as ``[local devices, b, ...]``, one slice on each device."""
        if not local:
            rows = local_rows(int(np.shape(batch["inputs"])[0]))
            batch = {k: np.asarray(v)[rows] for k, v in batch.items()}
        return {k: jax.device_put(np.asarray(v).reshape(n_local, -1, *np.shape(v)[1:]),
                                  per_device) for k, v in batch.items()}

    def first(tree):
        return jax.tree.map(lambda x: x[0], tree)

    def step(state, batch):
        state, metrics = p_step(state, batch)
        return state, first(metrics)

    return ParallelTrainer(
        strategy=c.strategy, mesh=c.mesh, grad_accum=c.grad_accum, rules=c.rules,
        init_state=lambda seed: _replicate(c.init(seed), devices),
        place_state=lambda state: _replicate(state, devices),
        place_batch=place_batch, local_rows=local_rows, unreplicate=first,
        _train_step=step, _eval_step=lambda params, batch: first(p_eval(params, batch)),
    )


def _replicate(tree: Any, devices: list) -> Any:
    """One copy of every leaf per device, stacked on a new leading axis (pmap's layout).
    Laid out as pmap itself returns arrays (a 1-D mesh named after its axis), so the state it
    hands back matches the one it was given and the step is not compiled twice."""
    sharding = NamedSharding(Mesh(np.array(devices), (DATA_AXIS,)), P(DATA_AXIS))
    return jax.tree.map(lambda x: jax.device_put(jnp.stack([x] * len(devices)), sharding), tree)


def _shard_map_trainer(c: _Setup) -> ParallelTrainer:
    # One builder, kept whole: its train and eval steps, their mapping over the mesh and the
    # batch placement are short closures over what they must agree on (the mesh's summed axes,
    # the sequence split, whether shard_map checks varying axes); split apart, each would take
    # all of it as arguments.
    mesh = c.mesh
    replicated = NamedSharding(mesh, P())
    ways = mesh_shape(mesh)[CONTEXT_AXIS]
    # every value that differs between devices differs over these; sums add over them
    axes = (DATA_AXIS, CONTEXT_AXIS) if ways > 1 else DATA_AXIS
    hook = local_attention_hook(c.context_attention, ways) if ways > 1 else None

    def spec(x) -> P:
        """Rows over data; with a context axis, a sequence ``[B, T, ...]`` also over it."""
        return P(DATA_AXIS, CONTEXT_AXIS) if ways > 1 and np.ndim(x) >= 2 else P(DATA_AXIS)

    # A kernel whose outputs carry no varying-axis types (Pallas) cannot run under
    # check_vma=True; without the check nothing is summed implicitly, so the step sums its
    # local gradients itself (the accumulation path below), as pmap does.
    checked = c.model.config.attention.typed_under_shard_map

    def vary(x):  # mark a value as differing across devices
        return lax.pcast(x, axes, to="varying") if checked else x

    def device_key(key):
        """A dropout key of this device's own: its rows and, split, its part of a sequence."""
        key = jax.random.fold_in(key, lax.axis_index(DATA_AXIS))
        return jax.random.fold_in(key, lax.axis_index(CONTEXT_AXIS)) if ways > 1 else key

    def train_step(state, batch):
        rng, dropout_rng = split_rng(state.rng)
        dropout_rng = device_key(dropout_rng)
        batch = shard_batch(batch, ways)
        if c.grad_accum == 1 and c.groups == 1 and checked:
            # Differentiate the *global* loss sum. The parameters are replicated (P()), so with
            # check_vma=True the transpose of their implicit broadcast already sums the
            # gradient over the mesh: no pmean/psum of gradients (that would count N times).
            def global_sum(p):
                local = weighted_sums(c.model, p, batch, deterministic=False, rng=dropout_rng,
                                      objective=c.objective)
                sums, weight = lax.psum(local, axes)
                return sums["loss"], (sums, weight)

            (_, (sums, weight)), grads = jax.value_and_grad(global_sum, has_aux=True)(
                state.params
            )
        else:
            # Accumulate local gradients (of device-varying copies of the parameters, so no
            # communication per micro-batch), then one explicit all-reduce.
            local_params = jax.tree.map(vary, state.params)
            sums, weight, grads = sums_and_grads(
                c.model, local_params, batch, dropout_rng, c.grad_accum, objective=c.objective,
                vary=vary, groups=c.groups,
            )
            sums, weight, grads = lax.psum((sums, weight, grads), axes)
        return apply_update(c.optimizer, state, rng, sums, weight, grads, c.schedule)

    def eval_step(params, batch):
        sums = weighted_sums(c.model, params, shard_batch(batch, ways), deterministic=True,
                             objective=c.objective)
        return finish_metrics(*lax.psum(sums, axes))

    def mapped(fn, out_specs):
        """``fn(state or params, batch)`` mapped over the mesh, attention crossing the
        sequence shards (when split) through ``hook``; the batch's specs follow its arrays'
        ranks, so any batch keys map."""
        def run(first, batch):
            _check_splits(batch, ways)
            with across_shards(hook, gather_keys(ways) if ways > 1 else None):
                return jax.shard_map(fn, mesh=mesh, in_specs=(P(), jax.tree.map(spec, batch)),
                                     out_specs=out_specs, check_vma=checked)(first, batch)
        return run

    def shardings(batch: dict) -> dict:
        return {k: NamedSharding(mesh, spec(v)) for k, v in batch.items()}

    def place_batch(batch: dict, local: bool = False) -> dict:
        _check_splits(batch, ways)
        return multihost.global_batch(batch, shardings(batch), local=local)

    def local_rows(batch_size: int) -> slice:
        return multihost.local_rows(NamedSharding(mesh, P(DATA_AXIS)), (batch_size,))

    return ParallelTrainer(
        strategy=c.strategy, mesh=mesh, grad_accum=c.grad_accum, rules=c.rules,
        init_state=lambda seed: jax.device_put(c.init(seed), replicated),
        place_state=lambda state: jax.device_put(state, replicated),
        place_batch=place_batch, local_rows=local_rows, unreplicate=lambda state: state,
        _train_step=jax.jit(mapped(train_step, (P(), P())), donate_argnums=c.donate),
        _eval_step=jax.jit(mapped(eval_step, P())),
        abstract_state=lambda: _with_shardings(_abstract_init(c, mesh), replicated),
        batch_shardings=shardings,
    )
