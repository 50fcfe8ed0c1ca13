"""The tokenizer of a run: saved in ``RUN_DIR/tokenizer`` when training starts, described in
every checkpoint's meta (``tokenizer_spec``: a resume refuses another), restored for sampling
and evaluation (``run_tokenizer``)."""

from __future__ import annotations

import hashlib
import os

from transformers_jax.config import TrainConfig
from transformers_jax.data.pipeline import make_tokenizer
from transformers_jax.data.tokenizers import (
    EXTERNAL,
    TOKENIZER_FILE,
    Tokenizer,
    load_tokenizer,
    train_tokenizer,
)
from transformers_jax.parallel import multihost
from transformers_jax.registry import TOKENIZERS
from transformers_jax.runs.layout import TOKENIZER_DIR

_PROBE = "def f(x):\n    return 'Ünïcode' + x  # 0123456789 \t\r\n" * 4


def tokenizer_spec(tokenizer: Tokenizer) -> dict:
    """Kind, vocabulary size and a fingerprint of how it tokenizes (the ids of a fixed text)."""
    ids = [int(i) for i in tokenizer.encode(_PROBE)]
    digest = hashlib.blake2b(repr((tokenizer.vocab_size, ids)).encode(), digest_size=8)
    return {"kind": tokenizer.name, "dir": TOKENIZER_DIR, "vocab_size": tokenizer.vocab_size,
            "fingerprint": digest.hexdigest()}


def run_tokenizer(run_dir: str, spec: dict) -> Tokenizer | None:
    """The tokenizer saved beside the checkpoints (byte-level needs no files); None when the
    checkpoint came from elsewhere with a tokenizer this project cannot load (ids only).
    ``spec``: the checkpoint meta's ``tokenizer``."""
    kind = spec.get("kind")
    if kind == EXTERNAL:  # converted weights whose tokenizer we cannot load
        return None
    directory = os.path.join(run_dir, spec.get("dir", TOKENIZER_DIR))
    if os.path.isdir(directory):
        return load_tokenizer(directory)
    if kind in TOKENIZERS and not TOKENIZERS.get(kind).needs_text:  # byte: no files needed
        return train_tokenizer(kind)
    raise FileNotFoundError(
        f"the run uses a {spec.get('kind')!r} tokenizer but {directory} is missing; copy the "
        "whole run directory, not only its checkpoints"
    )


def training_tokenizer(cfg: TrainConfig) -> Tokenizer:
    """The tokenizer a training run uses: restored from its run directory when there is one,
    else built from ``cfg`` (and saved there)."""
    saved = os.path.join(cfg.run_dir, TOKENIZER_DIR) if cfg.run_dir else None
    # The JSON is written last and atomically: a directory without it is another process of
    # the same run still saving, so build the same tokenizer here rather than read half of it.
    if saved and os.path.isfile(os.path.join(saved, TOKENIZER_FILE)):
        return load_tokenizer(saved)
    source = None if cfg.task else cfg.data
    tokenizer = make_tokenizer(cfg.tokenizer, source, cfg.tokenizer_vocab,
                               data_dir=cfg.data_dir, text_key=cfg.text_key,
                               val_fraction=cfg.val_fraction, download=cfg.data_download)
    if saved:
        tokenizer.save(saved)
    return tokenizer


def source_tokenizer(cfg: TrainConfig) -> Tokenizer | None:
    """Fine-tuning: the tokenizer saved with the run ``init_from`` names (its params know
    those ids), saved into this run's directory too; None when this run has its own already
    (a resume) or that run has none of ours (converted ids only)."""
    source = os.path.join(cfg.init_from, TOKENIZER_DIR) if cfg.init_from else None
    own = cfg.run_dir and os.path.isfile(os.path.join(cfg.run_dir, TOKENIZER_DIR,
                                                      TOKENIZER_FILE))
    if source is None or own or not os.path.isfile(os.path.join(source, TOKENIZER_FILE)):
        return None
    tokenizer = load_tokenizer(source)
    if cfg.run_dir and multihost.is_main_process():
        tokenizer.save(os.path.join(cfg.run_dir, TOKENIZER_DIR))
    return tokenizer
