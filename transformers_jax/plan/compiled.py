"""Reading a compiled program: its per-device memory, XLA's cost analysis, the collectives in
its HLO with the bytes they move, and a datasheet roofline of its step time."""

from __future__ import annotations

import math
import re
from typing import Any

from transformers_jax.plan.targets import Target

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
