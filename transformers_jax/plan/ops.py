"""A roofline per operation of a compiled program, summed along its program order.

Each top-level instruction or fusion of every computation that runs as a step of the program
(the entry, loop bodies and conditions, called and branch computations; not the inside of a
fusion) costs the largest of three times: its matmul FLOPs (``dot``/``convolution`` inside it)
at the chip's MXU peak for their dtype, its other arithmetic (one FLOP per output element, a
reduction per input element) at the vector peak, and its HBM bytes (``hlo.instruction_bytes``)
at HBM bandwidth. Loops count as often as they run (``hlo.Module.multiplicities``). A Pallas
kernel is an opaque custom call: its FLOPs come from its operand shapes where ``KERNELS``
knows the kernel (flash attention), run at ``KERNEL_EFFICIENCY`` of the peak; an unknown
kernel's bytes only count (listed as opaque).

Collectives cost their ring bytes (``compiled.collectives``' model) over the links they cross:
a ring over k torus axes gets k / ``Chip.ici_links`` of the chip's ICI bandwidth, and a group
that spans slices moves at the DCN bandwidth. Overlap model: one compute stream and one
collective stream per device. An asynchronous collective (a start and a done, as
``all-gather-start``/``-done`` or the TPU's async collective fusions, paired by channel) enters
the collective stream at its start, behind the transfers already queued; its done waits for it.
A synchronous collective waits for the stream and blocks compute. The time compute waits is
the collectives' exposed time; the step is the sum of every operation's time plus that.
Left out: async copies between memory spaces (copy-start/-done, slice-start/-done), fixed costs
per operation, and the MXU's efficiency at small or ragged shapes (docs/performance.md has the
calibration against published runs).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any

import numpy as np

from transformers_jax.plan.hlo import (
    Instruction,
    Module,
    array_bytes,
    array_dims,
    dot_flops,
    instruction_bytes,
)
from transformers_jax.plan.targets import Target

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
RING_FACTOR = {"all-gather": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
               "reduce-scatter": lambda n: n - 1, "all-reduce": lambda n: 2 * (n - 1) / n,
               "collective-permute": lambda n: 1.0}
# the steps of a program that move no data or only name it
_STRUCTURE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "call",
              "conditional", "after-all", "partition-id", "replica-id", "opt-barrier",
              "optimization-barrier", "copy-start", "copy-done", "slice-start", "slice-done",
              "add-dependency"}
# inside a fusion: ops that move data without arithmetic (no vector FLOPs)
_MOVES = {"parameter", "constant", "bitcast", "broadcast", "reshape", "transpose", "slice",
          "dynamic-slice", "dynamic-update-slice", "concatenate", "pad", "copy", "iota", "tuple",
          "get-tuple-element", "gather", "reverse", "custom-call", "dot", "convolution",
          "bitcast-convert", "scatter", "sort", *COLLECTIVES}
# Attention kernels by a fragment of their instruction name or custom-call target: how many
# (T x S x D) matmuls per head they run, and the layout of q and k. Pallas flash attention
# (TPU): forward QK and PV; dq: QK, dO V and dS K; dkv: QK, PV, dO V and dS Q; q [B, H, T, D]
# and k [B, H, S, D]. cuDNN's fused attention (GPU): forward QK and PV; backward QK, dO V,
# P dO, dS K and dS Q; q [B, T, H, D] and k [B, S, N, D]. First match wins; a causal kernel
# skips about half
KERNELS = {"bwd_dkv": (4, "BHTD"), "bwd_dq": (3, "BHTD"), "flash_attention": (2, "BHTD"),
           "SoftmaxBackward": (5, "BTHD"),
           "__cudnn$fmha": (2, "BTHD")}
_KERNEL_CALLS = ('"tpu_custom_call"', "__gpu$xla.gpu.triton", "__cudnn$fmha")
# The fraction of the MXU peak those kernels reach: fitted to two published runs (Llama 2 70B at
# 4K on v5p, Llama 3.1 8B at 8K on v6e; docs/performance.md), an estimate; their softmax runs on
# the vector unit between the matmuls of each 128-wide block
KERNEL_EFFICIENCY = 0.35
BOUNDS = ("matmul", "other_compute", "memory_bound")


@dataclasses.dataclass
class OpCost:
    """One top-level operation, once: its work and its time on the compute stream."""

    name: str
    op: str  # the opcode, or fusion(dot|convolution|...) after the fusion's heaviest op
    computation: str
    mxu_flops: float = 0.0
    vector_flops: float = 0.0
    bytes: float = 0.0
    compute_s: float = 0.0
    bound: str = "memory_bound"
    collective: str | None = None  # pairs the start and done of one collective
    collective_kind: str = ""
    collective_bytes: float = 0.0  # ring bytes per device
    collective_s: float = 0.0
    opaque: bool = False  # a custom call whose FLOPs are unknown


def _flat(module: Module, inst: Instruction) -> list[Instruction]:
    """The instruction, or every instruction of a fusion's body (nested fusions opened)."""
    if inst.op != "fusion":
        return [inst]
    out: list[Instruction] = []
    for callee in inst.callees():
        for inner in module.computations.get(callee, []):
            out += _flat(module, inner) if inner.op == "fusion" else [inner]
    return out


def _mxu_seconds(inst: Instruction, flops: float, shapes: dict[str, str], target: Target
                 ) -> float:
    """A matmul's time at the peak for its operands' dtype: 8-bit at ``int8_factor`` times the
    bf16 peak, float32 at HIGHEST precision in six bf16 passes, anything else at the peak."""
    peak = target.chip.peak_flops / target.devices_per_chip
    operand = shapes.get(next(iter(inst.operands()), ""), "")
    dtype = array_dims(operand)[0][0] if array_dims(operand) else "bf16"
    if dtype in ("s8", "u8", "f8e4m3fn", "f8e5m2", "s4", "u4"):
        peak *= target.chip.int8_factor
    elif dtype == "f32" and "operand_precision={highest" in inst.rest.lower():
        peak /= 6
    return flops / peak


def _kernel_flops(inst: Instruction, shapes: dict[str, str], causal: bool) -> float | None:
    target = re.search(r'custom_call_target="([^"]*)"', inst.rest)
    label = f"{inst.name} {target.group(1) if target else ''}"
    kernel = next((v for key, v in KERNELS.items() if key in label), None)
    operands = inst.operands()
    if kernel is None or len(operands) < 2:
        return None
    matmuls, layout = kernel
    q, k = (array_dims(shapes.get(o, "")) for o in operands[:2])
    if not q or not k or len(q[0][1]) != 4 or len(k[0][1]) != 4:
        return None
    if layout == "BHTD":
        (b, h, t, d), s = q[0][1], k[0][1][2]
    else:
        (b, t, h, d), s = q[0][1], k[0][1][1]
    return 2.0 * matmuls * b * h * t * s * d * (0.5 if causal else 1.0)


def _group_devices(rest: str) -> list[list[int]] | None:
    """Device ids of each replica group, where the text lists them or gives an iota."""
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
    if iota:
        groups = [int(x) for x in iota.group(1).split(",")]
        dims = [int(x) for x in iota.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(x) for x in iota.group(3).split(",")])
        return ids.reshape(groups[0], -1).tolist() if len(groups) == 2 else None
    listed = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", rest)
    if listed:
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}",
                                                                         listed.group(1))]
    return None


def _topology_axes(target: Target) -> list[int]:
    shape = target.name.partition(":")[2]
    return [int(d) for d in re.findall(r"\d+", shape)] or [len(target.devices)]


def collective_seconds(inst: Instruction, size: float, target: Target, kind: str = ""
                       ) -> tuple[float, float]:
    """(ring bytes per device, seconds) of one collective (``kind``, else its opcode's) whose
    result is ``size`` bytes."""
    from transformers_jax.plan.compiled import group_size  # the ring length, one reader

    n_devices = len(target.devices)
    n = max(1, group_size(inst.rest, n_devices))
    kind = kind or inst.op.removesuffix("-start").removesuffix("-done")
    ring = RING_FACTOR[kind](n) * size
    if n == 1 or ring == 0:
        return 0.0, 0.0
    per_chip = target.devices_per_chip
    per_slice = n_devices // max(target.slices, 1)
    groups = _group_devices(inst.rest)
    crosses = (target.slices > 1 and (n > per_slice if groups is None else any(
        len({d // per_slice for d in g}) > 1 for g in groups)))
    if crosses:
        return ring, ring / (target.chip.dcn_bytes_per_s / per_chip)
    # the torus axes a ring of n chips needs, largest first (a ring over several axes uses
    # the links of each)
    axes, reach = 0, 1
    for size_axis in sorted((a for a in _topology_axes(target) if a > 1), reverse=True):
        if reach >= max(1, n // per_chip):
            break
        axes, reach = axes + 1, reach * size_axis
    links = target.chip.ici_links
    bandwidth = target.chip.ici_bytes_per_s * min(max(axes, 1), links // 2) / links / per_chip
    return ring, ring / bandwidth


def op_cost(module: Module, inst: Instruction, target: Target, causal: bool = True
            ) -> OpCost | None:
    """The cost of one top-level instruction, once; None for one that does no work."""
    if inst.op in _STRUCTURE:
        return None
    shapes = module.shapes()
    cost = OpCost(inst.name, inst.op, inst.computation)
    body = _flat(module, inst)
    kind = inst.op.removesuffix("-start").removesuffix("-done")
    inner = next((i for i in body if i.op.removesuffix("-start") in COLLECTIVES), None)
    if kind in COLLECTIVES and inst.op.endswith("-done"):  # pairs with its start, its operand
        cost.collective, cost.collective_kind = inst.operands()[0], kind
        return cost
    if inner is not None:
        # a top-level start pairs with the done that names it; the TPU's async collective
        # fusions (start, continuation, done) each hold a copy with the same channel
        channel = re.search(r"channel_id=(\d+)", inner.rest)
        cost.collective = (f"channel {channel.group(1)}" if channel and inner is not inst
                           else inst.name)
        cost.collective_kind = inner.op.removesuffix("-start")
        sizes, k = array_bytes(inner.shape), len(inner.operands())
        # an async start's shape holds its k operands, then its k results (then a permute's
        # context scalars): the results are what the collective delivers (an all-gather's
        # whole arrays, a reduce-scatter's shards); an all-reduce-start shows only results
        size = sum(sizes[k:2 * k]) if inner.op.endswith("-start") and len(sizes) >= 2 * k \
            else sum(sizes)
        if cost.collective_kind == "all-reduce" and 0 < sum(array_bytes(inst.shape)) < size:
            # XLA's all-reduce-scatter fusion keeps only its shard: a reduce-scatter of the
            # whole (ring bytes (n-1)/n of it, as the shard's n-1 times)
            cost.collective_kind = "reduce-scatter"
            size = sum(array_bytes(inst.shape))
        cost.collective_bytes, cost.collective_s = collective_seconds(
            inner, size, target, cost.collective_kind)
    if inst.op == "custom-call":
        if not any(call in inst.rest for call in _KERNEL_CALLS):
            return None  # buffer allocation and other bookkeeping
        flops = _kernel_flops(inst, shapes, causal)
        cost.opaque = flops is None
        cost.mxu_flops = flops or 0.0
        cost.bytes = sum(array_bytes(inst.shape)) + sum(
            sum(array_bytes(shapes.get(o, ""))) for o in inst.operands())
        mxu_s = _mxu_seconds(inst, cost.mxu_flops, shapes, target) / KERNEL_EFFICIENCY
        vector_s = 0.0
    else:
        mxu_s = 0.0
        for i in body:
            flops = dot_flops(i, shapes)
            cost.mxu_flops += flops
            mxu_s += _mxu_seconds(i, flops, shapes, target) if flops else 0.0
            if i.op == "reduce":
                operand = shapes.get(next(iter(i.operands()), ""), "")
                cost.vector_flops += sum(math.prod(d) for _, d in array_dims(operand)[:1])
            elif i.op not in _MOVES and not i.op.endswith(("-start", "-done")):
                cost.vector_flops += sum(math.prod(d) for _, d in array_dims(i.shape))
        # the bytes of a collective's own start/done are its transfer, on the other stream
        bare = inner is not None and not cost.mxu_flops
        cost.bytes = 0.0 if bare else instruction_bytes(module, inst, shapes)
        vector_s = 0.0 if bare else cost.vector_flops / (target.chip.vector_peak
                                                          / target.devices_per_chip)
        heavy = [i.op for i in body if i.op in ("dot", "convolution")]
        if inst.op == "fusion":
            cost.op = f"fusion({heavy[0] if heavy else (inner.op if inner else 'elementwise')})"
    memory_s = cost.bytes / (target.chip.hbm_bytes_per_s / target.devices_per_chip)
    cost.compute_s, cost.bound = max(zip((mxu_s, vector_s, memory_s), BOUNDS, strict=True))
    if not cost.compute_s:
        cost.bound = "memory_bound"
    return cost


def _scheduled(module: Module) -> set[str]:
    """The computations that run as steps of the program (not fusion bodies or reducers)."""
    out: set[str] = set()

    def visit(name: str) -> None:
        if name in out or name not in module.computations:
            return
        out.add(name)
        for inst in module.computations[name]:
            if inst.op in ("while", "conditional", "call"):
                for callee in inst.callees():
                    visit(callee)

    visit(module.entry)
    return out


def _simulate(module: Module, name: str, costs: dict[str, OpCost], memo: dict[str, tuple]
              ) -> tuple[float, dict[str, float]]:
    """(seconds of one run of a computation, those seconds by what bounds them: each bound's
    compute and the waits for collectives). Loops count their trips and a conditional its
    dearest branch in both, so the entry's split sums to its step."""
    if name in memo:
        return memo[name]
    memo[name] = (0.0, _no_split())  # a recursive call graph (none in XLA's output) costs 0
    body = module.computations.get(name, [])
    occurs = collections.Counter(costs[i.name].collective for i in body
                                 if i.name in costs and costs[i.name].collective)
    seen: collections.Counter = collections.Counter()
    clock = stream = 0.0
    split = _no_split()
    pending: dict[str, float] = {}

    def add(part: dict[str, float], times: float = 1.0) -> None:
        for bound, seconds in part.items():
            split[bound] += times * seconds

    for inst in body:
        if inst.op in ("while", "call", "conditional"):
            runs = [_simulate(module, c, costs, memo) for c in inst.callees()]
            if not runs:
                continue
            if inst.op == "conditional":  # one branch runs: the dearest, in step and split
                runs = [max(runs, key=lambda run: run[0])]
            times = (module.trip_count(inst) or 1) if inst.op == "while" else 1
            for seconds, part in runs:
                clock += times * seconds
                add(part, times)
            continue
        cost = costs.get(inst.name)
        if cost is None:
            continue
        key = cost.collective
        if key is not None:
            seen[key] += 1
            if seen[key] == 1 and key not in pending:
                stream = max(clock, stream) + cost.collective_s
                pending[key] = stream
            if seen[key] == occurs[key]:  # its done (or a synchronous collective)
                wait = max(0.0, pending.pop(key, 0.0) - clock)
                clock += wait
                split["exposed_collectives"] += wait
        clock += cost.compute_s
        split[cost.bound] += cost.compute_s
    for finish in pending.values():  # started here, never waited for: the end waits
        wait = max(0.0, finish - clock)
        clock += wait
        split["exposed_collectives"] += wait
    memo[name] = (clock, split)
    return memo[name]


def _no_split() -> dict[str, float]:
    return dict.fromkeys((*BOUNDS, "exposed_collectives"), 0.0)


def op_roofline(module: Module, target: Target, model_flops: float,
                model_flops_causal_half: float | None = None, causal: bool = True,
                top: int = 10) -> dict[str, Any]:
    """The per-operation roofline of a compiled program (see the module docstring): step time,
    its split (matmul, other compute, memory-bound, exposed collectives; seconds), MFU from the
    model's own FLOPs per device, and the operations and collectives that cost the most."""
    runs, _ = module.multiplicities()
    scheduled = _scheduled(module)
    costs: dict[str, OpCost] = {}
    for name in scheduled:
        for inst in module.computations[name]:
            cost = op_cost(module, inst, target, causal)
            if cost is not None:
                costs[inst.name] = cost
    first: set[tuple[str, str]] = set()  # a collective's transfer belongs to its start
    for cost in costs.values():  # dicts keep program order
        key = (cost.computation, cost.collective or "")
        if cost.collective and key in first:
            cost.collective_bytes = cost.collective_s = 0.0
        first.add(key)
    step_s, split = _simulate(module, module.entry, costs, {})
    peak = target.chip.peak_flops / target.devices_per_chip
    ranked = sorted(costs.values(), key=lambda c: -c.compute_s * runs.get(c.computation, 0.0))
    transfers = [c for c in costs.values() if c.collective_s]
    line = {
        "step_s": step_s, "split": split,
        "mfu": model_flops / (step_s * peak) if step_s else 0.0,
        "mxu_flops": sum(c.mxu_flops * runs.get(c.computation, 0.0) for c in costs.values()),
        "hbm_bytes": sum(c.bytes * runs.get(c.computation, 0.0) for c in costs.values()),
        "collective_bytes": sum(c.collective_bytes * runs.get(c.computation, 0.0)
                                for c in transfers),
        "collective_transfer_s": sum(c.collective_s * runs.get(c.computation, 0.0)
                                     for c in transfers),
        "bound": max(split.items(), key=lambda kv: kv[1])[0],
        "top_ops": [{"name": c.name, "op": c.op, "runs": runs.get(c.computation, 0.0),
                     "est_s": c.compute_s * runs.get(c.computation, 0.0), "bound": c.bound,
                     "flops": c.mxu_flops + c.vector_flops, "bytes": c.bytes}
                    for c in ranked[:top]],
        "top_collectives": [{"name": c.name, "kind": c.collective_kind,
                             "runs": runs.get(c.computation, 0.0),
                             "transfer_s": c.collective_s * runs.get(c.computation, 0.0),
                             "ring_bytes": c.collective_bytes}
                            for c in sorted(transfers, key=lambda c: -c.collective_s
                                            * runs.get(c.computation, 0.0))[:top]],
        "opaque_custom_calls": sorted({c.name for c in costs.values() if c.opaque}),
    }
    if model_flops_causal_half is not None:
        line["mfu_causal_half"] = model_flops_causal_half / (step_s * peak) if step_s else 0.0
    return line
