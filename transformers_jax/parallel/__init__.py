"""Scaling out: meshes, the logical-axis rules table, parallel train steps, multi-host (remat
and scan over layers live in ``nn/stack.py``).

``make_trainer(strategy, model, optimizer, example_batch, mesh="data=4,fsdp=2,tensor=1")``
gives the steps of one strategy (``single``, ``pmap``, ``shard_map``, ``jit``); all of them
compute the same update as one device on the same global batch. A ``context`` mesh axis
(``mesh="data=2,context=4"``, strategy ``jit`` or ``shard_map``) splits sequences, attention
crossing the shards by an all-gather of keys/values or a ring (``parallel/context.py``).
``stack_seeds(trainer, S)`` steps S seeds of a ``single`` trainer as one program
(``parallel/seeds.py``).
"""

from transformers_jax.parallel.mesh import MESH_AXES, format_mesh, make_mesh, parse_mesh
from transformers_jax.parallel.multihost import fetch, initialize, is_main_process
from transformers_jax.parallel.rules import LOGICAL_RULES, check_batch, check_shardable
from transformers_jax.parallel.seeds import SeedsTrainer, stack_seeds
from transformers_jax.parallel.strategies import (
    STRATEGIES,
    ParallelTrainer,
    make_trainer,
    mesh_rules,
)

__all__ = [
    "LOGICAL_RULES",
    "MESH_AXES",
    "STRATEGIES",
    "ParallelTrainer",
    "SeedsTrainer",
    "check_batch",
    "check_shardable",
    "fetch",
    "format_mesh",
    "initialize",
    "is_main_process",
    "make_mesh",
    "make_trainer",
    "mesh_rules",
    "parse_mesh",
    "stack_seeds",
]
