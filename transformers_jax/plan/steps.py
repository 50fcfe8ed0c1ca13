"""The steps ``tjax plan`` compiles (training through ``parallel.make_trainer``, one KV-cache
decoding step) and the search over meshes and remat policies."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformers_jax.config import CONTEXT_ATTENTION, ConfigError, ModelConfig, TrainConfig
from transformers_jax.learning import lora
from transformers_jax.learning.flops import flops_per_token
from transformers_jax.learning.objectives import objective_for
from transformers_jax.learning.optim import learning_rate_schedule, make_optimizer
from transformers_jax.models import build_model
from transformers_jax.nn.layers import count_params
from transformers_jax.parallel.context import method_refusal
from transformers_jax.parallel.mesh import format_mesh, make_mesh, mesh_shape, parse_mesh
from transformers_jax.parallel.seeds import seed_devices, stack_seeds
from transformers_jax.parallel.strategies import make_trainer, mesh_rules
from transformers_jax.plan.compiled import collectives, cost, memory, roofline
from transformers_jax.plan.hlo import Module
from transformers_jax.plan.ops import op_roofline
from transformers_jax.plan.targets import Target
from transformers_jax.sample import decode_step


def example_batch(model_cfg: ModelConfig, batch_size: int, seq_len: int) -> dict:
    """Shapes of a training batch for the family's objective (nothing allocated)."""
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens,
             "weights": jax.ShapeDtypeStruct((batch_size, seq_len), jnp.float32)}
    if "encoder_inputs" in objective_for(model_cfg.family).input_keys:
        batch["encoder_inputs"] = tokens
    return batch


def host_zeros(batch: dict) -> dict:
    """Host arrays of a batch's shapes, for ``make_trainer``'s batch checks (small)."""
    return {k: np.zeros(v.shape, v.dtype) for k, v in batch.items()}


def compile_train(model_cfg: ModelConfig, cfg: TrainConfig, target: Target, seeds: int = 1,
                  hlo_out: str | None = None) -> dict[str, Any]:
    """Compile ``cfg.strategy``'s training step for ``target``; its memory, cost, collectives
    and roofline. ``seeds > 1``: the step of that many seeds trained together (``parallel.
    seeds``, strategy ``single``), as ``train.seeds.train_seeds`` runs it: over as many of the
    target's devices as divide the seeds (``seed_devices``; one on a CPU target), each device
    its own seeds; FLOPs and memory per device. ``hlo_out``: also write the compiled
    program's HLO text there (to study or re-cost it)."""
    model = lora.wrap(build_model(model_cfg), cfg.lora)  # --train.lora.rank: adapters only
    mesh = make_mesh(cfg.mesh, devices=target.devices)
    batch = example_batch(model_cfg, cfg.batch_size, cfg.seq_len)
    trainer = make_trainer(cfg.strategy, model, make_optimizer(cfg), host_zeros(batch), mesh=mesh,
                           schedule=learning_rate_schedule(cfg), grad_accum=cfg.grad_accum,
                           objective=objective_for(model_cfg.family),
                           groups=cfg.concurrent_groups,
                           context_attention=cfg.context_attention)
    program = trainer if seeds == 1 else stack_seeds(
        trainer, seeds, devices=seed_devices(seeds, target.devices))
    wall = time.perf_counter()
    state = program.abstract_state()
    n = trainer.mesh.size if seeds == 1 else program.devices
    head = {"strategy": cfg.strategy,
            "mesh": format_mesh(mesh_shape(trainer.mesh))
            if seeds == 1 else f"seed={n}",
            **({"context_attention": cfg.context_attention}
               if mesh_shape(trainer.mesh).get("context", 1) > 1 else {}),
            "devices": n, "remat": model_cfg.remat,
            "params": count_params(trainer.abstract_state().params),
            **({"seeds": seeds} if seeds > 1 else {})}
    hbm = target.chip.hbm_bytes / target.devices_per_chip
    try:
        compiled = program.lower(state, program.abstract_batch(batch)).compile()
    except jax.errors.JaxRuntimeError as err:
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        # the TPU compiler refuses a program that cannot fit: that is the answer, not a crash
        return {**head, "compile_s": time.perf_counter() - wall,
                "memory": {"fits": False, "hbm_bytes": int(hbm),
                           "compiler": str(err).splitlines()[0][:300]},
                "roofline": None}
    compile_s = time.perf_counter() - wall
    text = compiled.as_text()
    if hlo_out:
        with open(hlo_out, "w") as f:
            f.write(text)
    module = Module.parse(text)
    comms = collectives(module, n)
    costs = cost(compiled, module)
    tokens = seeds * cfg.batch_size * cfg.seq_len  # per step, over all devices (and seeds)
    model_flops = flops_per_token(model_cfg, cfg.seq_len) * tokens / n
    # MaxText's count: causal attention at half (the roofline's mfu_causal_half)
    model_flops_causal = flops_per_token(model_cfg, cfg.seq_len, causal_half=True) * tokens / n
    ici = sum(c["ici_bytes"] for c in comms.values())
    line = op_roofline(module, target, model_flops, model_flops_causal,
                       causal=model_cfg.mask.causal)
    # the whole-program roofline of before, for comparison
    line["whole_program"] = roofline(costs["flops"], model_flops, costs["bytes_accessed"], ici,
                                     target, model_flops_causal_half=model_flops_causal)
    return {
        **head,
        "compile_s": compile_s,
        "memory": memory(compiled, hbm),
        "flops_per_device": costs["flops"],
        "model_flops_per_device": model_flops,
        "model_flops_causal_half_per_device": model_flops_causal,
        "bytes_accessed_per_device": costs["bytes_accessed"],
        **_loop_fields(costs),
        "collectives": comms,
        "ici_bytes_per_device": ici,
        "roofline": line,
        "tokens_per_s": tokens / line["step_s"],
    }


def _loop_fields(costs: dict[str, Any]) -> dict[str, Any]:
    """XLA's loop-once figures and the loops behind the difference (``compiled.cost``)."""
    return {"xla_flops_per_device": costs["xla_flops"],
            "xla_bytes_accessed_per_device": costs["xla_bytes_accessed"],
            "loops": costs["loops"], "unknown_trip_counts": costs["unknown_trip_counts"]}


def compile_decode(model_cfg: ModelConfig, cfg: TrainConfig, target: Target,
                   batch_size: int, cache_len: int, mesh_spec: str) -> dict[str, Any]:
    """Compile one KV-cache decoding step (``sample.decode_step``, batch ``batch_size`` over a
    cache of ``cache_len`` slots) on the training mesh ``mesh_spec`` (the first devices of the
    target when it uses fewer: strategy single), parameters placed as the jit strategy does."""
    model = build_model(model_cfg)
    n = math.prod(int(part.split("=")[1]) for part in mesh_spec.split(","))  # format_mesh's
    mesh = make_mesh(mesh_spec, devices=target.devices[:n])
    trainer = make_trainer("jit", model, make_optimizer(cfg),
                           host_zeros(example_batch(model_cfg, mesh.size, 128)), mesh=mesh,
                           objective=objective_for(model_cfg.family))
    params = trainer.abstract_state().params
    cache = jax.eval_shape(lambda: model.init_cache(batch_size, cache_len - 1, 1))
    ways = math.prod(mesh.shape[a] for a in ("data", "fsdp"))
    rows = ("data", "fsdp") if batch_size % ways == 0 else None
    P = jax.sharding.PartitionSpec

    def place(leaf):
        spec = P(rows, *([None] * (leaf.ndim - 1))) if leaf.ndim else P()
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                    sharding=jax.sharding.NamedSharding(mesh, spec))

    cache = jax.tree.map(place, cache)
    tokens = place(jax.ShapeDtypeStruct((batch_size,), jnp.int32))
    step = jax.jit(lambda p, t, c: decode_step(model, p, t, c), donate_argnums=2)
    wall = time.perf_counter()
    with mesh_rules(mesh, trainer.rules):
        compiled = step.lower(params, tokens, cache).compile()
    compile_s = time.perf_counter() - wall
    module = Module.parse(compiled.as_text())
    comms = collectives(module, mesh.size)
    costs = cost(compiled, module)
    ici = sum(c["ici_bytes"] for c in comms.values())
    model_flops = flops_per_token(model_cfg, cache_len, training=False) * batch_size / mesh.size
    # one token a row: reading the weights and the cache dominates, which only a per-operation
    # count sees (the whole-program figure is kept for comparison)
    line = op_roofline(module, target, model_flops, causal=model_cfg.mask.causal)
    line["whole_program"] = roofline(costs["flops"], model_flops, costs["bytes_accessed"], ici,
                                     target)
    return {"batch": batch_size, "cache_len": cache_len, "compile_s": compile_s,
            "memory": memory(compiled, target.chip.hbm_bytes / target.devices_per_chip),
            "flops_per_device": costs["flops"],
            "bytes_accessed_per_device": costs["bytes_accessed"], **_loop_fields(costs),
            "collectives": comms,
            "ici_bytes_per_device": ici, "roofline": line,
            "tokens_per_s": batch_size / line["step_s"]}


DEFAULT_REMATS = ("none", "dots_with_no_batch_dims_saveable", "full")  # cheapest first


MESH_SETS = ("all", "fsdp")
# The shortest sequence shard --search splits a sequence into: below it the hops and gathers of
# context parallelism cost more than the activation memory they free.
MIN_CONTEXT_SHARD = 1024


def candidate_meshes(n_devices: int, which: str = "all", per_host: int | None = None,
                     seq_len: int | None = None, min_shard: int = MIN_CONTEXT_SHARD
                     ) -> list[str]:
    """The meshes ``--search`` compiles. ``all``: every ``data x fsdp x context x tensor`` split
    of ``n_devices`` (pure data parallel first, then more FSDP, context and tensor
    parallelism). ``fsdp``: pure data parallelism, and FSDP over the devices times context
    parallelism times tensor parallelism within one host (``per_host`` devices): the layouts
    MaxText's configs use, a fraction of the compiles on a big slice. A sequence of
    ``seq_len`` is split ``c`` ways only into equal shards of at least ``min_shard`` tokens
    (none without ``seq_len``)."""
    divisors = [d for d in range(1, n_devices + 1) if n_devices % d == 0]
    contexts = [c for c in divisors if c == 1 or (
        seq_len is not None and seq_len % c == 0 and seq_len // c >= min_shard)]
    if which == "fsdp":
        host = per_host or n_devices
        shapes = [(n_devices, 1, 1, 1)] + [
            (1, n_devices // (c * t), c, t) for c, t in itertools.product(contexts, divisors)
            if t <= host and n_devices % (c * t) == 0]
    elif which == "all":
        shapes = [(n_devices // (f * c * t), f, c, t)
                  for c, t, f in itertools.product(contexts, divisors, divisors)
                  if n_devices % (f * c * t) == 0]
    else:
        raise ConfigError(f"--search-meshes={which!r}: one of {', '.join(MESH_SETS)}")
    unique = list(dict.fromkeys(shapes))
    return [format_mesh(dict(zip(("data", "fsdp", "context", "tensor"), s, strict=True)))
            for s in unique]


def _context_ways(mesh: str, target: Target) -> int:
    """How many ways ``mesh`` splits each sequence on ``target``'s devices."""
    return parse_mesh(mesh, len(target.devices))["context"]


def context_methods(model_cfg: ModelConfig, cfg: TrainConfig, mesh: str, target: Target
                    ) -> list[str]:
    """The ways of computing attention across sequence shards worth compiling on ``mesh``:
    every method the kernel allows when the mesh splits sequences, else the configured one
    (it does nothing there)."""
    if _context_ways(mesh, target) == 1:
        return [cfg.context_attention]
    return [m for m in CONTEXT_ATTENTION if method_refusal(model_cfg.attention, m) is None]


def compare_context_methods(model_cfg: ModelConfig, cfg: TrainConfig, target: Target,
                            planned: dict[str, Any]) -> dict[str, Any]:
    """On a mesh that splits sequences, the plan of each way of computing attention across the
    shards (``planned`` is the configured one's): its memory, step time and collectives, and
    ``cheaper``: the faster of those that fit (the smaller if none fits)."""
    rows: dict[str, Any] = {}
    for method in context_methods(model_cfg, cfg, planned["mesh"], target):
        plan = planned if method == cfg.context_attention else compile_train(
            model_cfg, dataclasses.replace(cfg, context_attention=method), target)
        fits, line = plan["memory"]["fits"], plan["roofline"]
        rows[method] = {"fits": fits,
                        "total_bytes": plan["memory"].get("total_bytes"),
                        "step_s": line and line["step_s"],
                        "ici_bytes_per_device": plan.get("ici_bytes_per_device"),
                        "collectives": {kind: c["count"]
                                        for kind, c in plan.get("collectives", {}).items()}}
    fitting = [m for m, r in rows.items() if r["fits"] and r["step_s"] is not None]
    if fitting:
        cheaper = min(fitting, key=lambda m: rows[m]["step_s"])
    else:
        cheaper = min(rows, key=lambda m: rows[m]["total_bytes"] or math.inf)
    return {"methods": rows, "cheaper": cheaper}


def search(model_cfg: ModelConfig, cfg: TrainConfig, target: Target,
           remats: tuple[str, ...], log: Callable[[str], None], meshes: str = "all"
           ) -> dict[str, Any]:
    """Compile every mesh (and, until one fits, each remat policy in turn) and keep the
    fastest plan that fits. A mesh that cannot split the model or the batch is skipped with
    its reason."""
    tried: list[dict[str, Any]] = []
    best = None
    n = len(target.devices)
    meshes_tried = candidate_meshes(n, meshes, per_host=n // max(target.hosts, 1),
                                    seq_len=cfg.seq_len, min_shard=MIN_CONTEXT_SHARD)
    for mesh in meshes_tried:
        for method in context_methods(model_cfg, cfg, mesh, target):
            for remat in remats:
                trial_model = dataclasses.replace(model_cfg, remat=remat)
                trial_cfg = dataclasses.replace(cfg, mesh=mesh, context_attention=method)
                row: dict[str, Any] = {"mesh": mesh, "remat": remat}
                if _context_ways(mesh, target) > 1:
                    row["context_attention"] = method
                try:
                    plan = compile_train(trial_model, trial_cfg, target)
                except ConfigError as err:  # indivisible heads/width/batch: not a candidate
                    tried.append({**row, "skipped": str(err)})
                    break
                row["fits"] = plan["memory"]["fits"]
                if plan["roofline"] is None:  # the compiler refused it: out of memory
                    row["compiler"] = plan["memory"]["compiler"]
                else:
                    row.update(total_bytes=plan["memory"]["total_bytes"],
                               step_s=plan["roofline"]["step_s"], mfu=plan["roofline"]["mfu"],
                               mfu_causal_half=plan["roofline"]["mfu_causal_half"])
                tried.append(row)
                log(json.dumps(row))
                if plan["memory"]["fits"]:
                    if best is None or plan["roofline"]["step_s"] < best["roofline"]["step_s"]:
                        best = plan
                    break  # a cheaper remat policy that fits beats the ones after it
    return {"best": best, "tried": tried}
