"""``tjax plan``: compile the real training and decoding steps of a config for an accelerator
this host does not have, and say what fits and how fast it should run.

    tjax plan --target v5e:2x4 --mesh data=2,fsdp=4 --model.n_layers=12 ...   # one plan
    tjax plan --target v5p:4x4x4 --search ...            # the fastest mesh and remat that fit
    tjax plan --target v5e:2x2 --slices 2 ...            # two slices (multi-slice)

With ``libtpu`` installed (``pip install -e ".[tpu]"``), ``jax.experimental.topologies`` gives
the devices of a TPU topology; the step is lowered for a mesh of them exactly as ``tjax
train`` would run it (``parallel.make_trainer``), compiled by the TPU compiler, and the
compiled program is read: XLA's memory analysis (per device), its cost analysis (FLOPs and
bytes per device per step) and the collectives it contains. A roofline from the chip's
datasheet (``CHIPS``) turns these into a step-time and MFU estimate. These are compiler figures
and estimates, not measurements.

Limits of the estimate: XLA's cost analysis counts a loop body once (``--model.scan_layers``
hides all but one layer's FLOPs, so the compute term uses the larger of XLA's count and the
model's own count, ``train.flops``) and counts nothing inside a Pallas kernel; collective
bytes are per device for ring algorithms, moved at the datasheet's ICI bandwidth without
overlap with compute (pessimistic) -- ``step_s_overlapped`` assumes perfect overlap.

GPUs (``--target h100:8``, ``h200:2x8``: GPUs per host, hosts): with the CUDA plugin installed
(``pip install -e ".[gpu-plan]"``: ``jax-cuda12-plugin`` without the CUDA libraries, ~180 MB),
JAX's compile-only GPU topology takes a target description (``GpuTargetConfigProto``), written
here from the datasheet (``GPU_SPECS``), and XLA compiles for it with no GPU present. XLA
gives memory figures for such a compile but no cost analysis, so the compute term is the
model's own FLOPs and the HBM term is absent; the interconnect is NVLink.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformers_jax.config import ConfigError, ModelConfig, TrainConfig
from transformers_jax.models import build_model, family_of
from transformers_jax.nn.layers import count_params
from transformers_jax.nn.stack import REMAT_POLICIES
from transformers_jax.parallel.mesh import MESH_AXES, format_mesh, make_mesh, parse_mesh
from transformers_jax.parallel.strategies import make_trainer, mesh_rules
from transformers_jax.sample import decode_step
from transformers_jax.train.flops import flops_per_token
from transformers_jax.train.objectives import objective_for
from transformers_jax.train.optim import learning_rate_schedule, make_optimizer

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """Datasheet figures of one chip (bf16 peak, HBM, bidirectional ICI per chip)."""

    name: str
    peak_flops: float
    hbm_bytes: float
    hbm_bytes_per_s: float
    ici_bytes_per_s: float
    source: str


# Google Cloud TPU documentation, system architecture pages (retrieved 2026-11).
CHIPS: dict[str, Chip] = {
    "v4": Chip("TPU v4", 275e12, 32 * GIB, 1200e9, 300e9,
               "https://cloud.google.com/tpu/docs/v4 (275 TFLOP/s bf16, 32 GiB HBM2 at "
               "1200 GB/s); ICI: 6 links x 50 GB/s from the TPU v4 paper (Jouppi et al., "
               "ISCA 2023), not on that page: unverified"),
    "v5e": Chip("TPU v5e", 197e12, 16 * GIB, 819e9, 400e9,
                "https://cloud.google.com/tpu/docs/v5e (197 TFLOP/s bf16, 16 GiB HBM at "
                "819 GB/s, 400 GB/s bidirectional ICI per chip)"),
    "v5p": Chip("TPU v5p", 459e12, 95 * GIB, 2765e9, 1200e9,
                "https://cloud.google.com/tpu/docs/v5p (459 TFLOP/s bf16, 95 GiB HBM at "
                "2765 GB/s, 1200 GB/s bidirectional ICI per chip)"),
    "v6e": Chip("TPU v6e", 918e12, 32 * GIB, 1638e9, 800e9,
                "https://cloud.google.com/tpu/docs/v6e (918 TFLOP/s bf16, 32 GB HBM at "
                "1638 GB/s, 800 GB/s bidirectional ICI per chip)"),
}

# NVIDIA datasheets; bf16 dense is half the with-sparsity figure printed there.
CHIPS["h100"] = Chip("NVIDIA H100 SXM", 989e12, 80e9, 3.35e12, 900e9,
                     "https://www.nvidia.com/en-us/data-center/h100/ (bf16 1979 TFLOP/s with "
                     "sparsity, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s)")
CHIPS["h200"] = Chip("NVIDIA H200 SXM", 989e12, 141e9, 4.8e12, 900e9,
                     "https://www.nvidia.com/en-us/data-center/h200/ (bf16 1979 TFLOP/s with "
                     "sparsity, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s)")
# What XLA's GPU compiler reads of a device (Hopper, compute capability 9.0: 132 SMs); the
# memory size and bandwidth come from CHIPS.
GPU_SPECS = {"h100": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200"}
_HOPPER = {"threads_per_block_limit": 1024, "threads_per_warp": 32,
           "shared_memory_per_block": 49152, "shared_memory_per_core": 233472,
           "shared_memory_per_block_optin": 232448, "threads_per_core_limit": 2048,
           "core_count": 132, "fpus_per_core": 128, "block_dim_limit_x": 2**31 - 1,
           "block_dim_limit_y": 65535, "block_dim_limit_z": 65535, "l2_cache_size": 50 * 2**20,
           "clock_rate_ghz": 1.98, "registers_per_core_limit": 65536,
           "registers_per_block_limit": 65536}

DEFAULT_REMATS = ("none", "dots_with_no_batch_dims_saveable", "full")


# The target: devices of a TPU topology -----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # e.g. v5e:2x4
    chip: Chip
    devices: tuple  # jax devices of the topology (all slices)
    chips: int
    slices: int
    hosts: int

    @property
    def devices_per_chip(self) -> int:  # v4 shows each of a chip's two TensorCores
        return max(1, len(self.devices) // self.chips)


def gpu_target_config(generation: str) -> str:
    """A ``GpuTargetConfigProto`` (text format) for a GPU of ``CHIPS``/``GPU_SPECS``."""
    chip = CHIPS[generation]
    fields = {**_HOPPER, "memory_bandwidth": int(chip.hbm_bytes_per_s),
              "device_memory_size": int(chip.hbm_bytes)}
    body = "\n".join(f"  {k}: {v}" for k, v in fields.items())
    return (f"gpu_device_info {{\n{body}\n  cuda_compute_capability {{ major: 9 }}\n}}\n"
            f'platform_name: "CUDA"\ndnn_version_info {{ major: 9 }}\n'
            f'device_description_str: "{GPU_SPECS[generation]}"\n')


def gpu_target(name: str) -> Target:
    """``h100:8`` (8 GPUs on one host) or ``h200:2x8`` (2 hosts of 8): compile-only devices
    from the CUDA plugin (the ``gpu-plan`` extra); the error says what is missing."""
    generation, _, shape = name.partition(":")
    if not re.fullmatch(r"\d+(x\d+)?", shape):
        raise ConfigError(f"--target {name!r}: expected {generation}:GPUS or "
                          f"{generation}:HOSTSxGPUS, e.g. {generation}:8")
    hosts, _, per_host = shape.rpartition("x")
    hosts, per_host = int(hosts or 1), int(per_host)
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no CUDA libraries needed
    try:
        from jax.experimental import topologies

        topology = topologies.get_topology_desc(
            topology_name=name, platform="cuda", target_config=gpu_target_config(generation),
            topology=f"1x{hosts}x{per_host}")
    except Exception as err:
        raise ConfigError(
            f"--target {name!r}: cannot describe these GPUs ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200]}); install the CUDA plugin with pip install -e "
            "'.[gpu-plan]'") from None
    devices = tuple(topology.devices)
    return Target(name, CHIPS[generation], devices, len(devices), 1, hosts)


def make_target(name: str, slices: int = 1) -> Target:
    """A TPU topology (``v5e:2x4``) or a set of GPUs (``h100:8``)."""
    if name.partition(":")[0] in GPU_SPECS:
        if slices != 1:
            raise ConfigError("--slices is for TPU targets; give GPUs as HOSTSxGPUS")
        return gpu_target(name)
    return tpu_target(name, slices)


def tpu_target(name: str, slices: int = 1) -> Target:
    """The devices of TPU topology ``name`` (``v5e:2x4``, ``v5p:4x4x4``), ``slices`` times.
    Needs ``libtpu`` (the ``tpu`` extra); the error says so."""
    generation, _, shape = name.partition(":")
    tpu = generation in CHIPS and generation not in GPU_SPECS
    if not tpu or not re.fullmatch(r"\d+(x\d+){1,2}", shape):
        raise ConfigError(f"--target {name!r}: expected GENERATION:SHAPE with GENERATION one of "
                          f"{', '.join(c for c in CHIPS if c not in GPU_SPECS)} and SHAPE like "
                          "2x4 or 2x2x1 (chips per axis), or h100:8 / h200:2x8 (GPUs)")
    if slices < 1:
        raise ConfigError(f"--slices {slices}: must be a positive integer")
    # libtpu takes a host-wide lock file unless told that several processes may load it;
    # compiling for a topology touches no TPU, so concurrent plans (and tests) are safe
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        from jax.experimental import topologies

        topology = topologies.get_topology_desc(topology_name=name, platform="tpu",
                                                num_slices=slices)
    except Exception as err:  # no libtpu, or a shape it does not know
        raise ConfigError(
            f"--target {name!r}: cannot describe this TPU topology ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200]}); install libtpu with pip install -e "
            "'.[tpu]' and use a shape Cloud TPU offers (e.g. v5e:2x2, v5e:2x4, v5p:2x2x1)"
        ) from None
    devices = tuple(topology.devices)
    chips = math.prod(int(d) for d in shape.split("x")) * slices
    hosts = len({(getattr(d, "slice_index", 0), d.process_index) for d in devices})
    return Target(name, CHIPS[generation], devices, chips, slices, hosts)


# Reading the compiled program --------------------------------------------------------------
# "%name = SHAPE op(" where SHAPE is an array or a tuple of them (layouts hold parentheses)
_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(?P<shape>.*?)\s"
    r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<start>-start)?\(")
_ARRAY = re.compile(r"\b(pred|s8|u8|s16|u16|f16|bf16|s32|u32|f32|s64|u64|f64|c64|c128)"
                    r"\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


def _array_bytes(text: str) -> list[int]:
    return [_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
            for dtype, dims in _ARRAY.findall(text)]


def _group_size(line: str, n_devices: int) -> int:
    """Devices per replica group of a collective (its ring length)."""
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=", line)
    if iota:
        return int(iota.group(1).split(",")[-1])
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if listed:
        return max(1, len([x for x in listed.group(1).split(",") if x]))
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if mesh:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh.group(1)))
        return math.prod(int(sizes.get(a, 1)) for a in re.findall(r"'([^']+)'", mesh.group(2)))
    pairs = re.search(r"source_target_pairs=\{", line)
    return 2 if pairs else n_devices


def collectives(hlo_text: str, n_devices: int) -> dict[str, dict[str, float]]:
    """Per kind of collective in a compiled HLO module: how many, the bytes of their results,
    and the bytes each device sends over ICI by ring algorithms (n = devices per group):
    all-gather and all-to-all ``(n-1)/n x result``, reduce-scatter ``(n-1) x result``,
    all-reduce ``2 (n-1)/n x result``, collective-permute ``result``. A loop body's collectives
    count once (like XLA's cost analysis)."""
    out: dict[str, dict[str, float]] = {}
    for line in hlo_text.splitlines():
        match = _COLLECTIVE.search(line)
        if not match:
            continue
        op, sizes = match["op"], _array_bytes(match["shape"])
        if not sizes:
            continue
        if match["start"] and op in ("all-gather", "collective-permute"):
            size = max(sizes) if op == "all-gather" else sizes[0]  # (operand, result, ...)
        else:
            size = sum(sizes)
        n = max(1, _group_size(line, n_devices))
        factor = {"all-gather": (n - 1) / n, "all-to-all": (n - 1) / n,
                  "reduce-scatter": n - 1, "all-reduce": 2 * (n - 1) / n,
                  "collective-permute": 1.0}[op]
        entry = out.setdefault(op, {"count": 0, "result_bytes": 0.0, "ici_bytes": 0.0})
        entry["count"] += 1
        entry["result_bytes"] += size
        entry["ici_bytes"] += factor * size
    return out


def memory(compiled: Any, hbm_bytes: float) -> dict[str, Any]:
    """Per-device bytes of a compiled program and whether they fit in HBM."""
    stats = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
              "temp_size_in_bytes", "generated_code_size_in_bytes")
    out = {f.replace("_size_in_bytes", "_bytes"): int(getattr(stats, f, 0) or 0)
           for f in fields}
    # outputs that reuse donated arguments (the new state) take no extra room
    out["total_bytes"] = (out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"]
                          + out["temp_bytes"] + out["generated_code_bytes"])
    out["hbm_bytes"] = int(hbm_bytes)
    out["fits"] = out["total_bytes"] <= hbm_bytes
    return out


def cost(compiled: Any) -> dict[str, float]:
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else {}
    analysis = analysis or {}  # none for a compile-only GPU
    return {"flops": float(analysis.get("flops", 0.0)),
            "bytes_accessed": float(analysis.get("bytes accessed", 0.0))}


def roofline(per_device_flops: float, model_flops: float, bytes_accessed: float,
             ici_bytes: float, target: Target) -> dict[str, float]:
    """Step time from the datasheet: compute and HBM traffic overlap (the larger counts),
    collectives add on top (``step_s``) or hide entirely (``step_s_overlapped``). MFU is the
    model's own FLOPs (no remat recompute) per device over the step time at peak."""
    share = target.devices_per_chip
    peak, hbm_bw = target.chip.peak_flops / share, target.chip.hbm_bytes_per_s / share
    compute_s = max(per_device_flops, model_flops) / peak
    memory_s = bytes_accessed / hbm_bw
    ici_s = ici_bytes / (target.chip.ici_bytes_per_s / share)
    step_s = max(compute_s, memory_s) + ici_s
    overlapped = max(compute_s, memory_s, ici_s)
    return {"compute_s": compute_s, "hbm_s": memory_s, "ici_s": ici_s, "step_s": step_s,
            "step_s_overlapped": overlapped, "mfu": model_flops / (step_s * peak),
            "mfu_overlapped": model_flops / (overlapped * peak),
            "bound": max((compute_s, "compute"), (memory_s, "hbm"), (ici_s, "ici"))[1]}


# The steps ---------------------------------------------------------------------------------
def example_batch(model_cfg: ModelConfig, batch_size: int, seq_len: int) -> dict:
    """Shapes of a training batch for the family's objective (nothing allocated)."""
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens,
             "weights": jax.ShapeDtypeStruct((batch_size, seq_len), jnp.float32)}
    if "encoder_inputs" in objective_for(model_cfg.family).input_keys:
        batch["encoder_inputs"] = tokens
    return batch


def _zeros(batch: dict) -> dict:
    """Host arrays of a batch's shapes, for ``make_trainer``'s batch checks (small)."""
    return {k: np.zeros(v.shape, v.dtype) for k, v in batch.items()}


def compile_train(model_cfg: ModelConfig, cfg: TrainConfig, target: Target) -> dict[str, Any]:
    """Compile ``cfg.strategy``'s training step for ``target``; its memory, cost, collectives
    and roofline."""
    model = build_model(model_cfg)
    mesh = make_mesh(cfg.mesh, devices=target.devices)
    batch = example_batch(model_cfg, cfg.batch_size, cfg.seq_len)
    trainer = make_trainer(cfg.strategy, model, make_optimizer(cfg), _zeros(batch), mesh=mesh,
                           schedule=learning_rate_schedule(cfg), grad_accum=cfg.grad_accum,
                           objective=objective_for(model_cfg.family))
    wall = time.perf_counter()
    state = trainer.abstract_state()
    compiled = trainer.lower(state, trainer.abstract_batch(batch)).compile()
    compile_s = time.perf_counter() - wall
    n = trainer.mesh.size
    comms = collectives(compiled.as_text(), n)
    costs = cost(compiled)
    model_flops = flops_per_token(model_cfg, cfg.seq_len) * cfg.batch_size * cfg.seq_len / n
    ici = sum(c["ici_bytes"] for c in comms.values())
    line = roofline(costs["flops"], model_flops, costs["bytes_accessed"], ici, target)
    return {
        "strategy": cfg.strategy,
        "mesh": format_mesh(dict(zip(MESH_AXES, trainer.mesh.devices.shape, strict=True))),
        "devices": n,
        "remat": model_cfg.remat,
        "params": count_params(state.params),
        "compile_s": compile_s,
        "memory": memory(compiled, target.chip.hbm_bytes / target.devices_per_chip),
        "flops_per_device": costs["flops"],
        "model_flops_per_device": model_flops,
        "bytes_accessed_per_device": costs["bytes_accessed"],
        "collectives": comms,
        "ici_bytes_per_device": ici,
        "roofline": line,
        "tokens_per_s": cfg.batch_size * cfg.seq_len / line["step_s"],
    }


def compile_decode(model_cfg: ModelConfig, cfg: TrainConfig, target: Target,
                   batch_size: int, cache_len: int, mesh_spec: str) -> dict[str, Any]:
    """Compile one KV-cache decoding step (``sample.decode_step``, batch ``batch_size`` over a
    cache of ``cache_len`` slots) on the training mesh ``mesh_spec`` (the first devices of the
    target when it uses fewer: strategy single), parameters placed as the jit strategy does."""
    model = build_model(model_cfg)
    n = math.prod(int(part.split("=")[1]) for part in mesh_spec.split(","))  # format_mesh's
    mesh = make_mesh(mesh_spec, devices=target.devices[:n])
    trainer = make_trainer("jit", model, make_optimizer(cfg),
                           _zeros(example_batch(model_cfg, mesh.size, 128)), mesh=mesh,
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
    comms = collectives(compiled.as_text(), mesh.size)
    costs = cost(compiled)
    ici = sum(c["ici_bytes"] for c in comms.values())
    model_flops = flops_per_token(model_cfg, cache_len, training=False) * batch_size / mesh.size
    line = roofline(costs["flops"], model_flops, costs["bytes_accessed"], ici, target)
    return {"batch": batch_size, "cache_len": cache_len, "compile_s": compile_s,
            "memory": memory(compiled, target.chip.hbm_bytes / target.devices_per_chip),
            "flops_per_device": costs["flops"],
            "bytes_accessed_per_device": costs["bytes_accessed"], "collectives": comms,
            "ici_bytes_per_device": ici, "roofline": line,
            "tokens_per_s": batch_size / line["step_s"]}


# Search ------------------------------------------------------------------------------------
def candidate_meshes(n_devices: int) -> list[str]:
    """Every ``data x fsdp x tensor`` split of ``n_devices``: pure data parallel first, then
    more FSDP, then more tensor parallelism."""
    divisors = [d for d in range(1, n_devices + 1) if n_devices % d == 0]
    shapes = [(n_devices // (f * t), f, t) for t, f in itertools.product(divisors, divisors)
              if n_devices % (f * t) == 0]
    return [format_mesh(dict(zip(MESH_AXES, s, strict=True))) for s in shapes]


def search(model_cfg: ModelConfig, cfg: TrainConfig, target: Target,
           remats: tuple[str, ...], log: Callable[[str], None]) -> dict[str, Any]:
    """Compile every mesh (and, until one fits, each remat policy in turn) and keep the
    fastest plan that fits. A mesh that cannot split the model or the batch is skipped with
    its reason."""
    tried: list[dict[str, Any]] = []
    best = None
    for mesh in candidate_meshes(len(target.devices)):
        for remat in remats:
            trial_model = dataclasses.replace(model_cfg, remat=remat)
            trial_cfg = dataclasses.replace(cfg, mesh=mesh)
            try:
                plan = compile_train(trial_model, trial_cfg, target)
            except ConfigError as err:  # indivisible heads/width/batch: not a candidate
                tried.append({"mesh": mesh, "remat": remat, "skipped": str(err)})
                break
            row = {"mesh": mesh, "remat": remat, "fits": plan["memory"]["fits"],
                   "total_bytes": plan["memory"]["total_bytes"],
                   "step_s": plan["roofline"]["step_s"], "mfu": plan["roofline"]["mfu"]}
            tried.append(row)
            log(json.dumps(row))
            if plan["memory"]["fits"]:
                if best is None or plan["roofline"]["step_s"] < best["roofline"]["step_s"]:
                    best = plan
                break  # a cheaper remat policy that fits beats the ones after it
    return {"best": best, "tried": tried}


# The command -------------------------------------------------------------------------------
PLAN_OPTIONS = {"--target": str, "--slices": int, "--remats": str, "--decode-batch": int,
                "--out": str}
PLAN_FLAGS = ("--search", "--no-decode")
# short forms of config fields, as in the issue: --mesh, --batch, --seq-len, --remat
PLAN_ALIASES = {"--mesh": "--train.mesh", "--batch": "--train.batch_size",
                "--seq-len": "--train.seq_len", "--remat": "--model.remat",
                "--strategy": "--train.strategy"}

PLAN_HELP = """usage: tjax plan --target v5e:2x4 [--slices N] [--mesh data=..,fsdp=..,tensor=..]
                 [--batch B] [--seq-len T] [--remat POLICY] [--strategy jit|shard_map|single]
                 [--search [--remats none,full]] [--no-decode] [--decode-batch B] [--out FILE]
                 [--model.FIELD=VALUE ...] [--train.FIELD=VALUE ...]

Compiles the real training step (and a KV-cache decoding step) of a config for a TPU topology
without the hardware (needs libtpu: pip install -e '.[tpu]') and prints one JSON object:
per-device memory and whether it fits in HBM, FLOPs and bytes per step, the collectives and
the bytes they move, and a datasheet roofline of step time and MFU (estimates, not runs).
Every --model./--train. option of `tjax train --help` applies; the strategy defaults to jit.

  --target GEN:SHAPE  v4, v5e, v5p or v6e and chips per axis, e.g. v5e:2x4, v5p:4x4x4; or
                      h100/h200 and GPUs (per host), e.g. h100:8, h200:2x8 (gpu-plan extra)
  --slices N          that many slices (multi-slice; default 1)
  --search            try every mesh (and remat policy until one fits); report the fastest fit
  --remats A,B        remat policies --search tries, cheapest first (default
                      none,dots_with_no_batch_dims_saveable,full)
  --no-decode         skip the decoding step
  --decode-batch B    decoding batch (default: the training batch)
  --out FILE          also write the JSON there"""


def split_options(argv: list[str]) -> tuple[dict, list[str]]:
    """This command's own options, and the rest as config overrides (short aliases mapped)."""
    options: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        key, eq, value = argv[i].partition("=")
        if key in PLAN_FLAGS:
            options[key] = True
        elif key in PLAN_OPTIONS or key in PLAN_ALIASES:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"option {key} needs a value")
                i += 1
                value = argv[i]
            if key in PLAN_ALIASES:
                rest.append(f"{PLAN_ALIASES[key]}={value}")
            else:
                try:
                    options[key] = PLAN_OPTIONS[key](value)
                except ValueError:
                    raise ConfigError(f"option {key} {value!r}: expected an integer") from None
        else:
            rest.append(argv[i])
        i += 1
    return options, rest


def plan(model_cfg: ModelConfig, cfg: TrainConfig, target: Target, *, do_search: bool = False,
         remats: tuple[str, ...] = DEFAULT_REMATS, decode: bool = True,
         decode_batch: int | None = None, log: Callable[[str], None] = lambda _: None
         ) -> dict[str, Any]:
    """The JSON object of ``tjax plan`` (see the module docstring)."""
    if cfg.strategy == "pmap":
        raise ConfigError("train.strategy='pmap' runs on this host's devices only; plan "
                          "strategy jit, shard_map or single")
    unknown = [r for r in remats if r not in REMAT_POLICIES]
    if unknown:
        raise ConfigError(f"--remats: unknown policies {unknown}; valid: "
                          f"{', '.join(REMAT_POLICIES)}")
    if cfg.mesh is not None:
        parse_mesh(cfg.mesh, len(target.devices))  # a clear error before any compile
    result: dict[str, Any] = {
        "target": {"name": target.name, "chip": target.chip.name, "chips": target.chips,
                   "devices": len(target.devices), "devices_per_chip": target.devices_per_chip,
                   "slices": target.slices, "hosts": target.hosts,
                   "peak_flops_per_chip": target.chip.peak_flops,
                   "hbm_bytes_per_chip": target.chip.hbm_bytes,
                   "hbm_bytes_per_s_per_chip": target.chip.hbm_bytes_per_s,
                   "ici_bytes_per_s_per_chip": target.chip.ici_bytes_per_s,
                   "datasheet": target.chip.source},
        "model": model_cfg.to_dict(),
        "batch_size": cfg.batch_size,
        "seq_len": cfg.seq_len,
        "grad_accum": cfg.grad_accum,
        "jax": jax.__version__,
        "note": "compiler figures (XLA memory and cost analysis of the program compiled for "
                "the target) and a datasheet roofline: estimates, not measured runs",
    }
    if do_search:
        found = search(model_cfg, cfg, target, remats, log)
        result["search"] = found["tried"]
        result["train"] = found["best"]
        if found["best"] is None:
            result["train_note"] = "no mesh and remat policy tried fits in HBM"
    else:
        result["train"] = compile_train(model_cfg, cfg, target)
    decodes = family_of(model_cfg).generates == "self" and model_cfg.mask.decodes
    if decode and decodes and result["train"] is not None:
        result["decode"] = compile_decode(
            dataclasses.replace(model_cfg, remat="none"), cfg, target,
            decode_batch or cfg.batch_size, cfg.seq_len, result["train"]["mesh"])
    else:
        result["decode"] = None
    return result


def main(argv: list[str], build_configs: Callable[[list[str]], tuple[ModelConfig, TrainConfig]]
         ) -> int:
    """``tjax plan``; ``build_configs`` is ``tjax train``'s parser of ``--model.*`` and
    ``--train.*`` (and ``--config``, and ``--preset`` where it parses that), passed in by
    ``cli.py`` so that both read a config the same way."""
    if any(arg in ("-h", "--help") for arg in argv):
        print(PLAN_HELP)
        return 0
    options, rest = split_options(argv)
    if "--target" not in options:
        raise ConfigError("tjax plan needs --target, e.g. --target v5e:2x4 (tjax plan --help)")
    if not any(a.startswith("--train.strategy") for a in rest):
        rest = ["--train.strategy=jit", *rest]  # plans are for meshes: jit unless told
    model_cfg, cfg = build_configs(rest)
    target = make_target(options["--target"], options.get("--slices", 1))
    remats = tuple(r for r in options.get("--remats", ",".join(DEFAULT_REMATS)).split(",") if r)
    result = plan(model_cfg, cfg, target, do_search=options.get("--search", False),
                  remats=remats, decode=not options.get("--no-decode", False),
                  decode_batch=options.get("--decode-batch"),
                  log=lambda text: print(text, file=sys.stderr))
    text = json.dumps(result)
    if options.get("--out"):
        with open(options["--out"], "w") as f:
            f.write(text + "\n")
    print(text)
    return 0
