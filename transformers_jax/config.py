"""Frozen configuration dataclasses: one ``ModelConfig`` drives a model, one ``TrainConfig`` a run.

Every switch (attention implementation, mask, position, norm and where it sits, MLP) holds a
registered entry with its settings; family and tokenizer are registry names. Validation happens
at construction and errors name the field, the bad value and the fix.

Building and checking a ``ModelConfig`` or a ``TrainConfig`` imports no JAX: the switches
resolve to registry entries whose modules (``builtins.py`` lists them) hold their settings,
checks and hooks, and a hook imports the maths it calls when the model is built.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import types
import typing
import warnings
from dataclasses import dataclass
from typing import Any

from transformers_jax.presets import get_preset
from transformers_jax.registry import (
    ATTENTION,
    FAMILIES,
    MASKS,
    MLPS,
    NORM_PLACEMENTS,
    NORMS,
    POSITIONS,
    ROPE_SCALINGS,
    TOKENIZERS,
    ConfigError,
    Registry,
    Switch,
    check_field_types,
    check_known_fields,
    resolve_switch_fields,
    switch_field,
)

DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "full", "nothing_saveable", "dots_saveable",
                  "dots_with_no_batch_dims_saveable", "everything_saveable",
                  "save_attention_out", "save_qkv_proj")
STRATEGIES = ("single", "pmap", "shard_map", "jit")
# attention across sequence shards (parallel/context.py); ring_zigzag: the ring with each
# device holding chunks i and 2c-1-i of the queries, so causal work is even
CONTEXT_ATTENTION = ("all_gather", "ring", "ring_zigzag")
# Packed text rows shuffled within windows of this many by default: packing cuts a document
# into consecutive rows, so unshuffled batches are mostly one document's neighbouring windows
# (measured 2026-12-03 by the length-extrapolation script on the built-in corpus, since
# replaced by experiments/specs/length_extrapolation_cpu.toml: NoPE at L=128 2.25 -> 1.757
# nats held-out, RoPE 1.309 -> 1.205). The buffer holds SHUFFLE_ROWS x seq_len tokens per host.
SHUFFLE_ROWS = 4096


def _fail(field_name: str, value: Any, why: str) -> None:
    raise ConfigError(f"{field_name}={value!r}: {why}")


def _check_choice(field_name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(field_name, value, f"valid choices: {', '.join(choices)}")


@dataclass(frozen=True)
class ModelConfig:
    """Everything that defines a model's architecture and numerics."""

    family: str = "gpt"  # what is trained: causal LM, masked LM, encoder-decoder, ...
    vocab_size: int = 262  # the byte tokenizer's 256 bytes + 6 special tokens
    d_model: int = 128  # width of the residual stream
    n_layers: int = 4  # transformer blocks (encdec: encoder blocks)
    n_heads: int = 4  # query heads per attention layer
    n_kv_heads: int | None = None  # None: same as n_heads (MHA); 1: MQA; else GQA
    head_dim: int | None = None  # None: d_model // n_heads
    d_ff: int | None = None  # None: 4 * d_model (gelu) or 8/3 * d_model rounded to 8 (swiglu)
    max_len: int = 256  # rows of the learned position table (other schemes have no limit)
    type_vocab_size: int = 2  # bert: token-type (segment A/B) embeddings; 0 for none
    n_decoder_layers: int | None = None  # encdec: decoder depth (None: same as n_layers)

    # The switches. Each holds a registered object carrying its own settings and hooks (see
    # registry.py): given as a name ("alibi"), a JSON dict ({"name": "t5", "num_buckets": 16})
    # or an instance; stored as the instance.
    attention: Switch = switch_field(ATTENTION, "xla")  # how scores are computed (nn/attention/)
    mask: Switch = switch_field(MASKS, "causal")  # who attends to whom (nn/mask_kinds.py)
    position: Switch = switch_field(POSITIONS, "rope")  # positional scheme (nn/positions/)
    norm: Switch = switch_field(NORMS, "layernorm")  # the norm layer and its eps (nn/norms.py)
    norm_position: Switch = switch_field(NORM_PLACEMENTS, "pre")  # norms before/after branches
    mlp: Switch = switch_field(MLPS, "gelu")  # MLP activation, gated or not (nn/activations.py)

    # Block options.
    use_bias: bool = True  # biases in dense layers and norms (GPT-2 yes, Llama no)
    tie_embeddings: bool = True  # the output layer reuses the token embedding table
    dropout: float = 0.0  # on embeddings and residual branches
    qk_norm: bool = False  # RMS-normalise queries and keys per head before the dot product
    attn_logit_softcap: float | None = None  # cap * tanh(x / cap) on attention logits
    final_logit_softcap: float | None = None  # same on output logits
    attention_scale: float | None = None  # None: 1/sqrt(head_dim); T5 uses 1.0
    init_std: float = 0.02  # standard deviation of the normal initialisers
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"  # storage dtype of parameters
    remat: str = "none"  # recompute each layer in the backward pass: a REMAT_POLICIES name
    scan_layers: bool = False  # one nn.scan over the layers; params stacked under "layers"

    def __post_init__(self) -> None:
        resolve_switch_fields(self)
        check_field_types(self)
        check_family(self.family)
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_len"):
            if getattr(self, name) <= 0:
                _fail(name, getattr(self, name), "must be a positive integer")
        if self.head_dim is None and self.d_model % self.n_heads:
            _fail(
                "n_heads",
                self.n_heads,
                f"must divide d_model={self.d_model} (or set head_dim explicitly); "
                f"try n_heads in {[h for h in range(1, 17) if self.d_model % h == 0]}",
            )
        if self.head_dim is not None and self.head_dim <= 0:
            _fail("head_dim", self.head_dim, "must be positive")
        kv = self.kv_heads
        if kv <= 0 or self.n_heads % kv:
            _fail(
                "n_kv_heads",
                self.n_kv_heads,
                f"must divide n_heads={self.n_heads} (n_heads for MHA, 1 for MQA, "
                "a divisor for GQA)",
            )
        if self.type_vocab_size < 0:
            _fail("type_vocab_size", self.type_vocab_size, "must be >= 0 (0: no token types)")
        if self.n_decoder_layers is not None and self.n_decoder_layers <= 0:
            _fail("n_decoder_layers", self.n_decoder_layers, "must be positive or None")
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("param_dtype", self.param_dtype, DTYPES)
        _check_choice("remat", self.remat, REMAT_POLICIES)
        if not 0.0 <= self.dropout < 1.0:
            _fail("dropout", self.dropout, "must be in [0, 1)")
        for name in ("attn_logit_softcap", "final_logit_softcap", "attention_scale"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                _fail(name, value, "must be positive or None")
        if self.init_std < 0:
            _fail("init_std", self.init_std, "must be >= 0 (e.g. 0.02)")
        # Each switch refuses what it cannot serve (soft-cap without support, odd rotary
        # widths, a window missing, a norm's eps, a family whose decoder would see its
        # targets, ...).
        for switch in (self.attention, self.mask, self.position, self.norm, self.norm_position,
                       self.mlp):
            switch.check(self)
        FAMILIES.get(self.family).check(self)

    # Derived sizes ---------------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def dims_per_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def ff_dim(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp.gated:  # gated: keep the parameter count of a 4x MLP
            return 8 * ((8 * self.d_model // 3 + 7) // 8)
        return 4 * self.d_model

    @property
    def decoder_layers(self) -> int:
        """Decoder depth of an encoder-decoder: ``n_decoder_layers``, else ``n_layers``."""
        return self.n_layers if self.n_decoder_layers is None else self.n_decoder_layers

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named model (``presets.py``; ``tjax presets`` lists them), with ``overrides``
        replacing fields: ``ModelConfig.preset("gpt2", position="alibi")``."""
        return cls(**{**get_preset(name).model, **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        return from_dict(cls, data)

    @staticmethod
    def migrate(data: dict[str, Any]) -> dict[str, Any]:
        """Read a config saved before the switches carried their settings (flat ``rope``,
        ``window``, ``t5_*``, ``fire_hidden``, ``attention_chunk`` fields): those fields move
        into the switch they belong to; only fields of the switch in use are kept, as the
        model built from the old config never read the others. ``norm_eps`` becomes the
        norm's ``eps`` (every norm has one; given beside a norm dict, as a JSON config merged
        over a saved one may, it wins). Names saved for ``norm``, ``norm_position`` and
        ``mlp`` before they were switches read as those entries with their defaults. A saved
        sinusoidal position without ``form`` predates the original-transformer form and reads
        as ``form="rms"``."""
        data = dict(data)
        if "norm_eps" in data:
            eps, norm = data.pop("norm_eps"), data.get("norm", _DEFAULT_SWITCHES["norm"])
            norm = norm.to_dict() if isinstance(norm, Switch) else norm
            norm = {"name": norm} if isinstance(norm, str) else norm
            if isinstance(norm, dict):  # else the norm's own error names it
                data["norm"] = {**norm, "eps": eps}
        if data.get("position") == {"name": "sinusoidal"}:
            # saved before sinusoidal had a form (every saved switch lists all its fields):
            # that model added the table at the embeddings' init RMS, without token scaling
            data["position"] = {"name": "sinusoidal", "form": "rms"}
        legacy = {k: data.pop(k) for k in ("rope", "window", "t5_num_buckets", "t5_max_distance",
                                          "fire_hidden", "attention_chunk") if k in data}
        if not legacy:
            return data
        moves = {
            ("position", "rope"): {"rope": None},
            ("position", "t5"): {"t5_num_buckets": "num_buckets",
                                 "t5_max_distance": "max_distance"},
            ("position", "fire"): {"fire_hidden": "hidden"},
            ("mask", "sliding_window"): {"window": "window"},
            ("attention", "chunked"): {"attention_chunk": "chunk_size"},
        }
        for (field_name, entry), fields in moves.items():
            if data.get(field_name, _DEFAULT_SWITCHES[field_name]) != entry:
                continue
            switch: dict[str, Any] = {"name": entry}
            for old, new in fields.items():
                if old == "rope" and isinstance(legacy.get("rope"), dict):
                    rope = dict(legacy["rope"])
                    scaling = {"name": rope.pop("scaling", "none")}
                    kept = {f.name for f in dataclasses.fields(ROPE_SCALINGS.get(scaling["name"]))
                            if f.init}
                    for key in ("factor", "original_max_len", "low_freq_factor",
                                "high_freq_factor", "beta_fast", "beta_slow"):
                        if key in rope and key in kept:
                            scaling[key] = rope[key]
                        rope.pop(key, None)
                    switch.update(rope, scaling=scaling)
                elif old in legacy and legacy[old] is not None:
                    switch[new] = legacy[old]
            data[field_name] = switch
        return data


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (``learning/lora.py``): each targeted projection's kernel ``W`` trains as
    ``W + (alpha / rank) * A @ B`` with ``W`` frozen; only ``A`` and ``B`` are trained and saved.

    ``alpha`` defaults to ``rank`` (a scale of 1): a change of rank then leaves the size of an
    update step where it was, so a learning rate found at one rank carries to another (peft's
    default for its rank 8 is the same). ``targets`` are the names of projections as the
    parameter tree holds them (``query``, ``key``, ``value``, ``out``, ``up``, ``gate``,
    ``down``), a module holding some (``attention``, ``mlp``), or a glob over the path
    (``layer_0/attention/*``)."""

    rank: int | None = None  # adapter rank R; None: no LoRA (the whole model trains)
    alpha: float | None = None  # the update is scaled by alpha / rank; None: alpha = rank
    targets: tuple[str, ...] = ("query", "key", "value", "out")  # projections given adapters

    def __post_init__(self) -> None:
        check_field_types(self, "train.lora.")
        object.__setattr__(self, "targets", tuple(self.targets))  # JSON gives a list
        if self.rank is None:
            if self.alpha is not None:
                _fail("train.lora.alpha", self.alpha, "needs train.lora.rank (LoRA is off "
                      "without a rank): add --train.lora.rank=R, e.g. 8")
            return
        if self.rank <= 0:
            _fail("train.lora.rank", self.rank, "must be a positive integer (e.g. 8), or unset "
                  "for full fine-tuning")
        if self.alpha is not None and self.alpha <= 0:
            _fail("train.lora.alpha", self.alpha, "must be positive (or unset: alpha = rank)")
        if not self.targets or not all(isinstance(t, str) and t.strip() for t in self.targets):
            _fail("train.lora.targets", self.targets, "must name at least one projection, e.g. "
                  "query,key,value,out (or attention,mlp)")

    @property
    def enabled(self) -> bool:
        return self.rank is not None

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor of the adapters' product."""
        return (self.rank if self.alpha is None else self.alpha) / self.rank


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and run settings for ``tjax train``."""

    steps: int = 600  # optimizer updates in the run
    batch_size: int = 16  # sequences per step, over all devices and micro-batches
    seq_len: int = 128  # tokens per training sequence
    learning_rate: float = 2e-3  # peak of the warmup-cosine schedule (AdamW)
    min_lr_ratio: float = 0.1  # cosine decays to learning_rate * min_lr_ratio
    warmup_steps: int | None = None  # None: 10% of the schedule's steps
    # The schedule belongs to the run: a resume with more --steps keeps the checkpoint's, and
    # the steps past its end run at its floor (train/setup.py, plan_segment).
    schedule_steps: int | None = None  # steps of warm-up + cosine, then the floor (None: steps)
    weight_decay: float = 0.1  # AdamW's decoupled decay (not on norms and biases)
    b1: float = 0.9  # Adam's first-moment decay
    b2: float = 0.95  # Adam's second-moment decay
    grad_clip: float = 1.0  # largest global gradient norm kept
    seed: int = 0  # parameters, data order, dropout
    data: str | None = None  # PATH, lines:PATH, tfds:NAME, hf:NAME, 0.7*A,0.3*B; None: default
    data_dir: str | None = None  # tfds data_dir (catalog datasets, prepared local text)
    text_key: str | None = None  # text field/column (auto-detected; alias --data.field)
    data_download: bool = False  # hf:NAME: download the split instead of streaming it
    label_key: str = "label"  # labelled data (JSONL/CSV): the label column
    # how text becomes ids: trained on the data (unless byte), or hf:PATH, a Hugging Face
    # tokenizer.json or a model folder holding one, used as it is
    tokenizer: str = "byte"  # byte, char, sentencepiece(_bpe), or hf:PATH (a tokenizer.json)
    tokenizer_vocab: int | None = None  # vocabulary size of a trained tokenizer
    pack: str = "concat"  # concat, first_fit, none
    bos_per_row: bool = False  # every row (window) starts with bos, not only each document
    # None resolves to SHUFFLE_ROWS for text, 0 for a task (its examples are independent)
    shuffle_rows: int | None = None  # packed rows shuffled in windows of N (none: 4096; 0 off)
    task: str | None = None  # a synthetic task instead of text (copy, reverse, addition, ...)
    train_lengths: tuple[int, int] = (1, 20)  # task lengths seen in training
    test_lengths: tuple[int, int] = (21, 80)  # task lengths for the extrapolation test
    val_fraction: float = 0.05  # share of the text held out for evaluation
    eval_every: int = 200  # steps between held-out evaluations
    eval_batches: int = 8  # batches per held-out evaluation
    log_every: int = 50  # steps between logged training metrics
    run_dir: str | None = None  # metrics.jsonl and checkpoints; None saves nothing
    tensorboard: bool = True  # event files in RUN_DIR/tensorboard (with a run_dir only)
    wandb_project: str | None = None  # also log to Weights & Biases (pip install wandb)
    checkpoint_every: int = 200  # steps between checkpoints (with a run_dir)
    keep_checkpoints: int = 3  # newest checkpoints kept; older ones are deleted
    resume: bool = True  # continue from the latest checkpoint in run_dir, if there is one
    init_from: str | None = None  # fine-tune: start from this run's params (fresh optimizer)
    # What is trained (learning/objectives.py): None, the family's own (gpt lm, bert mlm, ...);
    # sequence_classification, a classifier on the encoder, on labelled --data (JSONL/CSV).
    objective: str | None = None  # None: the family's; sequence_classification: labelled data
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)  # adapters (docs/lora.md)
    # Reliability (see train/guard.py, train/lanes.py): bad updates skipped before the run stops,
    # and whether a resume may read other data or another tokenizer than the checkpoint's.
    skip_nonfinite_steps: int = 0  # updates with a non-finite loss/grad skipped; then stop
    accept_data_change: bool = False  # resume onto changed data/tokenizer with a warning
    # Masked LM (family bert): share of tokens predicted, and how their inputs are corrupted.
    mlm_rate: float = 0.15  # bert: share of tokens predicted
    mlm_mask_fraction: float = 0.8  # of the chosen: [MASK]
    mlm_random_fraction: float = 0.1  # of the chosen: a random token (the rest: unchanged)
    # Scaling out (see parallel/): strategy, device mesh, micro-batches, multi-host.
    strategy: str = "single"  # single, pmap, shard_map, jit
    mesh: str | None = None  # e.g. "data=4,fsdp=2,tensor=1"; default: all devices on data
    grad_accum: int = 1  # micro-batches per step (the batch is split, the update is the same)
    # with a context mesh axis (--train.mesh=data=2,context=4, strategy jit): how attention
    # crosses the sequence shards (docs/scaling.md)
    context_attention: str = "all_gather"  # all_gather (of keys/values), ring or ring_zigzag
    # The CPU backend's (backends/cpu.py): small models trained 1.06-1.11x faster on 2 cores;
    # meshes of other devices refuse more than 1
    concurrent_groups: int = 1  # row groups per (micro-)batch computed side by side on a CPU
    coordinator: str | None = None  # HOST:PORT of process 0 for multi-host runs
    num_processes: int | None = None  # processes of a multi-host run (with coordinator)
    process_id: int | None = None  # this process's index, 0 .. num_processes-1
    # A jax.profiler trace of steps START..START+STEPS-1 (from 0; step 0 compiles) into
    # RUN_DIR/profile, or a temporary folder without a run_dir (train/profile.py)
    profile: str | None = None  # START:STEPS, e.g. 10:3; None: no trace
    json: bool = False  # print the final metrics as one JSON object
    progress: bool = True  # tqdm progress bar

    def _check_tokenizer(self) -> None:
        """``train.tokenizer``: a kind that can be built here, and ``KIND:PATH`` for the kinds
        read from a file (``hf:PATH``), with no ``tokenizer_vocab`` (the file has its own)."""
        kind, colon, path = self.tokenizer.partition(":")
        entry = TOKENIZERS.select(kind, "train.tokenizer")  # only kinds that can be built
        reads_file = getattr(entry, "from_path", None) is not None
        if reads_file and not path.strip():
            _fail("train.tokenizer", self.tokenizer,
                  f"needs a path: {kind}:PATH, a tokenizer.json or a Hugging Face model folder "
                  "holding one")
        if colon and not reads_file:
            _fail("train.tokenizer", self.tokenizer,
                  f"a {kind!r} tokenizer is trained on the data and takes no path; give "
                  f"{kind}, or hf:PATH for a Hugging Face tokenizer.json")
        if reads_file and self.tokenizer_vocab is not None:
            _fail("train.tokenizer_vocab", self.tokenizer_vocab,
                  f"a {kind}:PATH tokenizer has its own vocabulary; drop train.tokenizer_vocab")

    def __post_init__(self) -> None:
        check_field_types(self, "train.")
        for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches", "log_every",
                     "checkpoint_every", "keep_checkpoints"):
            if getattr(self, name) <= 0:
                _fail(f"train.{name}", getattr(self, name), "must be a positive integer")
        if self.skip_nonfinite_steps < 0:
            _fail("train.skip_nonfinite_steps", self.skip_nonfinite_steps,
                  "must be >= 0 (0: stop at the first non-finite step)")
        if self.learning_rate <= 0:
            _fail("train.learning_rate", self.learning_rate, "must be positive")
        if self.schedule_steps is not None and self.schedule_steps <= 0:
            _fail("train.schedule_steps", self.schedule_steps,
                  "must be a positive integer (or unset: the schedule spans train.steps)")
        if self.warmup_steps is not None and not 0 <= self.warmup_steps < self.schedule_total:
            _fail("train.warmup_steps", self.warmup_steps,
                  f"must be in [0, {self.schedule_total}): below the schedule's steps")
        for name in ("b1", "b2"):  # Adam's moment decays; 1 or more never forgets (or grows)
            if not 0.0 <= getattr(self, name) < 1.0:
                _fail(f"train.{name}", getattr(self, name), "must be in [0, 1)")
        if self.weight_decay < 0:
            _fail("train.weight_decay", self.weight_decay, "must be >= 0")
        if self.grad_clip <= 0:
            _fail("train.grad_clip", self.grad_clip,
                  "must be positive (the largest global gradient norm kept)")
        if not 0.0 < self.val_fraction < 1.0:
            _fail("train.val_fraction", self.val_fraction, "must be in (0, 1)")
        self._check_tokenizer()
        _check_choice("train.pack", self.pack, ("concat", "first_fit", "none"))
        if self.shuffle_rows is None:  # resolved here, so saved configs hold the number
            object.__setattr__(self, "shuffle_rows", 0 if self.task else SHUFFLE_ROWS)
        if self.shuffle_rows < 0:
            _fail("train.shuffle_rows", self.shuffle_rows,
                  "must be >= 0 (rows per shuffle window; 0 turns it off)")
        if self.shuffle_rows and self.task:
            _fail("train.shuffle_rows", self.shuffle_rows,
                  f"applies to text: the synthetic task {self.task!r} draws its examples "
                  "independently already; drop --train.shuffle_rows")
        if self.bos_per_row and self.task:
            _fail("train.bos_per_row", self.bos_per_row,
                  f"applies to text: the synthetic task {self.task!r} lays out its own rows; "
                  "drop --train.bos_per_row")
        _check_choice("train.strategy", self.strategy, STRATEGIES)
        _check_choice("train.context_attention", self.context_attention, CONTEXT_ATTENTION)
        if not 0 < self.mlm_rate <= 1 or not 0 <= self.mlm_mask_fraction <= 1 or not (
            0 <= self.mlm_random_fraction <= 1 - self.mlm_mask_fraction + 1e-9
        ):
            _fail("train.mlm_rate", (self.mlm_rate, self.mlm_mask_fraction,
                                     self.mlm_random_fraction),
                  "need 0 < mlm_rate <= 1 and mlm_mask_fraction + mlm_random_fraction <= 1")
        if self.grad_accum < 1 or self.batch_size % self.grad_accum:
            _fail("train.grad_accum", self.grad_accum,
                  f"must be >= 1 and divide train.batch_size={self.batch_size}")
        if self.concurrent_groups < 1 or self.batch_size % (self.grad_accum
                                                            * self.concurrent_groups):
            _fail("train.concurrent_groups", self.concurrent_groups,
                  f"must be >= 1, and grad_accum x concurrent_groups must divide "
                  f"train.batch_size={self.batch_size}")
        if self.mesh is not None and self.strategy == "single":
            _fail("train.mesh", self.mesh, "needs train.strategy=pmap, shard_map or jit")
        multihost = (self.coordinator, self.num_processes, self.process_id)
        if any(x is not None for x in multihost) and any(x is None for x in multihost):
            _fail("train.coordinator", self.coordinator, "multi-host needs all of "
                  "train.coordinator, train.num_processes and train.process_id (or none of "
                  "them: TPU VMs and GPU clusters are detected automatically)")
        for name in ("train_lengths", "test_lengths"):
            lo_hi = tuple(getattr(self, name))
            if len(lo_hi) != 2 or not 1 <= lo_hi[0] <= lo_hi[1]:
                _fail(f"train.{name}", lo_hi, "must be 'low,high' with 1 <= low <= high")
            object.__setattr__(self, name, lo_hi)  # JSON gives lists
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            _fail("train.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        if self.profile is not None:
            check_profile(self.profile, self.steps)
        if isinstance(self.lora, dict):  # from JSON
            object.__setattr__(self, "lora", from_dict(LoraConfig, self.lora, "train.lora."))

    @property
    def schedule_total(self) -> int:
        """The steps the learning-rate schedule spans; later steps stay at its floor."""
        return self.steps if self.schedule_steps is None else self.schedule_steps

    @property
    def warmup(self) -> int:
        return self.schedule_total // 10 if self.warmup_steps is None else self.warmup_steps

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes``; a change of ``task`` re-resolves ``shuffle_rows`` (which
        follows the data kind) unless that is given too."""
        if "task" in changes and changes["task"] != self.task:
            changes.setdefault("shuffle_rows", None)
        return dataclasses.replace(self, **changes)


def check_profile(spec: str, steps: int) -> None:
    """``train.profile`` is ``START:STEPS``: integers, START >= 0 and before the run's last
    step, STEPS >= 1."""
    try:
        start, count = (int(part) for part in spec.split(":"))
    except ValueError:  # not two parts, or not integers
        start = count = None
    if start is None or count is None:
        _fail("train.profile", spec, "must be START:STEPS, two integers (e.g. 10:3: trace "
              "steps 10, 11 and 12, counted from 0)")
    if start < 0 or count < 1:
        _fail("train.profile", spec, "needs START >= 0 and STEPS >= 1 (e.g. 10:3)")
    if start >= steps:
        _fail("train.profile", spec, f"START must be below train.steps={steps} (steps are "
              f"counted from 0), or the run ends before the trace starts")


def check_family(name: str) -> None:
    """Refuse an unknown family; a named model given as one (``gpt2``) points to ``--preset``."""
    if name in FAMILIES:
        return
    try:
        preset = get_preset(name)
    except ConfigError:
        FAMILIES.check(name, "family")
    raise ConfigError(f"family={name!r}: {name!r} is a named model, not a family; use --preset "
                      f"{name} (its family is {preset.family}); families: "
                      f"{', '.join(FAMILIES.names())}")


def check_lengths(model: ModelConfig, seq_len: int) -> None:
    """Fail early when a run's sequence length cannot fit the model's position table; warn
    when the scheme's settings leave part of it untrained at this length."""
    for message in model.position.length_warnings(model, seq_len):
        warnings.warn(message, stacklevel=2)
    limit = model.position.max_length(model)
    if limit is not None and seq_len > limit:
        _fail(
            "train.seq_len",
            seq_len,
            f"longer than position={model.position.name} allows "
            f"({model.position.limit_text(model)}); raise "
            f"{model.position.length_field(model)}, shorten the sequence or pick a scheme that "
            "extrapolates",
        )


# Plain-name fields and the registries that hold their names (the CLI's help lists these).
NAMED_FIELDS = {"family": FAMILIES, "tokenizer": TOKENIZERS}

_DEFAULT_SWITCHES = {f.name: f.default for f in dataclasses.fields(ModelConfig)
                     if "registry" in f.metadata}
# Flat fields of older versions and where their settings live now (for a helpful error).
MOVED_FIELDS = {
    "rope": "position.FIELD (position=rope: base, pairing, fraction, scaling, "
            "scaling.factor, ...)",
    "window": "mask.window (with --model.mask=sliding_window)",
    "t5_num_buckets": "position.num_buckets (with --model.position=t5)",
    "t5_max_distance": "position.max_distance (with --model.position=t5)",
    "fire_hidden": "position.hidden (with --model.position=fire)",
    "attention_chunk": "attention.chunk_size (with --model.attention=chunked)",
    "norm_eps": "norm.eps (every norm has one: --model.norm=rmsnorm --model.norm.eps=1e-6)",
}


# Construction from JSON and from command-line overrides ------------------------------------


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(text: str, annotation: Any, name: str) -> Any:
    """Turn a command-line string into a value of the field's annotated type."""
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        if text.lower() in ("none", "null"):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(text, inner[0], name)
    if origin is tuple:  # "1,20" -> (1, 20)
        inner = [a for a in args if a is not Ellipsis]
        parts = [p for p in text.replace("(", "").replace(")", "").split(",") if p.strip()]
        return tuple(_coerce(p.strip(), inner[min(i, len(inner) - 1)], name)
                     for i, p in enumerate(parts))
    if annotation is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}={text!r}: expected true or false")
    if annotation in (int, float):
        try:
            return annotation(text)
        except ValueError:
            kind = "a whole number, e.g. 64" if annotation is int else "a number, e.g. 3e-4"
            raise ConfigError(f"{name}={text!r}: expected {kind}") from None
    return text


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build a (possibly nested) config dataclass from plain JSON-like data."""
    if hasattr(cls, "migrate"):
        data = cls.migrate(data)
    check_known_fields(cls, data, prefix, prefix[:-1] or cls.__name__)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        if "registry" in fields[key].metadata:
            pass  # a switch: the dataclass resolves names and dicts itself
        elif dataclasses.is_dataclass(hints[key]) and isinstance(value, dict):
            value = from_dict(hints[key], value, f"{prefix}{key}.")
        elif isinstance(value, list) and typing.get_origin(hints[key]) is tuple:
            value = tuple(value)
        kwargs[key] = value
    return cls(**kwargs)


def _unknown_setting(switch: Switch, key: str, prefix: str, registry: Registry | None,
                     hint: str) -> str:
    """Which setting ``switch`` lacks, the ones it has, and the entries that have it:
    ``position=rope has no setting num_buckets (its settings: base, ...); num_buckets is a
    setting of t5``."""
    head = key.partition(".")[0]
    field = prefix[:-1]
    own = sorted(f.name for f in dataclasses.fields(switch) if f.init)
    text = (f"unknown option --{prefix}{key}: {field}={switch.name} has no setting {head} "
            + (f"(its settings: {', '.join(own)})" if own else "(it has no settings)"))
    others = {name: {f.name for f in dataclasses.fields(entry) if f.init}
              for name, entry in (registry.items() if registry else [])
              if dataclasses.is_dataclass(entry) and name != switch.name}
    holders = [name for name, settings in others.items() if head in settings]
    if holders:
        return (f"{text}; {head} is a setting of {', '.join(holders)}: choose one first, "
                f"e.g. --{field}={holders[0]} --{prefix}{key}=...")
    if hint:
        return f"{text}; {hint.strip()}"
    near = difflib.get_close_matches(head, set().union(*others.values()), n=1)
    if near:
        where = ", ".join(name for name, settings in others.items() if near[0] in settings)
        return f"{text}; did you mean {near[0]}, a setting of {where}?"
    return text


def apply_overrides(config: Any, overrides: dict[str, str], prefix: str = "",
                    registry: Registry | None = None) -> Any:
    """Return ``config`` with dotted ``{"position.scaling": "yarn"}`` string overrides applied.

    A switch field takes a registered name (``position=t5``: that entry with its defaults)
    and, in the same call, its own fields (``position.num_buckets=16``). ``registry``: the one
    ``config`` (a switch) was chosen from, to name the entries that have a setting it lacks.
    """
    hints = _field_types(type(config))
    fields = {f.name: f for f in dataclasses.fields(config) if f.init}
    grouped: dict[str, dict[str, str]] = {}
    changes: dict[str, Any] = {}
    for key, text in overrides.items():
        head, _, rest = key.partition(".")
        if head not in fields:
            if isinstance(config, ModelConfig) and head in MOVED_FIELDS:
                raise ConfigError(f"--{prefix}{key}: the field moved into its switch; use "
                                  f"--{prefix}{MOVED_FIELDS[head]}")
            close = difflib.get_close_matches(head, fields, n=1)
            hint = f"did you mean --{prefix}{close[0]}? " if close else ""
            if isinstance(config, Switch):
                raise ConfigError(_unknown_setting(config, key, prefix, registry, hint))
            raise ConfigError(
                f"unknown option --{prefix}{key}; {hint}valid {prefix or 'top-level '}fields: "
                f"{', '.join(sorted(fields)) or 'none'}"
            )
        registry = fields[head].metadata.get("registry")
        if rest:
            grouped.setdefault(head, {})[rest] = text
        elif registry is not None:
            registry.check(text, f"{prefix}{head}")
            current = getattr(config, head)
            changes[head] = current if current.name == text else registry.get(text)()
        elif dataclasses.is_dataclass(hints[head]):
            changes[head] = from_dict(hints[head], json.loads(text), f"{prefix}{head}.")
        else:
            changes[head] = _coerce(text, hints[head], f"{prefix}{head}")
    for head, sub in grouped.items():
        current = changes.get(head, getattr(config, head))
        changes[head] = apply_overrides(current, sub, f"{prefix}{head}.",
                                        fields[head].metadata.get("registry"))
    # a config's own replace re-resolves the defaults that follow other fields (TrainConfig:
    # shuffle_rows follows the data kind, so --task does not inherit the text default)
    return getattr(config, "replace", functools.partial(dataclasses.replace, config))(**changes)
