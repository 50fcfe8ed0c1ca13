"""A compiled HLO module's text as computations, and how often each one runs per step.

XLA's cost analysis, and a plain scan of the text, count a ``while`` body once; a scanned layer
stack (``model.scan_layers``), gradient accumulation or a chunked attention loop runs its body
many times. ``multiplicities`` follows the call graph from the entry computation: a ``while``
body runs its trip count times per call (``known_trip_count`` in its backend config, else the
constant its condition compares the counter with), any other callee (fusion, ``call``,
conditional branch, async computation, reducer) as often as its caller. ``matmul_flops`` counts
``dot`` and ``convolution`` FLOPs (TPU programs express most dots as convolutions) with those
multiplicities.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable

import numpy as np

_HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.*?)\s(?P<op>[a-z][\w\-]*)\((?P<rest>.*)$")
_CALLEE = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation|"
                     r"called_computations|branch_computations)="
                     r"(?:\{(?P<many>[^}]*)\}|%?(?P<one>[\w.\-]+))")
_ARRAY = re.compile(r"\b(pred|s4|u4|s8|u8|s16|u16|f16|bf16|s32|u32|f32|s64|u64|f64|c64|c128|"
                    r"f8e4m3fn|f8e5m2)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
          "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
          "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
ENTRY = "ENTRY"  # the name given to lines outside any computation (a bare list of instructions)


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str  # the result's shape text (an array or a tuple of them)
    op: str
    rest: str  # operands and attributes, as written
    computation: str

    def callees(self) -> list[str]:
        names: list[str] = []
        for match in _CALLEE.finditer(self.rest):
            text = match["many"] if match["many"] is not None else match["one"]
            names += [n.strip().lstrip("%") for n in text.split(",") if n.strip()]
        return names

    def operands(self) -> list[str]:
        depth = 1
        for end, char in enumerate(self.rest):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                return re.findall(r"%([\w.\-]+)", self.rest[:end])
        return re.findall(r"%([\w.\-]+)", self.rest)


def array_dims(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(dtype, dims)`` of each array in a shape text (one, or a tuple's members)."""
    return [(dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in _ARRAY.findall(shape)]


def array_bytes(shape: str) -> list[float]:
    return [_BYTES[dtype] * math.prod(dims) for dtype, dims in array_dims(shape)]


@dataclasses.dataclass
class Module:
    computations: dict[str, list[Instruction]]
    entry: str
    # the call-graph walk and the shape table, computed once: every count reads them, and a
    # parsed module is not changed afterwards
    _memo: dict = dataclasses.field(default_factory=dict, init=False, repr=False,
                                    compare=False)

    @classmethod
    def parse(cls, text: str) -> Module:
        computations: dict[str, list[Instruction]] = {ENTRY: []}
        current, entry = ENTRY, ENTRY
        for line in text.splitlines():
            header = _HEADER.match(line)
            if header and not _INSTRUCTION.match(line):
                current = header["name"]
                computations.setdefault(current, [])
                if header["entry"]:
                    entry = current
                continue
            if line.strip() == "}":
                current = ENTRY
                continue
            match = _INSTRUCTION.match(line)
            if match:
                computations[current].append(Instruction(
                    match["name"], match["shape"], match["op"], match["rest"], current))
        return cls(computations, entry)

    def instructions(self) -> Iterable[Instruction]:
        for body in self.computations.values():
            yield from body

    def trip_count(self, loop: Instruction) -> int | None:
        """How many times a ``while`` runs its body, where XLA or the condition says so."""
        known = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', loop.rest)
        if known:
            return int(known.group(1))
        condition = re.search(r"\bcondition=%?([\w.\-]+)", loop.rest)
        body = self.computations.get(condition.group(1), []) if condition else []
        limits = [int(m.group(1)) for i in body if i.op == "constant"
                  and array_dims(i.shape) and array_dims(i.shape)[0][0] in ("s32", "s64", "u32")
                  for m in [re.match(r"\s*(-?\d+)\)", i.rest)] if m]
        compares = [i for i in body if i.op == "compare" and "direction=LT" in i.rest]
        return limits[0] if len(limits) == 1 and len(compares) == 1 else None

    def multiplicities(self) -> tuple[dict[str, float], list[str]]:
        """Runs per step of every computation reached from the entry, and the loops whose trip
        count could not be read (counted once)."""
        if "runs" not in self._memo:
            self._memo["runs"] = self._walk()
        runs, unknown = self._memo["runs"]
        return dict(runs), list(unknown)

    def _walk(self) -> tuple[dict[str, float], list[str]]:
        runs: dict[str, float] = {}
        unknown: list[str] = []

        def visit(name: str, times: float, stack: tuple[str, ...]) -> None:
            if name in stack or name not in self.computations:
                return
            runs[name] = runs.get(name, 0.0) + times
            for inst in self.computations[name]:
                callees = inst.callees()
                if not callees:
                    continue
                factor = 1.0
                if inst.op == "while":
                    trips = self.trip_count(inst)
                    if trips is None:
                        unknown.append(inst.name)
                    factor = float(trips or 1)
                for callee in callees:
                    visit(callee, times * factor, (*stack, name))

        visit(self.entry, 1.0, ())
        if self.entry != ENTRY and self.computations[ENTRY]:
            visit(ENTRY, 1.0, ())
        return runs, unknown

    def shapes(self) -> dict[str, str]:
        if "shapes" not in self._memo:
            self._memo["shapes"] = {i.name: i.shape for i in self.instructions()}
        return self._memo["shapes"]


def _window(rest: str, key: str, spatial: int, default: int) -> list[str]:
    found = re.search(rf"\b{key}=([\w\-]+)", rest)
    return found.group(1).split("x") if found else [str(default)] * spatial


def _convolution_macs(rest: str, lhs: tuple, rhs: tuple, out: tuple) -> float:
    """Multiply-adds of a convolution as XLA counts them: per spatial dimension, the (output
    position, kernel tap) pairs that land on a real input element (not padding, not a hole of
    ``lhs_dilate``). TPU programs write batched matmuls this way (batch dims as dilated
    spatial dims), so ``output size x kernel size`` would overcount them many times."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", rest)
    if not labels:
        return 0.0
    lhs_l, rhs_l, out_l = labels.groups()
    spatial = [c for c in rhs_l if c.isdigit()]
    sizes = _window(rest, "size", len(spatial), 1)
    strides = _window(rest, "stride", len(spatial), 1)
    pads = _window(rest, "pad", len(spatial), 0)
    lhs_dilate = _window(rest, "lhs_dilate", len(spatial), 1)
    rhs_dilate = _window(rest, "rhs_dilate", len(spatial), 1)
    macs = float(out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")])
    for i, dim in enumerate(spatial):
        n, outs = lhs[lhs_l.index(dim)], out[out_l.index(dim)]
        low = int(pads[i].split("_")[0]) if "_" in pads[i] else 0
        d, r = int(lhs_dilate[i]), int(rhs_dilate[i])
        pos = (np.arange(outs)[:, None] * int(strides[i])
               + np.arange(int(sizes[i]))[None, :] * r - low)
        macs *= float(((pos >= 0) & (pos <= (n - 1) * d) & (pos % d == 0)).sum())
    return macs


def dot_flops(inst: Instruction, shapes: dict[str, str]) -> float:
    """FLOPs of one ``dot`` or ``convolution`` (2 per multiply-add); 0 for any other op."""
    out = array_dims(inst.shape) if inst.op in ("dot", "convolution") else []
    operands = inst.operands()
    if not out or len(operands) < 2 or operands[0] not in shapes or operands[1] not in shapes:
        return 0.0
    lhs, rhs = array_dims(shapes[operands[0]])[0][1], array_dims(shapes[operands[1]])[0][1]
    if inst.op == "dot":
        dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.rest)
        contract = math.prod(lhs[int(d)] for d in dims.group(1).split(",") if d) if dims else 1
    else:
        contract = _convolution_macs(inst.rest, lhs, rhs, out[0][1]) / math.prod(out[0][1])
    return 2.0 * math.prod(out[0][1]) * contract


def matmul_flops(module: Module, runs: dict[str, float]) -> float:
    """FLOPs of every ``dot`` and ``convolution`` per step (2 per multiply-add), loops counted
    as often as they run."""
    shapes = module.shapes()
    return sum(dot_flops(inst, shapes) * runs[inst.computation]
               for inst in module.instructions() if runs.get(inst.computation))


_NO_TRAFFIC = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "call",
               "conditional", "after-all", "partition-id", "replica-id", "iota", "opt-barrier",
               "optimization-barrier"}
_SLICES = {"dynamic-slice", "slice", "gather"}


def _params(body: list[Instruction]) -> dict[int, str]:
    """A computation's parameter names by number."""
    out = {}
    for inst in body:
        number = re.match(r"\s*(\d+)", inst.rest) if inst.op == "parameter" else None
        if number:
            out[int(number.group(1))] = inst.name
    return out


def _sliced_bytes(module: Module, computation: str, name: str, depth: int = 0) -> float | None:
    """Bytes read of ``name`` in ``computation`` if it is only sliced (directly, through a
    bitcast, or inside a nested fusion), else None (read whole)."""
    body = module.computations.get(computation, [])
    uses = [i for i in body if name in i.operands()]
    if not uses or depth > 8:
        return None
    total = 0.0
    for use in uses:
        operands = use.operands()
        if use.op in _SLICES and operands[0] == name and operands.count(name) == 1:
            total += sum(array_bytes(use.shape))
        elif use.op == "bitcast":
            inner = _sliced_bytes(module, computation, use.name, depth + 1)
            if inner is None:
                return None
            total += inner
        elif use.op == "fusion" and use.callees():
            callee = use.callees()[0]
            params = _params(module.computations.get(callee, []))
            for k, operand in enumerate(operands):
                if operand != name:
                    continue
                inner = _sliced_bytes(module, callee, params.get(k, ""), depth + 1)
                if inner is None:
                    return None
                total += inner
        else:
            return None
    return total


def _fusion_bytes(module: Module, inst: Instruction, shapes: dict[str, str]) -> float:
    """HBM bytes of one fusion: each operand read whole, unless the fused computation only
    slices it (then the slices); each output written whole, unless it is an in-place
    ``dynamic-update-slice`` of an operand (then the update, and that operand is not read)."""
    callee = next(iter(inst.callees()), "")
    body = module.computations.get(callee, [])
    params = {name: k for k, name in _params(body).items()}
    operands = inst.operands()
    read = {k: sum(array_bytes(shapes.get(name, ""))) for k, name in enumerate(operands)}
    for name, index in params.items():
        sliced = _sliced_bytes(module, callee, name)
        if sliced is not None and index in read:
            read[index] = min(read[index], sliced)
    written = sum(array_bytes(inst.shape))
    for i in body:
        ops = i.operands()
        if i.op == "dynamic-update-slice" and ops and ops[0] in params and len(ops) > 1:
            whole, update = sum(array_bytes(i.shape)), sum(array_bytes(shapes.get(ops[1], "")))
            written -= whole - update
            read[params[ops[0]]] = 0.0
    return sum(read.values()) + max(written, 0.0)


def instruction_bytes(module: Module, inst: Instruction, shapes: dict[str, str]) -> float:
    """HBM bytes one top-level instruction (not inside a fusion) reads and writes, once."""
    if inst.op in _NO_TRAFFIC or inst.op.endswith("-done") or inst.op == "custom-call":
        return 0.0
    if inst.op == "fusion":
        return _fusion_bytes(module, inst, shapes)
    if inst.op in _SLICES:
        return 2.0 * sum(array_bytes(inst.shape))
    if inst.op == "dynamic-update-slice":
        ops = inst.operands()
        return 2.0 * sum(array_bytes(shapes.get(ops[1], ""))) if len(ops) > 1 else 0.0
    return sum(array_bytes(inst.shape)) + sum(
        sum(array_bytes(shapes.get(o, ""))) for o in inst.operands())


def fusion_bodies(module: Module) -> set[str]:
    """The computations that are some fusion's body."""
    if "fused" not in module._memo:
        module._memo["fused"] = {c for i in module.instructions() if i.op == "fusion"
                                 for c in i.callees()}
    return module._memo["fused"]


def hbm_bytes(module: Module, runs: dict[str, float]) -> float:
    """Bytes read and written by the top-level instructions of every computation that is not a
    fusion's body, each as often as it runs (a rough, loop-aware model of XLA's own count)."""
    shapes = module.shapes()
    fused = fusion_bodies(module)
    return sum(instruction_bytes(module, inst, shapes) * runs[name]
               for name, body in module.computations.items()
               if name not in fused and runs.get(name) for inst in body)
