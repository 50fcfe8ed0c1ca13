"""A spec's cells: the product of its axes (and the cells it lists by hand), each a name, the
axis values that select it in comparisons, and the ``tjax train`` options that train it.
Nothing here imports JAX."""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Any

from transformers_jax.sweep.spec import Axis, Spec, SpecError, toml_text


@dataclasses.dataclass(frozen=True)
class Cell:
    name: str  # "position=alibi,seq_len=64"; a hand-listed cell's own name
    values: dict[str, str]  # axis (last part of its key) -> the value's label
    args: tuple[str, ...]  # the base options, then the cell's own

    @property
    def folder(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.=,()+-]", "_", self.name)


def value_args(key: str, value: Any) -> list[str]:
    """``--key=value`` options for one axis value; a switch with settings gives its name and
    one option per setting (nested switches, such as RoPE's scaling, likewise)."""
    if isinstance(value, dict):
        out = [f"--{key}={value['name']}"]
        for k, v in value.items():
            if k not in ("name", "label"):
                out += value_args(f"{key}.{k}", v)
        return out
    if isinstance(value, list):
        return [f"--{key}={','.join(toml_text(v) for v in value)}"]
    return [f"--{key}={toml_text(value)}"]


def expand(spec: Spec) -> list[Cell]:
    """The cells in a fixed order: the product of the axes (first axis slowest), then the
    listed ones. A spec with neither has one cell, its base."""
    cells = []
    if spec.axes:
        for combo in itertools.product(*(a.values for a in spec.axes)):
            values = {a.short: a.label(v) for a, v in zip(spec.axes, combo, strict=True)}
            args = [*spec.base_args]
            for axis, value in zip(spec.axes, combo, strict=True):
                args += value_args(axis.key, value)
            name = ",".join(f"{k}={v}" for k, v in values.items())
            cells.append(Cell(name, values, tuple(args)))
    for listed in spec.cells:
        args = [*spec.base_args]
        for key, value in listed.items():
            if key != "name":
                args += value_args(key, value)
        cells.append(Cell(listed["name"], {}, tuple(args)))
    if not cells:
        cells.append(Cell("base", {}, tuple(spec.base_args)))
    names = [c.name for c in cells]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SpecError(f"two cells are named {twice[0]!r}: rename the [[cell]] (cells of the "
                        "product are named after their axis values)")
    folders = [c.folder for c in cells]
    if len(set(folders)) != len(folders):
        raise SpecError("two cells map to one folder name: rename a [[cell]] or give the "
                        "switch values labels")
    return cells


def select(cells: list[Cell], selector: dict[str, str] | str, where: str,
           axes: tuple[Axis, ...]) -> list[Cell]:
    """The cells a comparison's ``a``/``b``/``against`` names: by name, or every cell whose
    axis values include the selector's."""
    if isinstance(selector, str):
        found = [c for c in cells if c.name == selector]
        if not found:
            raise SpecError(f"{where}: no cell is named {selector!r}; cells: "
                            f"{', '.join(c.name for c in cells)}")
        return found
    shorts = {a.short: a for a in axes}
    for key, value in selector.items():
        if key not in shorts:
            raise SpecError(f"{where}: {key!r} is not an axis; axes: "
                            f"{', '.join(shorts) or 'none (select cells by name)'}")
        labels = [shorts[key].label(v) for v in shorts[key].values]
        if value not in labels:
            raise SpecError(f"{where}: {key} = {value!r} is not one of the axis's values: "
                            f"{', '.join(labels)}")
    return [c for c in cells if c.values and all(c.values.get(k) == v
                                                  for k, v in selector.items())]


@dataclasses.dataclass(frozen=True)
class Pair:
    """One comparison of the family: cell ``a`` against cell ``b`` on ``metric``."""

    index: int  # the spec's [[compare]] it came from (from 1)
    a: Cell
    b: Cell
    metric: Any  # spec.Metric
    better: str
    claim: str

    @property
    def title(self) -> str:
        return f"{self.a.name} vs {self.b.name}: {self.metric.text}"


def pairs(spec: Spec, cells: list[Cell]) -> list[Pair]:
    """Every declared comparison expanded to pairs of cells: the cells ``a`` selects, each
    with the ``b`` cell equal to it on every axis neither selector names."""
    out = []
    for c in spec.compares:
        where = f"[[compare]] {c.index}"
        if c.against is not None:
            (key, value), = c.against.items()
            base = select(cells, c.against, f"{where} against", spec.axes)
            others = [x for x in cells if x.values.get(key) not in (None, value)]
            found = [(x, _partner(x, base, {key}, where)) for x in others]
        else:
            a_cells = select(cells, c.a, f"{where} a", spec.axes)
            b_cells = select(cells, c.b, f"{where} b", spec.axes)
            named = set(c.a) | set(c.b) if isinstance(c.a, dict) and isinstance(c.b, dict) \
                else None
            found = [(x, _partner(x, b_cells, named, where)) for x in a_cells]
        if not found:
            raise SpecError(f"{where}: selects no pair of cells")
        for a, b in found:
            if a.name == b.name:
                raise SpecError(f"{where}: compares cell {a.name!r} with itself; a and b must "
                                "select different cells")
            out.append(Pair(c.index, a, b, c.metric, c.better, c.claim))
    return out


def _partner(cell: Cell, candidates: list[Cell], named: set[str] | None, where: str) -> Cell:
    if named is None:  # a cell chosen by name: its partner is the single candidate
        if len(candidates) != 1:
            raise SpecError(f"{where}: selecting by name on one side needs exactly one cell on "
                            "the other")
        return candidates[0]
    rest = {k: v for k, v in cell.values.items() if k not in named}
    match = [c for c in candidates if all(c.values.get(k) == v for k, v in rest.items())]
    if len(match) != 1:
        raise SpecError(f"{where}: cell {cell.name!r} has {len(match)} partners equal to it on "
                        f"{', '.join(rest) or 'every other axis'}; select cells so each has one")
    return match[0]
