"""A spec's cells: the product of its axes (once per stage, if it has stages), and the cells it
lists by hand, each a name, the axis values that select it in comparisons, the ``tjax train``
options that train it, and the cell it starts from (its parent), in an order where every
parent comes before its children. Nothing here imports JAX."""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Any

from transformers_jax.sweep.spec import CELL_KEYS, Axis, Control, Spec, SpecError, toml_text


@dataclasses.dataclass(frozen=True)
class Cell:
    name: str  # "position=alibi,seq_len=64"; a hand-listed cell's own name
    values: dict[str, str]  # axis (last part of its key) -> the value's label
    args: tuple[str, ...]  # the base options, then the cell's own (a child: its own only;
    # resolved, its parent's come first)
    parent: str | None = None  # the cell whose run of each seed this one starts from
    trains: bool = True  # False: zero-shot, the parent's runs scored with this cell's model
    tokens: int | None = None  # its own training budget (None: the spec's)

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


def _options(table: dict[str, Any]) -> list[str]:
    """The ``--key=value`` options of a [[cell]] or [[stage]] table (not name, from, ...)."""
    out = []
    for key, value in table.items():
        if key not in CELL_KEYS:
            out += value_args(key, value)
    return out


def _product(spec: Spec) -> list[tuple[dict[str, str], list[str]]]:
    """The product of the axes: each combination's labels and options (one empty
    combination without axes)."""
    out = []
    for combo in itertools.product(*(a.values for a in spec.axes)):
        values = {a.short: a.label(v) for a, v in zip(spec.axes, combo, strict=True)}
        args = []
        for axis, value in zip(spec.axes, combo, strict=True):
            args += value_args(axis.key, value)
        out.append((values, args))
    return out


def _named(values: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in values.items())


def expand(spec: Spec) -> list[Cell]:
    """The cells, parents before their children: the product of the axes (first axis
    slowest; once per stage when the spec has stages), then the listed ones, each chain
    ordered by its depth. A spec with neither has one cell, its base."""
    cells = []
    stage_names = {s["name"] for s in spec.stages}
    for stage in spec.stages:
        clash = sorted(set(stage) & {a.key for a in spec.axes})
        if clash:
            raise SpecError(f"[[stage]] {stage['name']}: {clash[0]} is also an axis; set it "
                            "in one place")
        for values, args in _product(spec):
            values = {"stage": stage["name"], **values}
            parent = stage["from"]
            if parent in stage_names:  # the same axis values in the parent stage
                parent = _named({**values, "stage": parent})
            base = spec.base_args if parent is None else ()  # a child's come with its parent's
            cells.append(Cell(_named(values), values, (*base, *_options(stage), *args), parent,
                              stage["train"], stage["tokens"]))
    if spec.axes and not spec.stages:
        for values, args in _product(spec):
            cells.append(Cell(_named(values), values, (*spec.base_args, *args)))
    for listed in spec.cells:
        if listed["name"] in stage_names:
            raise SpecError(f"[[cell]] {listed['name']}: a stage has that name too; from = "
                            f"{listed['name']!r} would be ambiguous: rename one")
        base = spec.base_args if listed["from"] is None else ()
        cells.append(Cell(listed["name"], {}, (*base, *_options(listed)), listed["from"],
                          listed["train"], listed["tokens"]))
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
    return sorted(cells, key=lambda c: len(lineage(cells, c)))  # stable: parents first


def lineage(cells: list[Cell], cell: Cell) -> list[Cell]:
    """The cell's ancestors, its parent first; a ``SpecError`` for a parent that is no cell
    or a chain that comes back to itself."""
    by_name = {c.name: c for c in cells}
    chain, seen = [], [cell.name]
    while cell.parent is not None:
        if cell.parent not in by_name:
            raise SpecError(
                f"cell {cell.name}: from = {cell.parent!r} names no cell; cells: "
                f"{', '.join(c.name for c in cells if c.name != cell.name)}"
                " (a [[stage]]'s from names a cell or another stage)")
        if cell.parent in seen:
            loop = seen[seen.index(cell.parent):] + [cell.parent]
            raise SpecError(f"cells {' -> '.join(loop)} start from each other in a cycle; a "
                            "chain of from must begin with a cell trained from scratch")
        cell = by_name[cell.parent]
        seen.append(cell.name)
        chain.append(cell)
    return chain


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
    b: Cell | None  # None: ``a``'s metric (a difference) against zero
    metric: Any  # spec.Metric
    better: str
    claim: str
    a_ref: Cell | None = None  # relative_to: the metric of a minus this cell's (and of b
    b_ref: Cell | None = None  # minus b_ref's), chunk by chunk
    primary: bool = True  # in Holm's family; else exploratory (reported, unadjusted)
    margin: float | None = None  # an equivalence claim: within +-margin

    @property
    def a_text(self) -> str:
        return self.a.name if self.a_ref is None else f"{self.a.name} - {self.a_ref.name}"

    @property
    def b_text(self) -> str | None:
        if self.b is None:
            return None
        return self.b.name if self.b_ref is None else f"{self.b.name} - {self.b_ref.name}"

    @property
    def title(self) -> str:
        if self.b is None:
            return f"{self.a_text}: {self.metric.text} against zero"
        return f"{self.a_text} vs {self.b_text}: {self.metric.text}"


def pairs(spec: Spec, cells: list[Cell]) -> list[Pair]:
    """Every declared comparison expanded to pairs of cells: the cells ``a`` selects, each
    with the ``b`` cell equal to it on every axis neither selector names."""
    out = []
    axes = spec.selectable_axes()
    marked = any(c.primary for c in spec.compares)  # else every claim is primary
    for c in spec.compares:
        where = f"[[compare]] {c.index}"
        if c.against is not None:
            (key, value), = c.against.items()
            base = select(cells, c.against, f"{where} against", axes)
            others = [x for x in cells if x.values.get(key) not in (None, value)]
            found = [(x, _partner(x, base, {key}, where)) for x in others]
        elif c.b is None:  # a alone: each of its cells against zero
            found = [(x, None) for x in select(cells, c.a, f"{where} a", axes)]
        else:
            a_cells = select(cells, c.a, f"{where} a", axes)
            b_cells = select(cells, c.b, f"{where} b", axes)
            named = set(c.a) | set(c.b) if isinstance(c.a, dict) and isinstance(c.b, dict) \
                else None
            found = [(x, _partner(x, b_cells, named, where)) for x in a_cells]
        if not found:
            raise SpecError(f"{where}: selects no pair of cells")
        for a, b in found:
            if b is not None and a.name == b.name:
                raise SpecError(f"{where}: compares cell {a.name!r} with itself; a and b must "
                                "select different cells")
            refs = [None, None]
            if c.relative_to is not None:
                (key, value), = c.relative_to.items()
                if a.values.get(key) == value and (b is None or b.values.get(key) == value):
                    continue  # the reference cells themselves: zero against themselves
                refs = [_reference(x, cells, c.relative_to, where, axes) for x in (a, b)]
            out.append(Pair(c.index, a, b, c.metric, c.better, c.claim, *refs,
                            primary=bool(c.primary) or not marked, margin=c.margin))
        if not any(p.index == c.index for p in out):
            raise SpecError(f"{where}: selects only the cells relative_to names, each zero "
                            "against itself; select cells with another value of that axis")
    return out


def controlled(spec: Spec, cells: list[Cell]) -> list[tuple[Control, list[Cell]]]:
    """Each ``[[control]]`` with the cells it bounds (every cell when it names none)."""
    out = []
    for control in spec.controls:
        where = f"[[control]] {control.index} cells"
        found = cells if control.cells is None else select(cells, control.cells, where,
                                                           spec.selectable_axes())
        if not found:
            raise SpecError(f"{where}: selects no cell")
        out.append((control, found))
    return out


def _reference(cell: Cell | None, cells: list[Cell], relative_to: dict[str, str], where: str,
               axes: tuple[Axis, ...]) -> Cell | None:
    """The cell that ``cell``'s metric is taken relative to: equal to it on every axis but
    the one ``relative_to`` names, which has the named value."""
    if cell is None:
        return None
    (key, value), = relative_to.items()
    if not cell.values:
        raise SpecError(f"{where}: relative_to finds a cell's sibling by its axis values, and "
                        f"{cell.name!r} is a [[cell]] listed by hand; select cells of the axes")
    if cell.values.get(key) == value:
        raise SpecError(f"{where}: cell {cell.name!r} already has {key} = {value!r}, so relative "
                        "to itself its metric is zero; select cells with another value")
    refs = select(cells, relative_to, f"{where} relative_to", axes)
    return _partner(cell, refs, {key}, f"{where} relative_to")


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
