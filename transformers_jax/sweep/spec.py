"""A sweep's spec: one TOML file that says what to train, how to score it and which
comparisons to make, all before any run. ``read_spec(path)`` checks every key and names the
fix for a bad one; nothing here imports JAX.

    title = "RoPE against ALiBi, trained at 64, scored to 4x"
    seeds = 3                                   # or a list: [0, 1, 2]

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

from transformers_jax.config import ConfigError
from transformers_jax.overrides import closest
from transformers_jax.sweep.context import PERTURBATIONS

SECTIONS = {"title", "seeds", "base", "axes", "cell", "stage", "heldout", "eval", "baselines",
            "compare", "control"}
CELL_KEYS = {"name", "from", "train", "tokens"}  # besides model.FIELD / train.FIELD options
OPTION = re.compile(r"(model|train)\.[a-z_][a-z0-9_.]*")
BASE_KEYS = {"args", "tokens", "tokens_per_step", "max_epochs"}
HELDOUT_KEYS = {"bytes", "seed"}
EVAL_KEYS = {"lengths", "sliding", "stride", "chunk_tokens", "by_position", "passkey", "batch_size",
             "max_tokens", "context", "task"}
TASK_KEYS = {"lengths", "examples", "seed"}
TEXT_EVAL_KEYS = EVAL_KEYS - {"task"}  # what a task sweep does not use (its batch: examples)
BASELINE_KEYS = {"ngram"}
COMPARE_KEYS = {"a", "b", "against", "metric", "claim", "better", "relative_to"}
CONTROL_KEYS = {"cells", "metric", "at_least", "at_most", "claim"}
PASSKEY_KEYS = {"lengths", "trials", "depths", "digits"}
CONTEXT_KEYS = {"window", "target", "distances", "perturbations", "windows", "span", "seed"}
METRIC = re.compile(r"^(loss|sliding|passkey)@(\d+(?:\.\d+)?x|\d+)$")
EXACT_METRIC = re.compile(r"^exact@(\d+(?:-\d+)?)$")  # exact@L or exact@A-B (a mean)
CONTEXT_METRIC = re.compile(r"^(context:[a-z_]+)@(\d+)$")  # context:PERTURBATION@DISTANCE


class SpecError(ConfigError):
    """A spec that cannot run: the message names the key and the fix."""


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
class Length:
    """An evaluation length: ``times`` x the cell's seq_len, or ``tokens``."""

    text: str
    times: float | None = None
    tokens: int | None = None

    def resolve(self, seq_len: int) -> int:
        if self.tokens is not None:
            return self.tokens
        n = self.times * seq_len
        if n != int(n) or n < 2:
            raise SpecError(f"eval length {self.text} of seq_len {seq_len} is {n} tokens: "
                            "choose a multiple that gives a whole number of at least 2")
        return int(n)


@dataclasses.dataclass(frozen=True)
class Metric:
    """``loss@4x``, ``sliding@256``, ``context:shuffle@50``, or a difference ``loss@4x -
    loss@1x``. A context term's "length" is its distance b, in tokens."""

    text: str
    terms: tuple[tuple[str, Length], ...]  # (kind, length); a difference has two

    @property
    def per_window(self) -> bool:
        """Whether its units are context windows (else chunks of the held-out stream)."""
        return self.terms[0][0].startswith("context:")

    @property
    def better(self) -> str:
        # passkey, exact: accuracy; context: the loss a perturbation adds, higher = more
        # context used
        accuracy = self.terms[0][0] in ("passkey", "exact")
        return "higher" if accuracy or self.per_window else "lower"

    @property
    def kinds(self) -> set[str]:
        """The kinds of score its terms read (``loss``, ``passkey``, ``exact``, ...)."""
        return {kind for kind, _ in self.terms}

    @property
    def against_zero(self) -> bool:
        """Whether the metric is a difference, so that ``a`` alone can test it against zero."""
        return len(self.terms) == 2 or self.per_window


@dataclasses.dataclass(frozen=True)
class Context:
    """``[eval.context]``: context usage (``sweep/context.py``) in windows of ``window``
    tokens, the last ``target`` scored, the context farther than each distance perturbed."""

    window: Length
    target: int
    distances: tuple[int, ...]
    perturbations: tuple[str, ...]
    windows: int
    span: int  # shuffle_local's spans
    seed: int

    def check(self, window: int, where: str) -> None:
        """Every distance leaves some far context in a window of ``window`` tokens."""
        if self.target >= window:
            raise SpecError(f"{where}: target = {self.target} scores the whole window of "
                            f"{window} tokens; score fewer (the context is what comes before)")
        longest = window + 1 - self.target  # the first target's context, w[:first]
        far = [b for b in self.distances if b >= longest]
        if far:
            raise SpecError(f"{where}: distance {far[0]} leaves no context to perturb in a window "
                            f"of {window} tokens with {self.target} targets (the first target "
                            f"has {longest} before it); use distances below {longest} or a "
                            "longer window")

    def settings(self) -> dict:
        return {**dataclasses.asdict(self), "window": self.window.text,
                "distances": list(self.distances), "perturbations": list(self.perturbations)}


def task_range(text: str) -> tuple[int, int]:
    """``"21-40"`` -> (21, 40), ``"7"`` -> (7, 7): task lengths, inclusive."""
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


@dataclasses.dataclass(frozen=True)
class TaskEval:
    """``[eval.task]``: exact match of task cells (``--task NAME``) at each task length in
    ``lengths``, on ``examples`` test examples per length drawn by ``seed``: the same
    examples for every cell (of one task) and seed, so that they pair example by example."""

    lengths: tuple[int, ...]
    examples: int
    seed: int

    def settings(self) -> dict:
        return {"lengths": list(self.lengths), "examples": self.examples, "seed": self.seed}


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
class Spec:
    path: str
    text: str  # the file as read (recorded with the results)
    title: str
    seeds: tuple[int, ...]
    base_args: tuple[str, ...]
    tokens: int | None
    tokens_per_step: int | None
    max_epochs: float
    axes: tuple[Axis, ...]
    cells: tuple[dict[str, Any], ...]  # explicit cells: name and options
    heldout_bytes: int
    heldout_seed: int
    lengths: tuple[Length, ...]
    sliding: bool
    stride: Length
    chunk_tokens: int
    by_position: bool
    passkey: dict | None  # lengths, trials, depths, digits; None: no passkey retrieval
    eval_batch_size: int
    eval_max_tokens: int | None
    ngram_orders: tuple[int, ...]
    compares: tuple[Compare, ...]
    stages: tuple[dict[str, Any], ...] = ()  # [[stage]] tables: name, from, train, tokens, ...
    slid: tuple[Length, ...] | None = None  # the lengths scored sliding too (None: all)
    context: Context | None = None  # [eval.context]; None: no context usage
    task: TaskEval | None = None  # [eval.task]: exact match of task cells, no held-out text
    controls: tuple[Control, ...] = ()  # [[control]] tables: positive controls

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
        if self.task is not None:
            return [("exact", Length(str(n), tokens=n)) for n in self.task.lengths]
        out = [("loss", x) for x in self.lengths]
        out += [("sliding", x) for x in self.sliding_lengths]
        return out + [("passkey", x) for x in self.passkey["lengths"]] if self.passkey else out

    def eval_settings(self) -> dict:
        """What decides a cell's scores besides its run (part of the score's key)."""
        if self.task is not None:
            return {"task": self.task.settings()}
        sliding = self.sliding if self.slid is None else [x.text for x in self.slid]
        return {"lengths": [x.text for x in self.lengths], "sliding": sliding,
                "stride": self.stride.text, "chunk_tokens": self.chunk_tokens,
                "by_position": self.by_position,
                "passkey": self.passkey and {**self.passkey, "lengths": [
                    x.text for x in self.passkey["lengths"]]},
                "max_tokens": self.eval_max_tokens,
                "heldout_bytes": self.heldout_bytes, "heldout_seed": self.heldout_seed,
                # only when asked: the keys of sweeps scored before it existed stay as they were
                **({"context": self.context.settings()} if self.context else {})}


def toml_text(value: Any) -> str:
    """A value as an option takes it (booleans in lower case)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value == int(value) and abs(value) < 1e16:
        return repr(value)
    return str(value)


def _unknown(keys, known: set[str], where: str) -> None:
    for key in keys:
        if key not in known:
            near = closest(key, known)
            hint = f"did you mean {near!r}? " if near else ""
            raise SpecError(f"{where}: unknown key {key!r}; {hint}valid keys: "
                            f"{', '.join(sorted(known))}")


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SpecError(f"{where} = {value!r}: must be a positive integer")
    return value


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


def parse_length(text: Any, where: str) -> Length:
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 2:
            raise SpecError(f"{where} = {text}: a length is at least 2 tokens")
        return Length(str(text), tokens=text)
    if isinstance(text, str) and re.fullmatch(r"\d+(\.\d+)?x", text):
        times = float(text[:-1])
        if times <= 0:
            raise SpecError(f"{where} = {text!r}: the multiple must be positive")
        return Length(text, times=times)
    raise SpecError(f"{where} = {text!r}: give tokens (256) or a multiple of the cell's "
                    "seq_len as a string (\"2x\", \"0.25x\")")


def parse_metric(text: Any, where: str) -> Metric:
    if not isinstance(text, str):
        raise SpecError(f"{where} = {text!r}: a metric is a string such as \"loss@1x\"")
    parts = [p.strip() for p in text.split(" - ")]
    if len(parts) > 2 or not all(parts):
        raise SpecError(f"{where} = {text!r}: a metric is one term (\"loss@2x\") or the "
                        "difference of two (\"loss@4x - loss@1x\")")
    terms = []
    for part in parts:
        m = EXACT_METRIC.match(part)
        if m:
            lo, hi = task_range(m.group(1))
            if not 1 <= lo <= hi:
                raise SpecError(f"{where}: {part!r} is no range of task lengths; write "
                                "exact@LOW-HIGH with 1 <= LOW <= HIGH")
            terms.append(("exact", Length(m.group(1))))
            continue
        m = CONTEXT_METRIC.match(part)
        if m:
            terms.append((m.group(1), Length(m.group(2), tokens=int(m.group(2)))))
            continue
        m = METRIC.match(part)
        if not m:
            raise SpecError(f"{where}: {part!r} is not a metric; use loss@L (non-overlapping "
                            "windows of L), sliding@L (sliding windows) or passkey@L (passkey "
                            "retrieval), L tokens or a multiple of seq_len such as 2x; or "
                            "context:PERTURBATION@B (the loss increase when the context beyond "
                            "B tokens is perturbed, [eval.context]); or exact@N / exact@A-B "
                            "(exact match at task length N, or its mean over A-B, [eval.task])")
        terms.append((m.group(1), parse_length(_length_value(m.group(2)), where)))
    if len({kind.startswith("context:") for kind, _ in terms}) > 1:
        raise SpecError(f"{where} = {text!r}: a context metric is per window, the others per "
                        "chunk of the held-out stream; subtract like from like")
    return Metric(text, tuple(terms))


def _distinct_list(value: Any, where: str, item_ok, item: str) -> list:
    if not isinstance(value, list) or not value or not all(item_ok(v) for v in value):
        raise SpecError(f"{where} = {value!r}: a non-empty list of {item}")
    if len(set(value)) != len(value):
        raise SpecError(f"{where} = {value!r}: a value is listed twice")
    return value


def parse_context(table: Any) -> Context:
    """``[eval.context]`` checked (its window against each cell's length in the plan)."""
    where = "[eval.context]"
    if not isinstance(table, dict):
        raise SpecError(f"{where}: a table such as {{window = 512, target = 16, distances = "
                        "[20, 50, 200]}")
    _unknown(table, CONTEXT_KEYS, where)
    for key in ("window", "distances"):
        if key not in table:
            raise SpecError(f"{where}: give {key} (window: tokens a model reads, such as 512 "
                            "or \"4x\"; distances: b in tokens, such as [20, 50, 200])")
    window = parse_length(table["window"], f"{where} window")
    target = _positive_int(table.get("target", 1), f"{where} target")
    distances = _distinct_list(table["distances"], f"{where} distances",
                               lambda b: isinstance(b, int) and not isinstance(b, bool)
                               and b > 0, "distances in tokens (1 or more: the first target "
                               "needs a token to be predicted from)")
    names = _distinct_list(table.get("perturbations", list(PERTURBATIONS.names())),
                           f"{where} perturbations", lambda n: isinstance(n, str),
                           f"names ({', '.join(PERTURBATIONS.names())})")
    for name in names:
        if name not in PERTURBATIONS:
            near = closest(name, set(PERTURBATIONS.names()))
            raise SpecError(f"{where} perturbations: {name!r} is not one; "
                            + (f"did you mean {near!r}? " if near else "")
                            + f"known: {', '.join(PERTURBATIONS.names())}")
    seed = table.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise SpecError(f"{where} seed = {seed!r}: a non-negative integer")
    context = Context(window, target, tuple(sorted(distances)), tuple(names),
                      _positive_int(table.get("windows", 200), f"{where} windows"),
                      _positive_int(table.get("span", 20), f"{where} span"), seed)
    if window.tokens is not None:
        context.check(window.tokens, where)
    return context


def _length_value(text: str) -> Any:
    return text if text.endswith("x") else int(text)


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
    """The checks of ``parse_spec`` on a spec already read into Python values."""
    _unknown(raw, SECTIONS, path)

    seeds_raw = raw.get("seeds", 3)
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

    cells = [_cell_table(c, f"[[cell]] {i}") for i, c in enumerate(_tables(raw, "cell"), 1)]
    stages = [_cell_table(s, f"[[stage]] {i}", axes)
              for i, s in enumerate(_tables(raw, "stage"), 1)]
    names = [s["name"] for s in stages]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SpecError(f"[[stage]]: two stages are named {twice[0]!r}; give each its own name")
    if stages and any(a.short == "stage" for a in axes):
        raise SpecError("[axes]: an axis ending in 'stage' clashes with the stages' own axis "
                        "(stage = NAME); rename the stages' field or drop the [[stage]] tables")

    held = _table(raw, "heldout")
    _unknown(held, HELDOUT_KEYS, "[heldout]")
    heldout_bytes = _positive_int(held.get("bytes", 200_000), "[heldout] bytes")
    heldout_seed = held.get("seed", 0)
    if isinstance(heldout_seed, bool) or not isinstance(heldout_seed, int) or heldout_seed < 0:
        raise SpecError(f"[heldout] seed = {heldout_seed!r}: a non-negative integer")

    ev = _table(raw, "eval")
    _unknown(ev, EVAL_KEYS, "[eval]")
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
    passkey = ev.get("passkey")
    if passkey is not None:
        if passkey is True:
            passkey = {}
        if not isinstance(passkey, dict):
            raise SpecError("[eval] passkey: true, or a table {trials = 8, depths = [0.0, 0.5, "
                            "1.0], digits = 5}")
        _unknown(passkey, PASSKEY_KEYS, "[eval] passkey")
        depths = passkey.get("depths", [0.0, 0.5, 1.0])
        if not isinstance(depths, list) or not depths or not all(
                isinstance(d, (int, float)) and not isinstance(d, bool) and 0 <= d <= 1
                for d in depths):
            raise SpecError(f"[eval] passkey depths = {depths!r}: a list of fractions in [0, 1]")
        lengths_pk = passkey.get("lengths", lengths_raw)
        if not isinstance(lengths_pk, list) or not lengths_pk:
            raise SpecError("[eval] passkey lengths: a non-empty list (default: [eval] lengths)")
        passkey = {"lengths": tuple(parse_length(x, "[eval] passkey lengths")
                                    for x in lengths_pk),
                   "trials": _positive_int(passkey.get("trials", 8), "[eval] passkey trials"),
                   "depths": [float(d) for d in depths],
                   "digits": _positive_int(passkey.get("digits", 5), "[eval] passkey digits")}
    max_tokens = ev.get("max_tokens")
    if max_tokens is not None:
        max_tokens = _positive_int(max_tokens, "[eval] max_tokens")
    context = parse_context(ev["context"]) if "context" in ev else None
    task = None
    if "task" in ev:
        task = parse_task(ev["task"])
        text_keys = sorted(set(ev) & TEXT_EVAL_KEYS) + [f"[{k}]" for k in ("heldout", "baselines")
                                                         if k in raw]
        if text_keys:
            raise SpecError(f"[eval.task]: a task sweep scores exact match on task examples and "
                            f"no held-out text, so {', '.join(text_keys)} would do nothing; "
                            "drop it, or drop [eval.task] to score text")

    base_lines = _table(raw, "baselines")
    _unknown(base_lines, BASELINE_KEYS, "[baselines]")
    orders = base_lines.get("ngram", [2, 3, 4, 5])
    if not isinstance(orders, list) or not all(
            isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 8 for k in orders):
        raise SpecError(f"[baselines] ngram = {orders!r}: a list of orders in 1-8 ([] for none)")

    def check_terms(metric: Metric, where: str) -> None:
        """Each term of ``metric`` is one this spec's evaluation scores."""
        for kind, length in metric.terms:
            if kind == "exact" or task is not None:
                _check_exact_term(kind, length, task, f"{where}: {metric.text!r}")
                continue
            if kind.startswith("context:"):
                _check_context_term(kind, length, context, f"{where}: {metric.text!r}")
                continue
            if kind == "sliding" and not sliding:
                raise SpecError(f"{where}: {metric.text!r} needs sliding windows; set "
                                "[eval] sliding = true")
            if kind == "passkey" and passkey is None:
                raise SpecError(f"{where}: {metric.text!r} needs passkey retrieval; set "
                                "[eval] passkey = true (or a table of its settings)")
            scored = (passkey["lengths"] if kind == "passkey" else
                      slid if kind == "sliding" and slid is not None else lengths)
            if not any(length.text == x.text for x in scored):
                table = ("[eval] passkey lengths" if kind == "passkey" else "[eval] sliding"
                         if kind == "sliding" and slid is not None else "[eval] lengths")
                raise SpecError(f"{where}: {metric.text!r} needs length {length.text}, which "
                                f"{table} ({[x.text for x in scored]}) does not score; add it "
                                "there")

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
        if len({kind in ("passkey", "exact") for kind, _ in metric.terms}) > 1:
            raise SpecError(f"{where}: {metric.text!r} subtracts a loss from an accuracy; "
                            "compare like with like")
        widths = [task_range(x.text)[1] - task_range(x.text)[0] for k, x in metric.terms
                  if k == "exact"]
        if len(widths) == 2 and widths[0] != widths[1]:
            first, second = (x.text for _, x in metric.terms)
            lo, _ = task_range(second)
            raise SpecError(f"{where}: {metric.text!r} subtracts exact match example by example,"
                            " so it needs ranges of as many lengths on both sides (e.g. "
                            f"\"exact@{first} - exact@{lo}-{lo + widths[0]}\")")
        check_terms(metric, where)
        compares.append(Compare(_selector(c.get("a"), f"{where} a"),
                                _selector(c.get("b"), f"{where} b"), against, metric,
                                str(c.get("claim", "")), better, i, relative_to))

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
        check_terms(metric, where)
        controls.append(Control(_selector(c.get("cells"), f"{where} cells"), metric,
                                float(bound), bounds[0] == "at_least",
                                str(c.get("claim", "")), i))

    title = raw.get("title", "")
    if not isinstance(title, str):
        raise SpecError("title: a string")
    return Spec(path, text, title, seeds, tuple(args), tokens, per_step, float(max_epochs),
                tuple(axes), tuple(cells), heldout_bytes, heldout_seed, lengths,
                bool(sliding), stride, chunk, bool(ev.get("by_position", True)),
                passkey,
                _positive_int(ev.get("batch_size", 8), "[eval] batch_size"), max_tokens,
                tuple(orders), tuple(compares), tuple(stages), slid, context, task,
                tuple(controls))


def _task_lengths(value: Any, where: str) -> tuple[int, ...]:
    """``"21-40"``, ``12``, or a list of them: the task lengths, sorted, each once."""
    items = value if isinstance(value, list) else [value]
    found: set[int] = set()
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool) and item >= 1:
            found.add(item)
        elif isinstance(item, str) and re.fullmatch(r"\d+(-\d+)?", item.strip()):
            lo, hi = task_range(item.strip())
            if not 1 <= lo <= hi:
                raise SpecError(f"{where} = {value!r}: {item!r} is an empty range; write "
                                "\"LOW-HIGH\" with 1 <= LOW <= HIGH")
            found.update(range(lo, hi + 1))
        else:
            raise SpecError(f"{where} = {value!r}: give task lengths as a range (\"1-40\"), a "
                            "positive integer, or a list of them ([8, \"17-24\"])")
    if not found:
        raise SpecError(f"{where} = {value!r}: give at least one task length (\"1-40\")")
    return tuple(sorted(found))


def parse_task(table: Any) -> TaskEval:
    """``[eval.task]``, checked: the task lengths scored, examples per length, their seed."""
    where = "[eval.task]"
    if not isinstance(table, dict):
        raise SpecError(f"{where}: a table, such as [eval.task] lengths = \"1-40\", "
                        "examples = 64")
    _unknown(table, TASK_KEYS, where)
    if "lengths" not in table:
        raise SpecError(f"{where}: give lengths, the task lengths to score (\"1-40\": the "
                        "training lengths and past them)")
    seed = table.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise SpecError(f"{where} seed = {seed!r}: a non-negative integer (draws the test "
                        "examples, the same for every cell and seed)")
    return TaskEval(_task_lengths(table["lengths"], f"{where} lengths"),
                    _positive_int(table.get("examples", 64), f"{where} examples"), seed)


def _check_exact_term(kind: str, length: Length, task: TaskEval | None, where: str) -> None:
    """An ``exact@N`` / ``exact@A-B`` term in a task sweep, every length of it scored."""
    if task is None:
        raise SpecError(f"{where} needs exact match on a task; add an [eval.task] table "
                        "(lengths, examples) and train the cells with --task NAME")
    if kind != "exact":
        raise SpecError(f"{where}: a task sweep ([eval.task]) scores no held-out text; "
                        "compare exact@N or exact@A-B (exact match, the mean over lengths A-B)")
    lo, hi = task_range(length.text)
    missing = [n for n in range(lo, hi + 1) if n not in task.lengths]
    if missing:
        raise SpecError(f"{where}: task length {missing[0]} is not scored; add it to "
                        f"[eval.task] lengths (now {_ranges(task.lengths)})")


def _ranges(lengths: tuple[int, ...]) -> str:
    """(1, 2, 3, 7) -> "1-3, 7"."""
    out, start = [], lengths[0]
    for prev, n in zip(lengths, (*lengths[1:], None), strict=True):
        if n != prev + 1:
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = n
    return ", ".join(out)


def _check_context_term(kind: str, distance: Length, context: Context | None,
                        where: str) -> None:
    """A ``context:NAME@B`` term names a perturbation and a distance the spec scores."""
    if context is None:
        raise SpecError(f"{where} needs context usage; add an [eval.context] table (window, "
                        "distances, perturbations)")
    name = kind.partition(":")[2]
    if name not in context.perturbations:
        raise SpecError(f"{where}: [eval.context] perturbations ({', '.join(context.perturbations)}"
                        f") do not include {name!r}; add it there")
    if distance.tokens not in context.distances:
        raise SpecError(f"{where}: distance {distance.tokens} is not in [eval.context] distances "
                        f"({list(context.distances)}); add it there")


def read_spec(path: str) -> Spec:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such spec file") from None
    return parse_spec(text, path)

