"""A sweep's spec: one TOML file that says what to train, how to score it and which
comparisons to make, all before any run. ``read_spec(path)`` checks every key and names the
fix for a bad one; nothing here imports JAX.

    title = "RoPE against ALiBi, trained at 64, scored to 4x"
    seeds = 3                                   # or a list: [0, 1, 2]; or "auto" with
                                                # max_seeds = 10 (power from the [pilot])

    [base]                                      # what every cell shares
    args = "--preset tiny --data corpus.txt"    # any tjax train options
    tokens = 2_000_000                          # training tokens per run (or --steps in args)
    tokens_per_step = 1024                      # optional: batch_size = this / seq_len

    [axes]                                      # the cells are the product of the axes
    "model.position" = ["rope", "alibi", {name = "t5", num_buckets = 32}]
    "train.seq_len" = [64, 128]

    [heldout]                                   # text no cell trains on, drawn by a seed
    bytes = 200_000

    [eval]
    lengths = ["1x", "2x", "4x"]                # multiples of a cell's seq_len, or tokens
    sliding = true                              # also windows sliding by stride
    by_position = true

    [eval.context]                              # context usage (sweep/context.py)
    window = 512                                # tokens a model reads (or "4x")
    target = 16                                 # the last ones scored
    distances = [20, 50, 200]                   # b: the context farther than b is perturbed
    perturbations = ["truncate", "shuffle"]     # default: all registered
    windows = 200                               # drawn once, shared by every cell and seed

    [eval.task]                                 # instead of held-out text: cells that
    lengths = "1-40"                            # train on --task NAME, exact match by task
    examples = 64                               # length (sweep/tasks.py), the same examples
                                                # for every cell and seed
    [[compare]]                                 # declared now, all reported
    a = {position = "alibi"}
    b = {position = "rope"}
    metric = "loss@4x - loss@1x"
    claim = "ALiBi degrades less than RoPE from L to 4L"
    primary = true                              # Holm's family: the primary claims (if any
                                                # is marked; the others are exploratory)
    [[compare]]                                 # "no difference": two one-sided tests
    a = {position = "t5"}
    b = {position = "rope"}
    metric = "loss@1x"
    margin = 0.02                               # equivalent: its 1 - 2 alpha interval inside
    primary = true
    effect = 0.01                               # the smallest difference that matters

    [pilot]                                     # what --dry-run reads the power from
    results = "../sweeps/pilot/results.json"    # a previous sweep's, relative to this file

    [[compare]]                                 # a alone: the metric against zero
    a = {position = "rope"}
    metric = "context:shuffle@200"              # loss increase when the context beyond 200
    claim = "RoPE uses the order of tokens 200 back"  # tokens is shuffled (nats per token)

    [[compare]]                                 # each side minus its sibling's at 2e-3
    a = {qk_norm = "true"}
    b = {qk_norm = "false"}
    metric = "loss@1x"
    relative_to = {learning_rate = "0.002"}     # what a higher rate costs each, compared

    [[control]]                                 # a positive control: every seed of each
    cells = {stage = "base"}                    # cell (default: all) must reach the bound,
    metric = "passkey@1x"                       # else comparisons of that score on it and
    at_least = 0.9                              # the cells started from it are not read

``[[cell]]`` tables list cells by hand (each ``name`` and its options) instead of, or beside,
the product. A cell may start from another cell's runs, seed by seed (``from = "base"``): a
fine-tune trains from the parent's run of the same seed with a budget of its own (``tokens``
or ``train.steps``), a zero-shot cell (``train = false``) trains nothing and scores the
parent's runs with its ``model.*`` options. ``[[stage]]`` tables (``name``, ``from``,
``train``, ``tokens`` and options) take the product of the axes once per stage, each cell
starting from the stage's ``from``: a cell's name, or another stage's name (then the cell of
that stage with the same axis values). In a cell with a parent, multiples ("4x") in options
and evaluation lengths are of the training length of the first cell of its chain (L0).

A comparison's ``a`` and ``b`` select cells by axis values (or a cell's name);
cells that differ in other axes are paired value by value, each pair one comparison of the
family. ``against = {position = "rope"}`` compares every other value of that axis with it.
``a`` alone tests a metric that is itself a difference (``loss@4x - loss@1x``, or a context
metric: perturbed minus intact) against zero, paired over seeds x held-out units.
``relative_to = {axis = value}`` takes each selected cell's metric minus that of its sibling
with that axis value (equal on every other axis), unit by unit: a change against the cell's
own reference (its loss at a sane learning rate, say); the reference cells themselves are left
out of the pairs.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from transformers_jax.sweep.scores import ScoreKind, check_term, in_order, kind_of, parse_term
from transformers_jax.sweep.scores.context import Context  # noqa: F401  (a Spec's field)
from transformers_jax.sweep.scores.exact import TaskEval  # noqa: F401  (a Spec's field)
from transformers_jax.sweep.terms import (  # noqa: F401  (importers read them here)
    Length,
    SpecError,
    parse_length,
    task_range,
)
from transformers_jax.sweep.terms import positive_int as _positive_int
from transformers_jax.sweep.terms import unknown_keys as _unknown

SECTIONS = {"title", "seeds", "max_seeds", "base", "axes", "cell", "stage", "heldout", "eval",
            "baselines", "compare", "control", "pilot"}
CELL_KEYS = {"name", "from", "train", "tokens"}  # besides model.FIELD / train.FIELD options
OPTION = re.compile(r"(model|train)\.[a-z_][a-z0-9_.]*")
BASE_KEYS = {"args", "tokens", "tokens_per_step", "max_epochs"}
HELDOUT_KEYS = {"bytes", "seed"}
EVAL_OWN_KEYS = {"lengths", "sliding", "stride", "chunk_tokens", "by_position", "batch_size",
                 "max_tokens"}


def kind_tables() -> dict[str, ScoreKind]:
    """``[eval]`` table -> the score kind whose settings it holds (``passkey``, ``context``,
    ``task``, and those of kinds registered since)."""
    return {kind.table: kind for kind in in_order() if kind.table}


EVAL_KEYS = EVAL_OWN_KEYS | set(kind_tables())  # the built-in kinds' (what [eval] may hold)
BASELINE_KEYS = {"ngram"}
COMPARE_KEYS = {"a", "b", "against", "metric", "claim", "better", "relative_to", "primary",
                "margin", "effect"}
PILOT_KEYS = {"results"}
CONTROL_KEYS = {"cells", "metric", "at_least", "at_most", "claim"}


@dataclasses.dataclass(frozen=True)
class Axis:
    key: str  # "model.position"
    values: tuple[Any, ...]  # scalars, or dicts for a switch with settings

    @property
    def short(self) -> str:
        return self.key.rpartition(".")[2]

    def label(self, value: Any) -> str:
        """How a value is named in cell names and comparisons: a switch with settings by its
        ``label`` if given, its name if no other value of the axis shares it, else
        ``name(k=v,...)``."""
        if not isinstance(value, dict):
            return toml_text(value)
        if "label" in value:
            return str(value["label"])
        name = str(value.get("name", ""))
        same = [v for v in self.values
                if (v.get("name") if isinstance(v, dict) else v) == name]
        if len(same) == 1:
            return name
        settings = ",".join(f"{k}={toml_text(v)}" for k, v in value.items() if k != "name")
        return f"{name}({settings})"


@dataclasses.dataclass(frozen=True)
class Metric:
    """``loss@4x``, ``sliding@256``, ``context:shuffle@50``, or a difference ``loss@4x -
    loss@1x``. A context term's "length" is its distance b, in tokens."""

    text: str
    terms: tuple[tuple[str, Length], ...]  # (kind, length); a difference has two

    @property
    def per_window(self) -> bool:
        """Whether its units are context windows (else chunks of the held-out stream)."""
        return kind_of(self.terms[0][0]).per_window

    @property
    def better(self) -> str:
        # an accuracy; or per window, the loss a perturbation adds: higher, more context used
        kind = kind_of(self.terms[0][0])
        return "higher" if kind.higher_is_better or kind.per_window else "lower"

    @property
    def kinds(self) -> set[str]:
        """The kinds of score its terms read (``loss``, ``passkey``, ``exact``, ...)."""
        return {kind for kind, _ in self.terms}

    @property
    def against_zero(self) -> bool:
        """Whether the metric is a difference, so that ``a`` alone can test it against zero."""
        return len(self.terms) == 2 or self.per_window


@dataclasses.dataclass(frozen=True)
class Compare:
    a: dict[str, str] | str | None
    b: dict[str, str] | str | None
    against: dict[str, str] | None
    metric: Metric
    claim: str
    better: str
    index: int  # its place in the spec, from 1
    # each cell's metric minus its sibling's with this one axis value (same on every other
    # axis), chunk by chunk: a change against the cell's own reference, such as its loss at a
    # sane learning rate
    relative_to: dict[str, str] | None = None
    # a primary claim: the sweep exists for it, and Holm's family is the primary claims alone
    # (None: not said; a spec that marks none has every claim in the family)
    primary: bool | None = None
    # an equivalence claim: the difference lies within +-margin (two one-sided tests)
    margin: float | None = None
    effect: float | None = None  # the smallest difference that matters (the dry run's power)


@dataclasses.dataclass(frozen=True)
class Control:
    """A positive control: every seed of each cell it selects (``cells``; None: every cell)
    must reach ``bound`` on ``metric`` before a comparison of the same kind of score is read
    on that cell or a cell started from it (a passkey test means nothing about lengths past
    training where the model does not retrieve within it)."""

    cells: dict[str, str] | str | None
    metric: Metric
    bound: float
    at_least: bool  # False: at most (a loss)
    claim: str
    index: int  # its place in the spec, from 1

    def passes(self, value: float) -> bool:
        return value >= self.bound if self.at_least else value <= self.bound

    @property
    def text(self) -> str:
        return f"{self.metric.text} {'>=' if self.at_least else '<='} {self.bound:g}"


@dataclasses.dataclass(frozen=True)
class Base:
    """``[base]``: what every cell shares, and the training budget."""

    args: tuple[str, ...] = ()
    tokens: int | None = None
    tokens_per_step: int | None = None
    max_epochs: float = 1.0


@dataclasses.dataclass(frozen=True)
class Heldout:
    """``[heldout]``: the text no cell trains on, drawn by a seed."""

    bytes: int = 200_000
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Eval:
    """``[eval]``: the lengths scored, and each score kind's own table of settings."""

    lengths: tuple[Length, ...]
    sliding: bool
    stride: Length
    chunk_tokens: int
    by_position: bool
    batch_size: int
    max_tokens: int | None
    slid: tuple[Length, ...] | None = None  # the lengths scored sliding too (None: all)
    # each score kind's settings, by its [eval] table (``ScoreKind.table``): passkey, context...
    tables: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Spec:
    """A spec, one dataclass per section (``[base]``, ``[heldout]``, ``[eval]``...), each built
    by its own parser (``spec_from_dict``); the properties below read through to them."""

    path: str
    text: str  # the file as read (recorded with the results)
    title: str
    seeds: tuple[int, ...]
    base: Base
    axes: tuple[Axis, ...]
    cells: tuple[dict[str, Any], ...]  # explicit cells: name and options
    heldout: Heldout
    eval: Eval
    ngram_orders: tuple[int, ...]  # [baselines] ngram
    compares: tuple[Compare, ...]
    stages: tuple[dict[str, Any], ...] = ()  # [[stage]] tables: name, from, train, tokens, ...
    controls: tuple[Control, ...] = ()  # [[control]] tables: positive controls
    pilot: str | None = None  # [pilot] results: a previous sweep's results.json (the dry run's)
    # seeds = "auto": the most seeds the power analysis may choose (``power.resolve_seeds``);
    # ``seeds`` holds the fewest (2) until it has chosen
    max_seeds: int | None = None

    base_args = property(lambda self: self.base.args)
    tokens = property(lambda self: self.base.tokens)
    tokens_per_step = property(lambda self: self.base.tokens_per_step)
    max_epochs = property(lambda self: self.base.max_epochs)
    heldout_bytes = property(lambda self: self.heldout.bytes)
    heldout_seed = property(lambda self: self.heldout.seed)
    lengths = property(lambda self: self.eval.lengths)
    sliding = property(lambda self: self.eval.sliding)
    stride = property(lambda self: self.eval.stride)
    chunk_tokens = property(lambda self: self.eval.chunk_tokens)
    by_position = property(lambda self: self.eval.by_position)
    eval_batch_size = property(lambda self: self.eval.batch_size)
    eval_max_tokens = property(lambda self: self.eval.max_tokens)
    slid = property(lambda self: self.eval.slid)
    tables = property(lambda self: self.eval.tables)

    @property
    def passkey(self) -> dict | None:
        """``[eval] passkey``: lengths, trials, depths, digits; None: no passkey retrieval."""
        return self.tables.get("passkey")

    @property
    def context(self) -> Context | None:
        """``[eval.context]``; None: no context usage."""
        return self.tables.get("context")

    @property
    def task(self) -> TaskEval | None:
        """``[eval.task]``: exact match of task cells, no held-out text."""
        return self.tables.get("task")

    @property
    def task_sweep(self) -> bool:
        """Whether the cells are scored on a task's examples and on no held-out text."""
        kinds = kind_tables()
        return any(kinds[table].task for table in self.tables)

    @property
    def sliding_lengths(self) -> tuple[Length, ...]:
        """The evaluation lengths also scored in sliding windows."""
        if not self.sliding:
            return ()
        return self.lengths if self.slid is None else self.slid

    def stage_axis(self) -> Axis | None:
        """The stages as an axis (``stage = NAME`` selects a stage's cells), None without."""
        return Axis("stage", tuple(s["name"] for s in self.stages)) if self.stages else None

    def selectable_axes(self) -> tuple[Axis, ...]:
        """The axes a comparison selects cells by: the config axes, and the stages."""
        stage = self.stage_axis()
        return self.axes + ((stage,) if stage else ())

    def scored(self) -> list[tuple[str, Length]]:
        """Every (kind, length) a cell's runs are scored at, in the report's order."""
        return [row for kind in in_order() if kind.in_scores(self) for row in kind.scored(self)]

    def eval_settings(self) -> dict:
        """What decides a cell's scores besides its run (part of the score's key)."""
        kinds = kind_tables()
        tables = {table: kinds[table].record(value) for table, value in self.tables.items()}
        if self.task_sweep:
            return tables
        sliding = self.sliding if self.slid is None else [x.text for x in self.slid]
        # a kind's table only when asked (the keys of sweeps scored before it existed stay as
        # they were), but for the kinds those keys held as None
        absent = {kind.table: None for kind in kinds.values() if kind.keyed_when_absent}
        return {"lengths": [x.text for x in self.lengths], "sliding": sliding,
                "stride": self.stride.text, "chunk_tokens": self.chunk_tokens,
                "by_position": self.by_position, "max_tokens": self.eval_max_tokens,
                "heldout_bytes": self.heldout_bytes, "heldout_seed": self.heldout_seed,
                **absent, **tables}


def toml_text(value: Any) -> str:
    """A value as an option takes it (booleans in lower case)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value == int(value) and abs(value) < 1e16:
        return repr(value)
    return str(value)


def _cell_table(table: dict, where: str, axes: list[Axis] | None = None) -> dict[str, Any]:
    """A ``[[cell]]`` (or, with ``axes``, a ``[[stage]]``) table checked: its name, its parent
    (``from``), whether it trains (``train``), its own budget (``tokens``) and its options."""
    kind = "stage" if axes is not None else "cell"
    name = table.get("name")
    if not isinstance(name, str):
        raise SpecError(f"{where}: give each {kind} a name = \"...\" and its options")
    if not re.fullmatch(r"[A-Za-z0-9_.=,()+-]+", name):
        raise SpecError(f"{where}: name {name!r} becomes a folder name; use letters, digits "
                        "and _ . = , ( ) + -")
    where = f"[[{kind}]] {name}"
    for key in table:
        if key == "seeds":
            raise SpecError(f"{where}: seeds are the spec's (the top-level seeds key); a cell "
                            "with a parent starts from the parent's run of each of them")
        if key not in CELL_KEYS and not OPTION.fullmatch(key):
            raise SpecError(f"{where}: {key!r} is not model.FIELD or train.FIELD, nor one of "
                            f"{', '.join(sorted(CELL_KEYS - {'name'}))}")
    parent = table.get("from")
    if parent is not None and not isinstance(parent, str):
        raise SpecError(f"{where}: from = {parent!r}: the name of the cell (or stage) whose "
                        "runs it starts from")
    if parent == name:
        raise SpecError(f"{where}: from = {parent!r} names itself; a {kind} starts from "
                        "another one")
    trains = table.get("train", True)
    if not isinstance(trains, bool):
        raise SpecError(f"{where}: train = {trains!r}: true (train, from the parent's run if "
                        "it has one) or false (zero-shot: score the parent's runs)")
    tokens = table.get("tokens")
    if tokens is not None:
        tokens = _positive_int(tokens, f"{where} tokens")
    options = {k for k in table if k not in CELL_KEYS}
    options |= {a.key for a in axes or ()}
    if not trains:
        if parent is None:
            raise SpecError(f"{where}: train = false scores another cell's runs; name them "
                            "with from = \"CELL\"")
        trained = sorted(k for k in options if k.startswith("train."))
        if tokens is not None or trained:
            raise SpecError(f"{where}: train = false (zero-shot) trains nothing, so "
                            f"{', '.join(['tokens'] * (tokens is not None) + trained)} has no "
                            "effect; drop it, or make it a fine-tune (train = true)")
    if tokens is not None and "train.steps" in options:
        raise SpecError(f"{where}: gives both tokens and train.steps: give the budget one way")
    if parent is not None and trains and tokens is None and "train.steps" not in options:
        raise SpecError(f"{where}: a fine-tune from {parent!r} needs a budget of its own: "
                        "tokens = N (or train.steps); or train = false to score the parent's "
                        "runs zero-shot")
    return {**table, "from": parent, "train": trains, "tokens": tokens}


def parse_metric(text: Any, where: str) -> Metric:
    if not isinstance(text, str):
        raise SpecError(f"{where} = {text!r}: a metric is a string such as \"loss@1x\"")
    parts = [p.strip() for p in text.split(" - ")]
    if len(parts) > 2 or not all(parts):
        raise SpecError(f"{where} = {text!r}: a metric is one term (\"loss@2x\") or the "
                        "difference of two (\"loss@4x - loss@1x\")")
    terms = tuple(parse_term(part, where) for part in parts)
    if len({kind_of(kind).per_window for kind, _ in terms}) > 1:
        raise SpecError(f"{where} = {text!r}: a context metric is per window, the others per "
                        "chunk of the held-out stream; subtract like from like")
    return Metric(text, terms)


def _selector(value: Any, where: str) -> dict[str, str] | str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value  # a cell's name
    if isinstance(value, dict) and value:
        return {str(k): toml_text(v) if not isinstance(v, dict) else v for k, v in value.items()}
    raise SpecError(f"{where} = {value!r}: select cells by axis values ({{position = "
                    "\"rope\"}}) or by a cell's name (\"my-cell\")")


def parse_spec(text: str, path: str = "<spec>") -> Spec:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise SpecError(f"{path}: not valid TOML: {err}") from None
    return spec_from_dict(raw, text, path)


def _table(raw: dict, key: str) -> dict:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise SpecError(f"[{key}] must be a table of keys, not {type(value).__name__}")
    return value


def _tables(raw: dict, key: str) -> list:
    value = raw.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise SpecError(f"[[{key}]] must be tables, each under its own [[{key}]] line")
    return value


def spec_from_dict(raw: dict, text: str = "", path: str = "<spec>") -> Spec:
    """The checks of ``parse_spec`` on a spec already read into Python values: each section by
    its own function (its fields of the ``Spec``), then the comparisons and controls, checked
    against the spec whose scores they read."""
    _unknown(raw, SECTIONS, path)
    seeds, base, axes = _seeds(raw), _base(raw), _axes(raw)  # in this order: the first error
    base["max_seeds"] = raw.get("max_seeds") if raw.get("seeds") == "auto" else None
    fields = {**base, **_cells(raw, axes), **_heldout(raw), **_eval(raw), **_baselines(raw),
              **_pilot(raw)}
    title = raw.get("title", "")
    if not isinstance(title, str):
        raise SpecError("title: a string")
    if raw.get("seeds") == "auto" and fields["pilot"] is None:
        raise SpecError("seeds = \"auto\" reads the seed-to-seed spread from a pilot: give "
                        "[pilot] results (a previous sweep's results.json)")
    spec = Spec(path=path, text=text, title=title, seeds=seeds, axes=axes, compares=(), **fields)
    kinds = kind_tables()  # each kind's settings once the whole spec is read
    tables = {table: kinds[table].finish(value, spec) for table, value in spec.tables.items()}
    spec = dataclasses.replace(spec, eval=dataclasses.replace(spec.eval, tables=tables))
    return dataclasses.replace(spec, compares=_compares(raw, spec), controls=_controls(raw, spec))


def _seeds(raw: dict) -> tuple[int, ...]:
    """``seeds``: a count, a list of distinct non-negative integers, or ``"auto"`` (with
    ``max_seeds``: the power analysis chooses; 0 and 1 stand in until it has)."""
    seeds_raw = raw.get("seeds", 3)
    if "max_seeds" in raw and seeds_raw != "auto":
        raise SpecError("max_seeds bounds seeds = \"auto\"; drop it, or let the power "
                        "analysis choose the seeds (seeds = \"auto\", with a [pilot])")
    if seeds_raw == "auto":
        if "max_seeds" not in raw:
            raise SpecError("seeds = \"auto\": give max_seeds, the most seeds the power "
                            "analysis may choose (e.g. max_seeds = 10)")
        if _positive_int(raw["max_seeds"], "max_seeds") < 2:
            raise SpecError(f"max_seeds = {raw['max_seeds']}: at least 2 (a t-test over seed "
                            "means needs two)")
        return (0, 1)
    if isinstance(seeds_raw, int) and not isinstance(seeds_raw, bool):
        seeds = tuple(range(_positive_int(seeds_raw, "seeds")))
    elif isinstance(seeds_raw, list) and seeds_raw and all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds_raw):
        seeds = tuple(seeds_raw)
        if len(set(seeds)) != len(seeds):
            raise SpecError(f"seeds = {seeds_raw}: a seed is listed twice")
    else:
        raise SpecError(f"seeds = {seeds_raw!r}: give a count (3) or a list of distinct "
                        "non-negative integers ([0, 1, 2])")
    return seeds


def _base(raw: dict) -> dict:
    """``[base]``: the options every cell shares and the training budget."""
    base = _table(raw, "base")
    _unknown(base, BASE_KEYS, "[base]")
    args = base.get("args", [])
    if isinstance(args, str):
        args = shlex.split(args)
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise SpecError("[base] args: a string of tjax train options, or a list of strings")
    for forbidden in ("--run-dir", "--train.run_dir", "--seed", "--train.seed",
                      "--train.resume"):
        if any(a == forbidden or a.startswith(forbidden + "=") for a in args):
            raise SpecError(f"[base] args: {forbidden} is the sweep's to set (each cell and "
                            "seed is its own run directory under --out); drop it")
    tokens = base.get("tokens")
    if tokens is not None:
        tokens = _positive_int(tokens, "[base] tokens")
        if any(a in ("--steps", "--train.steps") or a.startswith(("--steps=", "--train.steps="))
               for a in args):
            raise SpecError("[base] gives both tokens and --steps: give the budget one way")
    per_step = base.get("tokens_per_step")
    if per_step is not None:
        per_step = _positive_int(per_step, "[base] tokens_per_step")
    max_epochs = base.get("max_epochs", 1.0)
    if not isinstance(max_epochs, (int, float)) or max_epochs <= 0:
        raise SpecError(f"[base] max_epochs = {max_epochs!r}: must be positive (1: each "
                        "training token seen at most once)")
    return {"base": Base(tuple(args), tokens, per_step, float(max_epochs))}


def _axes(raw: dict) -> tuple[Axis, ...]:
    """``[axes]``: config fields and their values, whose product is the cells."""
    axes = []
    for key, values in _table(raw, "axes").items():
        where = f"[axes] {key!r}"
        if not re.fullmatch(r"(model|train)\.[a-z_][a-z0-9_.]*", key):
            raise SpecError(f"{where}: an axis is a config field, model.FIELD or train.FIELD "
                            "(as in --model.position); seeds go in the top-level seeds key")
        if key in ("train.seed", "train.run_dir", "train.data"):
            raise SpecError(f"{where}: {key} is the sweep's to set (seeds: the top-level "
                            "seeds key; data: [base] args --data)")
        if not isinstance(values, list):
            raise SpecError(f"{where}: give a list of values")
        if not values:
            raise SpecError(f"{where} is empty: the product of the axes would have no cell")
        for v in values:
            if isinstance(v, dict) and "name" not in v:
                raise SpecError(f"{where}: {v!r} gives settings without the switch's name "
                                "({name = \"t5\", num_buckets = 32})")
            if isinstance(v, list):
                raise SpecError(f"{where}: {v!r} is a list; an axis value is one value")
        axis = Axis(key, tuple(values))
        labels = [axis.label(v) for v in values]
        if len(set(labels)) != len(labels):
            raise SpecError(f"{where}: two values have the same label ({labels}); give the "
                            "switch values a label = \"...\"")
        axes.append(axis)
    if len({a.short for a in axes}) != len(axes):
        raise SpecError(f"[axes]: two axes end in the same field name ({[a.key for a in axes]});"
                        " selectors use the last part, so it must be unique")
    return tuple(axes)


def _cells(raw: dict, axes: tuple[Axis, ...]) -> dict:
    """``[[cell]]`` and ``[[stage]]`` tables."""
    cells = [_cell_table(c, f"[[cell]] {i}") for i, c in enumerate(_tables(raw, "cell"), 1)]
    stages = [_cell_table(s, f"[[stage]] {i}", list(axes))
              for i, s in enumerate(_tables(raw, "stage"), 1)]
    names = [s["name"] for s in stages]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SpecError(f"[[stage]]: two stages are named {twice[0]!r}; give each its own name")
    if stages and any(a.short == "stage" for a in axes):
        raise SpecError("[axes]: an axis ending in 'stage' clashes with the stages' own axis "
                        "(stage = NAME); rename the stages' field or drop the [[stage]] tables")
    return {"cells": tuple(cells), "stages": tuple(stages)}


def _heldout(raw: dict) -> dict:
    """``[heldout]``: how much text is held out, drawn by which seed."""
    held = _table(raw, "heldout")
    _unknown(held, HELDOUT_KEYS, "[heldout]")
    heldout_bytes = _positive_int(held.get("bytes", 200_000), "[heldout] bytes")
    heldout_seed = held.get("seed", 0)
    if isinstance(heldout_seed, bool) or not isinstance(heldout_seed, int) or heldout_seed < 0:
        raise SpecError(f"[heldout] seed = {heldout_seed!r}: a non-negative integer")
    return {"heldout": Heldout(heldout_bytes, heldout_seed)}


def _eval(raw: dict) -> dict:
    """``[eval]``: the lengths scored, and each score kind's own table."""
    ev = _table(raw, "eval")
    kinds = kind_tables()
    _unknown(ev, EVAL_OWN_KEYS | set(kinds), "[eval]")
    lengths_raw = ev.get("lengths", ["1x"])
    if not isinstance(lengths_raw, list) or not lengths_raw:
        raise SpecError("[eval] lengths: a non-empty list such as [\"1x\", \"2x\"] or [64, 128]")
    lengths = tuple(parse_length(x, "[eval] lengths") for x in lengths_raw)
    stride = parse_length(ev.get("stride", "0.25x"), "[eval] stride")
    sliding = ev.get("sliding", False)
    slid = None
    if isinstance(sliding, list):
        slid = tuple(parse_length(x, "[eval] sliding") for x in sliding)
        missing = [x.text for x in slid if x.text not in [y.text for y in lengths]]
        if not slid or missing:
            raise SpecError(f"[eval] sliding = {sliding!r}: true, false, or a non-empty list "
                            f"of lengths from [eval] lengths ({[x.text for x in lengths]})")
    elif not isinstance(sliding, bool):
        raise SpecError(f"[eval] sliding = {sliding!r}: true, false, or a list of the "
                        "lengths to slide ([\"16x\"])")
    chunk = _positive_int(ev.get("chunk_tokens", 1000), "[eval] chunk_tokens")
    max_tokens = ev.get("max_tokens")
    if max_tokens is not None:
        max_tokens = _positive_int(max_tokens, "[eval] max_tokens")
    # each score kind's own table ([eval] passkey, [eval.context], [eval.task]): a Spec field
    owned = {table: kind.parse_table(ev[table], lengths_raw) for table, kind in kinds.items()
             if table in ev}
    task_tables = [table for table in owned if kinds[table].task]
    if task_tables:  # what a task sweep does not use (its batch: examples)
        text_only = EVAL_OWN_KEYS | {t for t, kind in kinds.items() if not kind.task}
        text_keys = sorted(set(ev) & text_only) + [f"[{k}]" for k in ("heldout", "baselines")
                                                   if k in raw]
        if text_keys:
            raise SpecError(f"[eval.{task_tables[0]}]: a task sweep scores exact match on task "
                            f"examples and no held-out text, so {', '.join(text_keys)} would do "
                            "nothing; drop it, or drop [eval.task] to score text")
    return {"eval": Eval(lengths, bool(sliding), stride, chunk, bool(ev.get("by_position", True)),
                         _positive_int(ev.get("batch_size", 8), "[eval] batch_size"),
                         max_tokens, slid, owned)}


def _baselines(raw: dict) -> dict:
    """``[baselines]``: the n-gram orders fitted."""
    base_lines = _table(raw, "baselines")
    _unknown(base_lines, BASELINE_KEYS, "[baselines]")
    orders = base_lines.get("ngram", [2, 3, 4, 5])
    if not isinstance(orders, list) or not all(
            isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 8 for k in orders):
        raise SpecError(f"[baselines] ngram = {orders!r}: a list of orders in 1-8 ([] for none)")
    return {"ngram_orders": tuple(orders)}


def _compares(raw: dict, spec: Spec) -> tuple[Compare, ...]:
    """``[[compare]]`` tables, each metric one the spec scores."""
    compares = []
    for i, c in enumerate(_tables(raw, "compare"), 1):
        where = f"[[compare]] {i}"
        _unknown(c, COMPARE_KEYS, where)
        if "metric" not in c:
            raise SpecError(f"{where}: give the metric it compares (\"loss@1x\")")
        metric = parse_metric(c["metric"], f"{where} metric")
        has_pair = "a" in c or "b" in c
        if has_pair == ("against" in c):
            raise SpecError(f"{where}: give a and b (two selections of cells), or against "
                            "(every other value of an axis against one), not both")
        if "b" in c and "a" not in c:
            raise SpecError(f"{where}: give both a and b (or a alone, to test a difference "
                            "against zero)")
        relative_to = _selector(c.get("relative_to"), f"{where} relative_to")
        if relative_to is not None and (not isinstance(relative_to, dict)
                                        or len(relative_to) != 1):
            raise SpecError(f"{where} relative_to: one axis and its value ({{learning_rate = "
                            "\"0.002\"}}): each cell's metric is taken minus its sibling's "
                            "with that value")
        if relative_to is not None and "against" in c:
            raise SpecError(f"{where}: relative_to goes with a and b (or a alone), not with "
                            "against; list the pairs with a and b")
        if "a" in c and "b" not in c and not metric.against_zero and relative_to is None:
            raise SpecError(f"{where}: a alone tests its metric against zero, and "
                            f"{metric.text!r} is no difference; give b, a metric that is "
                            "one (\"loss@4x - loss@1x\", \"context:shuffle@50\"), or "
                            "relative_to (the metric minus a sibling cell's)")
        against = _selector(c.get("against"), f"{where} against")
        if against is not None and (not isinstance(against, dict) or len(against) != 1):
            raise SpecError(f"{where} against: one axis and its value ({{position = \"rope\"}})")
        better = c.get("better", metric.better)
        if better not in ("lower", "higher"):
            raise SpecError(f"{where} better = {better!r}: \"lower\" or \"higher\"")
        if len({kind_of(kind).higher_is_better for kind, _ in metric.terms}) > 1:
            raise SpecError(f"{where}: {metric.text!r} subtracts a loss from an accuracy; "
                            "compare like with like")
        if len(metric.terms) == 2 and len({kind_of(k).name for k, _ in metric.terms}) == 1:
            (kind, first), (_, second) = metric.terms
            kind_of(kind).check_difference(first, second, metric.text, where)
        _check_terms(metric, spec, where)
        primary = c.get("primary")
        if primary is not None and not isinstance(primary, bool):
            raise SpecError(f"{where} primary = {primary!r}: true (a claim the sweep exists "
                            "for, in the corrected family) or false (exploratory)")
        margin, effect = c.get("margin"), c.get("effect")
        if margin is not None and not _positive_number(margin):
            raise SpecError(f"{where} margin = {margin!r}: a positive number in the metric's "
                            "units, within which the difference counts as none (\"no "
                            "difference\" claims)")
        if effect is not None and not _positive_number(effect):
            raise SpecError(f"{where} effect = {effect!r}: a positive number in the metric's "
                            "units, the smallest difference that matters (the dry run gives "
                            "the design's power at it)")
        compares.append(Compare(_selector(c.get("a"), f"{where} a"),
                                _selector(c.get("b"), f"{where} b"), against, metric,
                                str(c.get("claim", "")), better, i, relative_to, primary,
                                None if margin is None else float(margin),
                                None if effect is None else float(effect)))
    if not any(c.primary for c in compares) and any(c.primary is False for c in compares):
        raise SpecError("[[compare]]: primary = false marks a claim exploratory, and no claim "
                        "is primary; mark the claims the sweep exists for primary = true")
    if raw.get("seeds") == "auto" and not any(
            c.effect is not None and c.primary is not False for c in compares):
        raise SpecError("seeds = \"auto\" chooses the seeds that give the primary claims 80% "
                        "power at their stated effect: state one (effect = 0.05) on a claim")
    return tuple(compares)


def _controls(raw: dict, spec: Spec) -> tuple[Control, ...]:
    """``[[control]]`` tables: positive controls, each bounding one score."""
    controls = []
    for i, c in enumerate(_tables(raw, "control"), 1):
        where = f"[[control]] {i}"
        _unknown(c, CONTROL_KEYS, where)
        if "metric" not in c:
            raise SpecError(f"{where}: give the metric every seed must reach "
                            "(\"passkey@1x\")")
        metric = parse_metric(c["metric"], f"{where} metric")
        bounds = [k for k in ("at_least", "at_most") if k in c]
        if len(bounds) != 1:
            raise SpecError(f"{where}: give one bound, at_least (an accuracy: at_least = 0.9) "
                            "or at_most (a loss)")
        bound = c[bounds[0]]
        if isinstance(bound, bool) or not isinstance(bound, (int, float)):
            raise SpecError(f"{where} {bounds[0]} = {bound!r}: a number")
        if len(metric.terms) != 1 or metric.per_window:
            raise SpecError(f"{where}: {metric.text!r} is a difference; a control bounds one "
                            "score (\"passkey@1x\", \"exact@1-20\", \"loss@1x\")")
        _check_terms(metric, spec, where)
        controls.append(Control(_selector(c.get("cells"), f"{where} cells"), metric,
                                float(bound), bounds[0] == "at_least",
                                str(c.get("claim", "")), i))
    return tuple(controls)


def _pilot(raw: dict) -> dict:
    """``[pilot]``: a previous sweep's results.json, whose seed-to-seed spread the dry run
    reads to say what each comparison can detect."""
    table = _table(raw, "pilot")
    _unknown(table, PILOT_KEYS, "[pilot]")
    results = table.get("results")
    if results is not None and (not isinstance(results, str) or not results):
        raise SpecError(f"[pilot] results = {results!r}: the path of a previous sweep's "
                        "results.json, relative to this spec's folder")
    return {"pilot": results}


def _positive_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0


def _check_terms(metric: Metric, spec: Spec, where: str) -> None:
    """Each term of ``metric`` is one ``spec``'s evaluation scores."""
    for kind, length in metric.terms:
        check_term(kind, length, spec, where, metric.text)


def read_spec(path: str) -> Spec:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such spec file") from None
    return parse_spec(text, path)

