"""A sweep made concrete before anything trains: each cell's resolved configs and token budget,
the held-out split every cell is scored on (and its overlap with the training text), the
tokenizer, the held-out and training token streams, and the declared comparisons as pairs of
cells. Every error a spec can cause is raised here, before the first run."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from transformers_jax.config import ModelConfig, TrainConfig
from transformers_jax.data.sources import open_documents
from transformers_jax.registry import FAMILIES
from transformers_jax.runs.tokenizer import source_tokenizer, training_tokenizer
from transformers_jax.study.provenance import tokenizer_digest
from transformers_jax.study.splits import Split, make_split, overlap
from transformers_jax.sweep.cells import Cell, Pair, controlled, expand, pairs
from transformers_jax.sweep.context import Sources, Windows, draw_windows
from transformers_jax.sweep.spec import Spec, SpecError
from transformers_jax.train_options import build_configs, follows_tokenizer

READ_CAP = 20_000_000  # training tokens read for the epoch check and the baselines
# (a cell whose budget is larger trains past what its baselines were fitted on: refused)


@dataclasses.dataclass(frozen=True)
class PlannedCell:
    cell: Cell  # its options in full (a child's: its parent's, then its own), in tokens
    model: ModelConfig  # a zero-shot cell: the model its parent's runs are scored as
    train: TrainConfig  # trains on the split's training text; steps and batch set (a
    # zero-shot cell: its parent's, nothing is trained)
    auto_vocab: bool
    parent: PlannedCell | None = None  # the cell whose run of each seed this one starts from

    @property
    def zero_shot(self) -> bool:
        return not self.cell.trains

    @property
    def source(self) -> PlannedCell:
        """The cell whose runs hold this cell's weights: itself, or for a zero-shot cell the
        trained cell it scores."""
        return self.parent.source if self.zero_shot else self

    @property
    def depth(self) -> int:
        """0 for a cell trained from scratch, its parent's + 1 otherwise."""
        return 0 if self.parent is None else self.parent.depth + 1

    @property
    def tokens(self) -> int:
        """Training tokens of one seed's run (its own; 0 for a zero-shot cell)."""
        return 0 if self.zero_shot else self.train.steps * self.train.batch_size * \
            self.train.seq_len

    @property
    def tokens_seen(self) -> int:
        """Training tokens behind one seed's weights: its own and its ancestors'."""
        return self.tokens + (self.parent.tokens_seen if self.parent else 0)

    @property
    def reference_len(self) -> int:
        """What a multiple ("4x") is a multiple of: the training length of the first cell
        of its chain (L0), which for a cell trained from scratch is its own seq_len."""
        return self.parent.reference_len if self.parent else self.train.seq_len

    def lengths(self, spec: Spec) -> list[int]:
        return [x.resolve(self.reference_len) for x in spec.lengths]


@dataclasses.dataclass(frozen=True)
class SweepPlan:
    spec: Spec
    cells: list[PlannedCell]
    pairs: list[Pair]
    split: Split | None  # None: a task sweep, which holds out no text
    overlap: dict
    tokenizer: object
    heldout_N: np.ndarray  # the held-out text as one token stream (documents joined by eos)
    train_N: np.ndarray  # the training text the cells read, likewise (up to READ_CAP)
    train_complete: bool  # whether train_N holds all of it
    context: Windows | None = None  # [eval.context]'s windows, intact and perturbed
    controls: list = dataclasses.field(default_factory=list)  # (Control, [Cell]) pairs

    @property
    def data_sha256(self) -> str:
        """What the cells' data is: the split's digest (a task sweep: the tasks, whose
        examples their configs decide)."""
        return self.split.sha256 if self.split is not None else "synthetic tasks"

    def data_record(self) -> dict:
        if self.split is None:
            tasks = sorted({c.train.task for c in self.cells})
            return {"corpus": f"synthetic task(s) {', '.join(tasks)}", "tasks": tasks,
                    "test": self.spec.task.settings(), "tokenizer": self.tokenizer.name,
                    "tokenizer_sha256": tokenizer_digest(self.tokenizer)}
        return {**self.split.meta(), "overlap": self.overlap,
                "heldout_tokens": int(self.heldout_N.size),
                "training_tokens": int(self.train_N.size),
                "training_tokens_complete": self.train_complete, "tokenizer": self.tokenizer.name,
                "tokenizer_sha256": tokenizer_digest(self.tokenizer)}



MULTIPLE = re.compile(r"^(--[a-z_.]+)=(\d+(?:\.\d+)?)x$")


def _built(cell: Cell, args: list[str]) -> tuple[ModelConfig, TrainConfig]:
    try:
        return build_configs(args)
    except (ValueError, LookupError) as err:  # ConfigError, UnknownNameError
        raise SpecError(f"cell {cell.name}: {err}") from None


def in_tokens(cell: Cell, reference_len: int | None = None) -> Cell:
    """The cell with each option given as a multiple of a training length (``--model.
    position.max_distance=2x``: a setting that should follow ``train.seq_len`` across an axis
    of lengths) turned into tokens: of its own seq_len, or for a cell with a parent of
    ``reference_len`` (L0, where ``--train.seq_len=4x`` is allowed too)."""
    relative = [MULTIPLE.match(a) for a in cell.args]
    if not any(relative):
        return cell
    seq_len = reference_len
    if seq_len is None:
        _, cfg = _built(cell, [a for a, m in zip(cell.args, relative, strict=True) if not m])
        seq_len = cfg.seq_len
    args = []
    for arg, match in zip(cell.args, relative, strict=True):
        if match:
            tokens = float(match.group(2)) * seq_len
            if match.group(1) == "--train.seq_len" and reference_len is None:
                raise SpecError(f"cell {cell.name}: {arg} is a multiple of its own seq_len; a "
                                "training length given as a multiple (of L0) is for a cell "
                                "that starts from another (from = ...)")
            if match.group(1) == "--train.batch_size" or tokens != int(tokens):
                raise SpecError(f"cell {cell.name}: {arg} is {tokens} tokens at seq_len "
                                f"{seq_len}; give a whole number of tokens")
            arg = f"{match.group(1)}={int(tokens)}"
        args.append(arg)
    return dataclasses.replace(cell, args=tuple(args))


def resolve_cell(spec: Spec, cell: Cell, parent: PlannedCell | None = None) -> PlannedCell:
    """The cell's configs, as ``tjax train`` with its options would build them, with options
    given as multiples of seq_len turned into tokens and the spec's budget (``tokens``,
    ``tokens_per_step``) applied. A cell with a parent (``parent``, resolved first) has its
    parent's options, then its own; a zero-shot one its parent's training config."""
    if (cell.parent is None) != (parent is None):
        raise ValueError(f"cell {cell.name}: resolve its parent {cell.parent!r} first")
    if parent is not None:
        cell = in_tokens(cell, parent.reference_len)
        cell = dataclasses.replace(cell, args=(*parent.cell.args, *cell.args))
    else:
        cell = in_tokens(cell)
    model, cfg = _built(cell, list(cell.args))
    where = f"cell {cell.name}"
    family = FAMILIES.get(model.family)
    if spec.task is not None:
        _check_task_cell(spec, cell, model, cfg)
    elif cfg.task:
        raise SpecError(f"{where}: trains on --task {cfg.task}; a sweep without [eval.task] "
                        "scores held-out text: add an [eval.task] table (lengths, examples) to "
                        "score exact match by task length")
    if spec.task is None and (family.objective != "lm" or cfg.objective is not None
                              or not model.mask.decodes):
        raise SpecError(f"{where}: family={model.family} mask={model.mask.name} does not "
                        "predict each next token from the ones before it, which the sweep's "
                        "held-out losses (loss@L) score; sweep a causal LM (family gpt or "
                        "lstm with a causal mask)")
    if not cell.trains:  # scored as its parent's runs: nothing of training applies
        return PlannedCell(cell, model, parent.train, parent.auto_vocab, parent)
    batch = cfg.batch_size
    if spec.tokens_per_step is not None:
        batch, rest = divmod(spec.tokens_per_step, cfg.seq_len)
        if rest or batch == 0:
            raise SpecError(f"{where}: [base] tokens_per_step = {spec.tokens_per_step} is not a "
                            f"multiple of seq_len {cfg.seq_len}; choose one every seq_len "
                            "divides")
    steps = cfg.steps
    budget = cell.tokens if cell.tokens is not None or parent else spec.tokens
    if budget is not None:
        steps = math.ceil(budget / (batch * cfg.seq_len))
    try:
        cfg = cfg.replace(batch_size=batch, steps=steps, progress=False, json=False,
                          init_from=None)  # a child's: its parent's run of each seed
    except ValueError as err:
        raise SpecError(f"{where}: {err}") from None
    return PlannedCell(cell, model, cfg, follows_tokenizer(model), parent)


def _check_task_cell(spec: Spec, cell: Cell, model: ModelConfig, cfg: TrainConfig) -> None:
    """A cell of a task sweep trains a decoder on a task, and its positions reach every row
    of the longest test length."""
    from transformers_jax.data.synthetic import get_task
    from transformers_jax.sweep.tasks import row_tokens

    where = f"cell {cell.name}"
    if not cfg.task:
        raise SpecError(f"{where}: [eval.task] scores runs trained on a synthetic task; give "
                        "--task NAME in [base] args (or a train.task axis)")
    # exact match reads the argmax of each answer token given the ones before it: a family
    # with a task format (decoder rows, or encoder prompt and decoder answer) and a mask that
    # keeps the answer causal (causal, or prefix-LM: the prompt seen both ways)
    if FAMILIES.get(model.family).tasks is None or cfg.objective is not None:
        raise SpecError(f"{where}: family={model.family} has no task format (rows of prompt "
                        "and answer); a task sweep trains decoders (family gpt) or "
                        "encoder-decoders (family encdec)")
    if not model.mask.decodes:
        raise SpecError(f"{where}: mask={model.mask.name} lets a position see the answer "
                        "tokens after it, so exact match would read them; use mask causal or "
                        "prefix (a bidirectional prompt, a causal answer)")
    longest = max(spec.task.lengths)
    cap = get_task(cfg.task).max_length
    if cap is not None and longest > cap:
        raise SpecError(f"{where}: task {cfg.task} has lengths up to {cap}, and [eval.task] "
                        f"lengths reach {longest}; score shorter lengths")
    need = row_tokens(cfg.task, model.family, longest)
    limit = model.position.max_length(model)
    if limit is not None and limit < need:
        raise SpecError(f"{where}: position={model.position.name} encodes {limit} positions, "
                        f"and task length {longest} needs rows of {need} tokens; raise "
                        f"--model.max_len to {need} (a learned table's rows past training stay "
                        "untrained, which is what is measured) or score shorter lengths")


def resolve_cells(spec: Spec) -> list[PlannedCell]:
    """Every cell resolved, parents before children (``expand``'s order)."""
    planned: dict[str, PlannedCell] = {}
    for cell in expand(spec):
        planned[cell.name] = resolve_cell(spec, cell, planned.get(cell.parent or ""))
    return list(planned.values())


def _with_data(cells: list[PlannedCell], data: str) -> list[PlannedCell]:
    """The cells training on ``data``, each linked to its parent's new version."""
    done: dict[str, PlannedCell] = {}
    for c in cells:
        parent = done[c.parent.cell.name] if c.parent else None
        train = parent.train if c.zero_shot else c.train.replace(data=data)
        done[c.cell.name] = dataclasses.replace(c, train=train, parent=parent)
    return list(done.values())


def token_stream(tokenizer, texts, max_tokens: int | None = None) -> np.ndarray:
    """Texts (bytes or str) encoded and joined by eos as one stream, at most ``max_tokens``."""
    parts, total = [], 0
    eos = np.array([tokenizer.eos_id], np.int32)
    for text in texts:
        ids = np.asarray(tokenizer.encode(text.decode("utf-8", errors="replace")
                                          if isinstance(text, bytes) else text), np.int32)
        parts += [ids, eos]
        total += ids.size + 1
        if max_tokens is not None and total >= max_tokens:
            break
    out = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return out if max_tokens is None else out[:max_tokens]


def _same(cells: list[PlannedCell], fields: tuple[str, ...], what: str) -> None:
    first = cells[0]
    for c in cells[1:]:
        for name in fields:
            if getattr(c.train, name) != getattr(first.train, name):
                raise SpecError(
                    f"cells {first.cell.name} and {c.cell.name} differ in train.{name} "
                    f"({getattr(first.train, name)!r} vs {getattr(c.train, name)!r}); every "
                    f"cell is scored on one held-out text, so they must share {what}")


def _check_passkey(spec: Spec, cells: list[PlannedCell], tokenizer) -> None:
    """Every cell can decode, and every length holds a passkey prompt and its answer."""
    from transformers_jax.evaluation import passkey_prompt

    digits = spec.passkey["digits"]
    answer = len(tokenizer.encode(" " + "9" * digits)) + 2
    for c in cells:
        if not FAMILIES.get(c.model.family).generates:
            raise SpecError(f"cell {c.cell.name}: family {c.model.family} does not generate; "
                            "drop [eval] passkey")
        for length in (x.resolve(c.reference_len) for x in spec.passkey["lengths"]):
            try:
                passkey_prompt(tokenizer, "9" * digits, length - answer, 0.0)
            except ValueError:
                raise SpecError(
                    f"cell {c.cell.name}: a passkey prompt needs more than {length} tokens "
                    f"with the {tokenizer.name} tokenizer (key sentence, question and "
                    f"{digits}-digit answer); give [eval] passkey lengths that are longer"
                ) from None


def make_plan(spec: Spec, data_root: str) -> SweepPlan:
    """``data_root``: where the split's training text is written (the sweep's own folder, so
    its runs can resume after the machine's temporary files are gone)."""
    cells = resolve_cells(spec)
    if spec.task is not None:
        return _task_plan(spec, cells)
    _same(cells, ("data", "data_dir", "text_key"), "their data")
    _same(cells, ("tokenizer", "tokenizer_vocab"), "their tokenizer")
    compared = pairs(spec, [c.cell for c in cells])
    controls = controlled(spec, [c.cell for c in cells])
    first = cells[0].train
    split = make_split(first.data, seed=spec.heldout_seed, heldout_bytes=spec.heldout_bytes,
                       root=data_root)
    cells = _with_data(cells, split.train_data)
    train_cfg = cells[0].train
    tokenizer = source_tokenizer(train_cfg) or training_tokenizer(train_cfg.replace(
        run_dir=None))
    docs = open_documents(train_cfg.data, "train", val_fraction=train_cfg.val_fraction,
                          data_dir=train_cfg.data_dir, text_key=train_cfg.text_key)
    # All of the training text, up to READ_CAP tokens (a catalog dataset may be far larger)
    # or as far as the largest budget needs: enough to tell one epoch from more.
    needed = math.ceil(max(c.tokens_seen for c in cells) / spec.max_epochs) + 1
    train_texts: list[bytes] = []  # those read, for the overlap

    def read():
        for i in range(len(docs)):
            train_texts.append(docs[i].text)
            yield train_texts[-1]

    train_N = token_stream(tokenizer, read(), max(needed, READ_CAP))
    heldout_N = token_stream(tokenizer, split.heldout, spec.eval_max_tokens)
    over = [c for c in cells if c.tokens_seen > spec.max_epochs * train_N.size]
    if over:
        worst = max(over, key=lambda c: c.tokens_seen)
        parents = " with its parents'" if worst.parent else ""
        raise SpecError(
            f"cell {worst.cell.name} trains on {worst.tokens_seen:,} tokens{parents}, "
            f"{worst.tokens_seen / train_N.size:.2f} epochs of the {train_N.size:,} training "
            "tokens "
            f"({len(over)} cell(s) above [base] max_epochs = {spec.max_epochs:g}): a model that "
            "sees its text twice scores memorisation; lower the budget, use more data, or "
            "raise max_epochs knowingly")
    if spec.passkey:
        _check_passkey(spec, cells, tokenizer)
    longest = max(max(c.lengths(spec)) for c in cells)
    if heldout_N.size < longest + 1 + spec.chunk_tokens:
        raise SpecError(f"the held-out stream has {heldout_N.size:,} tokens, too few for "
                        f"windows of {longest} and chunks of {spec.chunk_tokens}; raise "
                        "[heldout] bytes")
    complete = len(train_texts) == len(docs) and train_N.size < max(needed, READ_CAP)
    context = _context_windows(spec, cells, tokenizer, train_N, heldout_N) if spec.context \
        else None
    return SweepPlan(spec, cells, compared, split, overlap(train_texts, split.heldout),
                     tokenizer, heldout_N, train_N, complete, context, controls)


def _task_plan(spec: Spec, cells: list[PlannedCell]) -> SweepPlan:
    """A task sweep's plan: no held-out text, no training text read; the cells' tokenizer
    (one for all, so that a task's test examples are the same tokens in every cell)."""
    _same(cells, ("tokenizer", "tokenizer_vocab"), "their tokenizer")
    compared = pairs(spec, [c.cell for c in cells])
    tokenizer = training_tokenizer(cells[0].train.replace(run_dir=None))
    empty = np.zeros(0, np.int32)
    return SweepPlan(spec, cells, compared, None, {}, tokenizer, empty, empty, True,
                     controls=controlled(spec, [c.cell for c in cells]))


def _context_windows(spec: Spec, cells: list[PlannedCell], tokenizer, train_N: np.ndarray,
                     heldout_N: np.ndarray) -> Windows:
    """The windows every cell and seed scores for context usage: one length for all cells
    (so that they pair window by window), drawn by ``[eval.context] seed``; replacements
    from the training tokens' unigram distribution and from other held-out documents."""
    ctx = spec.context
    by_cell = {c.cell.name: ctx.window.resolve(c.reference_len) for c in cells}
    if len(set(by_cell.values())) > 1:
        raise SpecError(f"[eval.context] window = {ctx.window.text!r} is {by_cell} tokens in "
                        "these cells; every cell must score the same windows to be compared: "
                        "give the window in tokens")
    window = next(iter(by_cell.values()))
    ctx.check(window, "[eval.context]")
    try:
        sources = Sources.of(train_N, heldout_N, tokenizer.eos_id, tokenizer.vocab_size)
        return draw_windows(sources, window, ctx.target, ctx.distances, ctx.perturbations,
                            ctx.windows, ctx.seed, ctx.span)
    except ValueError as err:
        raise SpecError(f"[eval.context]: {err}; raise [heldout] bytes or lower windows") \
            from None
