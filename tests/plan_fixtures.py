"""The plan tests' compiles for a TPU (or GPU) target, each made once per test process.

``compile_train`` is deterministic in its arguments, and several tests ask for the same step:
the one-chip TINY step is the compile matrix's, the seeds test's baseline and the one-chip
plan's; ``plan`` and ``search`` compile again the steps of a context mesh that
``compare_context_methods`` has just compiled. ``memoised_compile_train`` compiles a step the
first time it is asked for and hands out copies of that result afterwards; ``use_memo`` routes
``plan``, ``search`` and ``compare_context_methods`` through it. What each test asserts about
a step is unchanged: only a second compile of the same program is saved (a TPU program cannot
go through JAX's persistent cache: its compile-only client cannot load one back).
"""

import copy
import dataclasses

from transformers_jax.parallel.mesh import parse_mesh
from transformers_jax.plan import command, steps

REAL_COMPILE_TRAIN = steps.compile_train
_RESULTS: dict[tuple, dict] = {}


def _key(model_cfg, cfg, target, seeds, hlo_out) -> tuple:
    """Equal keys compile the same program: the configs (the mesh by its axis sizes, so that
    ``data=1,context=4`` and ``data=1,fsdp=1,context=4,tensor=1`` meet) and the target."""
    mesh = None if cfg.mesh is None else tuple(parse_mesh(cfg.mesh, len(target.devices)).items())
    train = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "mesh"}
    return (repr(model_cfg), repr(train), mesh, target.name, target.chip.name,
            len(target.devices), seeds, hlo_out)


def memoised_compile_train(model_cfg, cfg, target, seeds: int = 1, hlo_out=None) -> dict:
    """``plan.steps.compile_train``, compiled once per distinct step in this process."""
    key = _key(model_cfg, cfg, target, seeds, hlo_out)
    if key not in _RESULTS:
        _RESULTS[key] = REAL_COMPILE_TRAIN(model_cfg, cfg, target, seeds, hlo_out)
    return copy.deepcopy(_RESULTS[key])


def use_memo(monkeypatch) -> None:
    """``plan``, ``search`` and ``compare_context_methods`` compile through the memo."""
    monkeypatch.setattr(steps, "compile_train", memoised_compile_train)
    monkeypatch.setattr(command, "compile_train", memoised_compile_train)
