"""Reading a compiled program: its per-device memory, XLA's cost analysis, the collectives in
its HLO with the bytes they move, and a datasheet roofline of its step time."""

from __future__ import annotations

import math
import re
from typing import Any

from transformers_jax.plan.hlo import Module, array_bytes, hbm_bytes, matmul_flops
from transformers_jax.plan.targets import Target

_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

def group_size(line: str, n_devices: int) -> int:
    """Devices per replica group of a collective (its ring length)."""
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=", line)
    if iota:
        return int(iota.group(1).split(",")[-1])
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if listed:
        return max(1, len([x for x in listed.group(1).split(",") if x]))
    # the TPU compiler writes device_ids=(...) between the mesh and its axes
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", line)
    if mesh:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh.group(1)))
        return math.prod(int(sizes.get(a, 1)) for a in re.findall(r"'([^']+)'", mesh.group(2)))
    pairs = re.search(r"source_target_pairs=\{", line)
    return 2 if pairs else n_devices


def collectives(hlo_text: str | Module, n_devices: int) -> dict[str, dict[str, float]]:
    """Per kind of collective in a compiled HLO module: how many run per step, the bytes of
    their results, and the bytes each device sends over ICI by ring algorithms (n = devices
    per group): all-gather and all-to-all ``(n-1)/n x result``, reduce-scatter ``(n-1) x
    result``, all-reduce ``2 (n-1)/n x result``, collective-permute ``result``. A collective
    in a loop body counts as often as the loop runs (``hlo.Module.multiplicities``)."""
    module = hlo_text if isinstance(hlo_text, Module) else Module.parse(hlo_text)
    runs, _ = module.multiplicities()
    out: dict[str, dict[str, float]] = {}
    for inst in module.instructions():
        op = inst.op.removesuffix("-start")
        times = runs.get(inst.computation, 0.0)
        if op not in _COLLECTIVES or not times:
            continue
        sizes = array_bytes(inst.shape)
        if not sizes:
            continue
        if inst.op.endswith("-start") and op in ("all-gather", "collective-permute"):
            size = max(sizes) if op == "all-gather" else sizes[0]  # (operand, result, ...)
        else:
            size = sum(sizes)
        n = max(1, group_size(inst.rest, n_devices))
        factor = {"all-gather": (n - 1) / n, "all-to-all": (n - 1) / n,
                  "reduce-scatter": n - 1, "all-reduce": 2 * (n - 1) / n,
                  "collective-permute": 1.0}[op]
        entry = out.setdefault(op, {"count": 0, "result_bytes": 0.0, "ici_bytes": 0.0})
        entry["count"] += int(times)
        entry["result_bytes"] += size * times
        entry["ici_bytes"] += factor * size * times
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


def cost(compiled: Any, module: Module | None = None) -> dict[str, Any]:
    """XLA's cost analysis, with its loops counted as often as they run.

    XLA counts a ``while`` body once. FLOPs: XLA's figure plus the matmul FLOPs of the loops'
    other runs (``hlo.matmul_flops``). HBM bytes: XLA's figure times the loop-aware / once ratio
    of a per-instruction byte model (``hlo.hbm_bytes``, which follows slices of stacked
    weights and activations into nested fusions). Checked against the unrolled program of the
    same model: on CPU the FLOPs agree exactly and the byte model equals XLA's loop-free count
    within 1%; GPT-2 small on TPU v5e (scanned vs unrolled, Pallas attention) FLOPs within 5%
    and bytes within 12% (below). Estimates, exact only without loops; ``xla_*`` keep XLA's
    loop-once figures."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else {}
    analysis = analysis or {}  # none for a compile-only GPU
    flops = float(analysis.get("flops", 0.0))
    moved = float(analysis.get("bytes accessed", 0.0))
    out = {"flops": flops, "bytes_accessed": moved, "xla_flops": flops,
           "xla_bytes_accessed": moved, "loops": [], "unknown_trip_counts": []}
    module = module or Module.parse(compiled.as_text())
    runs, unknown = module.multiplicities()
    loops = [{"loop": inst.name, "trips": module.trip_count(inst),
              "runs_per_step": runs.get(inst.computation, 0.0) * (module.trip_count(inst) or 1)}
             for inst in module.instructions() if inst.op == "while" and runs.get(inst.computation)]
    if loops:
        once = {name: 1.0 for name in runs}
        out["flops"] = flops + matmul_flops(module, runs) - matmul_flops(module, once)
        bytes_once = hbm_bytes(module, once)
        if bytes_once:
            out["bytes_accessed"] = moved * hbm_bytes(module, runs) / bytes_once
    out["loops"], out["unknown_trip_counts"] = loops, unknown
    return out


def roofline(per_device_flops: float, model_flops: float, bytes_accessed: float,
             ici_bytes: float, target: Target, model_flops_causal_half: float | None = None
             ) -> dict[str, float]:
    """Step time from the datasheet: compute and HBM traffic overlap (the larger counts),
    collectives add on top (``step_s``) or hide entirely (``step_s_overlapped``). MFU is the
    model's own FLOPs (no remat recompute) per device over the step time at peak, attention
    over the full context; given ``model_flops_causal_half`` (causal attention at half, as
    MaxText counts it: ``learning.flops.flops_per_token``), also ``mfu_causal_half`` and
    ``mfu_causal_half_overlapped`` over the same step times."""
    share = target.devices_per_chip
    peak, hbm_bw = target.chip.peak_flops / share, target.chip.hbm_bytes_per_s / share
    compute_s = max(per_device_flops, model_flops) / peak
    memory_s = bytes_accessed / hbm_bw
    ici_s = ici_bytes / (target.chip.ici_bytes_per_s / share)
    step_s = max(compute_s, memory_s) + ici_s
    overlapped = max(compute_s, memory_s, ici_s)
    line = {"compute_s": compute_s, "hbm_s": memory_s, "ici_s": ici_s, "step_s": step_s,
            "step_s_overlapped": overlapped, "mfu": model_flops / (step_s * peak),
            "mfu_overlapped": model_flops / (overlapped * peak),
            "bound": max((compute_s, "compute"), (memory_s, "hbm"), (ici_s, "ici"))[1]}
    if model_flops_causal_half is not None:
        line["mfu_causal_half"] = model_flops_causal_half / (step_s * peak)
        line["mfu_causal_half_overlapped"] = model_flops_causal_half / (overlapped * peak)
    return line
