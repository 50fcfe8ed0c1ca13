"""The one table that maps logical axis names to mesh axes, and the shardings it implies.

Model code names array dimensions logically (parameters through ``nn.with_logical_partitioning``,
activations through ``nn.with_logical_constraint``); this module is the only place that says
which mesh axis each name is split over. Rules are tried in order and a mesh axis is used at most
once per array, so an activation ``[batch, length, embed]`` splits ``batch`` over
``(data, fsdp)``, ``length`` over ``context`` (context parallelism; size 1 unless the mesh
asks) and leaves ``embed`` whole, while a weight ``[embed, mlp]`` (no batch) splits
``embed`` over ``fsdp`` (FSDP) and ``mlp`` over ``tensor`` (tensor parallelism).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from transformers_jax.config import ConfigError

LogicalRules = Sequence[tuple[str, str | tuple[str, ...] | None]]

LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),  # activations: every data-parallel device gets its rows
    ("vocab", "tensor"),  # embedding rows and logits
    ("embed", "fsdp"),  # parameters: FSDP shards the model width (unused if batch took fsdp)
    ("heads", "tensor"),  # attention: each tensor shard owns whole heads
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),  # MLP: up is column-parallel, down row-parallel
    ("head_dim", None),
    ("length", "context"),  # activations' sequence: context parallelism (parallel/context.py)
    ("layers", None),  # the stacked-layer axis of a scanned model
)

# Which ModelConfig field sets the size of a logical axis (for error messages).
_AXIS_FIELD = {
    "vocab": "model.vocab_size",
    "embed": "model.d_model",
    "heads": "model.n_heads",
    "kv_heads": "model.n_kv_heads",
    "mlp": "model.d_ff",
    "head_dim": "model.head_dim",
    "length": "model.max_len",
}


def _axes_tuple(axes: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _is_boxed(x: Any) -> bool:
    return isinstance(x, nn.meta.AxisMetadata)


def abstract_variables(model: nn.Module, example_batch: dict, inputs=None) -> dict:
    """``model.init``'s variables as shapes only (boxed with their logical names), no FLOPs.
    ``inputs(batch)`` picks the keyword inputs (default ``learning.step.model_inputs``)."""
    if inputs is None:
        from transformers_jax.learning.step import model_inputs as inputs

    return jax.eval_shape(
        lambda key: model.init(key, example_batch["inputs"], **inputs(example_batch)),
        jax.random.key(0),
    )


def logical_specs(boxed_tree: Any) -> Any:
    """Logical ``PartitionSpec`` per leaf (``P()`` for parameters declared without names)."""
    return nn.get_partition_spec(boxed_tree)


def mesh_shardings(boxed_tree: Any, mesh: Mesh, rules: LogicalRules = LOGICAL_RULES) -> Any:
    """``NamedSharding`` per leaf of a tree of boxed (logically named) arrays."""
    return nn.logical_to_mesh_sharding(logical_specs(boxed_tree), mesh, rules)


def batch_spec(ndim: int, rules: LogicalRules = LOGICAL_RULES) -> P:
    """Mesh ``PartitionSpec`` of a batch array ``[batch, ...]``: rows split, the rest whole."""
    return nn.logical_to_mesh_axes(("batch",) + (None,) * (ndim - 1), rules)


def batch_shardings(batch: dict, mesh: Mesh, rules: LogicalRules = LOGICAL_RULES) -> dict:
    return {k: NamedSharding(mesh, batch_spec(v.ndim, rules)) for k, v in batch.items()}


def data_parallel_size(mesh: Mesh, rules: LogicalRules = LOGICAL_RULES) -> int:
    """How many ways the batch is split: the product of the mesh axes ``batch`` maps to."""
    spec = batch_spec(1, rules)
    return math.prod(mesh.shape[a] for a in _axes_tuple(spec[0]))


def length_axes(rules: LogicalRules = LOGICAL_RULES) -> tuple[str, ...]:
    """The mesh axes the activations' ``length`` is split over (``("context",)``)."""
    return _axes_tuple(nn.logical_to_mesh_axes(("length",), rules)[0])


def context_parallel_size(mesh: Mesh, rules: LogicalRules = LOGICAL_RULES) -> int:
    """How many ways each sequence is split: the product of the mesh axes ``length`` maps to
    (1 without context parallelism)."""
    return math.prod(mesh.shape.get(a, 1) for a in length_axes(rules))


def _path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def check_shardable(
    boxed_params: Any, mesh: Mesh, rules: LogicalRules = LOGICAL_RULES
) -> None:
    """Fail, naming the parameter, dimension and fix, if a dimension cannot be split evenly.

    For example 2 key/value heads cannot be split over ``tensor=4``.
    """
    flat = jax.tree_util.tree_flatten_with_path(boxed_params, is_leaf=_is_boxed)[0]
    for path, leaf in flat:
        if not _is_boxed(leaf):
            continue
        names = tuple(leaf.names)
        spec = nn.logical_to_mesh_axes(names, rules)
        shape = leaf.value.shape
        for dim, (logical, axes) in enumerate(zip(names, spec, strict=False)):
            axes = _axes_tuple(axes)
            ways = math.prod(mesh.shape[a] for a in axes)
            if ways > 1 and shape[dim] % ways:
                field = _AXIS_FIELD.get(logical, f"the {logical!r} size")
                gcd = math.gcd(shape[dim], mesh.size)
                fits = [d for d in range(1, gcd + 1) if gcd % d == 0]
                mesh_text = "x".join(f"{a}={mesh.shape[a]}" for a in axes)
                raise ConfigError(
                    f"mesh: parameter {_path_name(path)} has {logical}={shape[dim]} "
                    f"(dimension {dim}), which cannot be split evenly over {mesh_text}; "
                    f"make {field} a multiple of {ways}, or use a mesh whose "
                    f"{'*'.join(axes)} size divides both {shape[dim]} and the {mesh.size} "
                    f"devices: one of {fits}"
                )


def check_batch(
    batch_size: int, mesh: Mesh, grad_accum: int = 1, rules: LogicalRules = LOGICAL_RULES,
    groups: int = 1,
) -> None:
    """The global batch must split into ``grad_accum`` micro-batches, each split evenly over
    the data-parallel devices, and each device's rows into ``groups`` row groups."""
    ways = data_parallel_size(mesh, rules)
    if batch_size % (ways * grad_accum * groups):
        unit = ways * grad_accum * groups
        ok = [unit * m for m in range(1, 5)]
        grouped = f" x concurrent_groups={groups}" if groups > 1 else ""
        knobs = ("the mesh, train.grad_accum or train.concurrent_groups" if groups > 1
                 else "the mesh or train.grad_accum")
        raise ConfigError(
            f"train.batch_size={batch_size}: must be a multiple of {unit} = "
            f"{ways} data-parallel devices (data x fsdp) x grad_accum={grad_accum}{grouped}; "
            f"use a batch size in {ok}, or change {knobs}"
        )
