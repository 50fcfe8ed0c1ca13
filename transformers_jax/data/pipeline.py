"""Grain input pipelines: documents or synthetic tasks -> packed, sharded, resumable batches.

The LM pipeline, per host::

    Documents (random access)  --[i::count] host shard--> shuffle(seed) --> repeat(epochs)
      --> tokenize: [bos] piece [eos] -> inputs = t[:-1], targets = t[1:]     (MapDataset)
      --> to_iter_dataset (threads)
      --> pack: "concat" ConcatThenSplit | "first_fit" split+FirstFitPack | "none" split+pad
      --> shuffle_rows: rows shuffled within windows (optional, training)
      --> batch(global_batch / count) --> batch dict (weights, pad ids, fixed shape)
      --> bos_per_row: every row's (and packed piece's) first input replaced by bos (optional)

Batches follow the model contract: numpy ``inputs``, ``targets``, ``segment_ids``,
``positions`` (int32 ``[B, T]``), ``weights`` (float32 ``[B, T]``, 0 on padding). Segment ids
are 1, 2, 3... per packed piece of text in a row and 0 on padding; positions restart at 0 in
each segment. Targets never cross a segment: the shift to next-token targets happens per
document before packing.

The iterator is a Grain ``DatasetIterator``: ``get_state()`` returns a JSON-serialisable dict and
``set_state(state)`` on a freshly made iterator (same arguments) continues with exactly the next
batch. The state carries a fingerprint of the pipeline's arguments, so restoring into a
different pipeline fails loudly instead of silently giving other data.

With a finite ``num_epochs`` the last, partial batch is padded with empty rows (weights 0), so no
token is dropped and every batch has the same shape; with ``num_epochs=None`` (training) the
data repeats forever, reshuffled every epoch.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import grain
import numpy as np

from transformers_jax.data.mixture import is_mixture, parse_mixture
from transformers_jax.data.sources import Documents, Piece, open_documents
from transformers_jax.data.synthetic import FORMATS, task_source
from transformers_jax.data.tokenizers import (
    Tokenizer,
    split_tokenizer_value,
    train_tokenizer,
    trainable_kind,
)

PACKINGS = ("concat", "first_fit", "none")
_STATE_VERSION = 1


# ----------------------------------------------------------------------------- checks


def check_sequence_length(seq_len: int, max_len: int | None, what: str = "seq_len") -> None:
    """Fail when a sequence is longer than the model allows (e.g. a learned position table of
    ``max_len`` rows)."""
    if seq_len <= 0:
        raise ValueError(f"{what}={seq_len}: must be a positive integer")
    if max_len is not None and seq_len > max_len:
        raise ValueError(
            f"{what}={seq_len} is longer than the model allows (max_len={max_len}); use "
            f"{what}<={max_len} or a model with model.max_len>={seq_len}"
        )


def _resolve_shard(shard: tuple[int, int] | None) -> tuple[int, int]:
    if shard is None:
        import jax

        return jax.process_index(), jax.process_count()
    index, count = (int(v) for v in shard)
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"shard={shard}: need (index, count) with 0 <= index < count")
    return index, count


def _host_batch(global_batch_size: int, count: int) -> int:
    if global_batch_size <= 0 or global_batch_size % count:
        raise ValueError(
            f"global_batch_size={global_batch_size} must be a positive multiple of the "
            f"{count} host(s); each host reads global_batch_size / {count} rows"
        )
    return global_batch_size // count


def _resolve_packing(pack: bool | str) -> str:
    mode = {True: "concat", False: "none"}.get(pack, pack) if isinstance(pack, bool) else pack
    if mode not in PACKINGS:
        raise ValueError(
            f"pack={pack!r}: valid choices: True (concat), False (none), {', '.join(PACKINGS)}"
        )
    return mode


# ----------------------------------------------------------------------------- transforms


class _SplitIterDataset(grain.IterDataset):
    """Cuts every element's sequence features into consecutive pieces of at most ``max_len``.

    Resumable: the state is the parent's state before the current element plus the offset
    already emitted from it; restoring reads that element again and skips the offset.
    """

    def __init__(self, parent: grain.IterDataset, max_len: int, keys: Sequence[str]):
        super().__init__(parent)
        self._max_len = max_len
        self._keys = tuple(keys)

    def __iter__(self) -> grain.DatasetIterator:
        return _SplitIterator(self._parent.__iter__(), self._max_len, self._keys)

    def __str__(self) -> str:
        return f"SplitIterDataset(max_len={self._max_len})"


class _SplitIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, max_len: int, keys: Sequence[str]):
        super().__init__(parent)
        self._max_len = max_len
        self._keys = keys
        self._element: dict | None = None
        self._offset = 0
        self._parent_state = self._parent.get_state()

    def __next__(self) -> dict:
        while self._element is None or self._offset >= len(self._element[self._keys[0]]):
            resume_at = self._offset if self._element is None else 0
            self._parent_state = self._parent.get_state()
            self._element = next(self._parent)
            self._offset = resume_at
        a = self._offset
        b = min(a + self._max_len, len(self._element[self._keys[0]]))
        self._offset = b
        return {k: (v[a:b] if k in self._keys else v) for k, v in self._element.items()}

    def get_state(self) -> dict[str, Any]:
        return {"parent": self._parent_state, "offset": self._offset}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._parent_state = state["parent"]
        self._element = None  # the next call re-reads it and skips the emitted offset
        self._offset = int(state["offset"])


def _json_safe(state: Any) -> Any:
    return json.loads(json.dumps(state))


def _restore_tuples(state: Any) -> Any:
    """JSON turns tuples into lists; Grain's ConcatThenSplit compares its slice markers with
    tuples, so turn them back."""
    if isinstance(state, dict):
        out = {}
        for k, v in state.items():
            if k == "remainder_slices" and isinstance(v, dict):
                out[k] = {kk: tuple(vv) for kk, vv in v.items()}
            else:
                out[k] = _restore_tuples(v)
        return out
    if isinstance(state, list):
        return [_restore_tuples(v) for v in state]
    return state


class _Resumable(grain.IterDataset):
    """The top of every pipeline: JSON-serialisable state, stamped with a fingerprint."""

    def __init__(self, parent: grain.IterDataset, fingerprint: dict):
        super().__init__(parent)
        self.fingerprint = _json_safe(fingerprint)

    def __iter__(self) -> grain.DatasetIterator:
        return _ResumableIterator(self._parent.__iter__(), self.fingerprint)

    def __str__(self) -> str:
        return "Resumable"


class _ResumableIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, fingerprint: dict):
        super().__init__(parent)
        self.fingerprint = fingerprint

    def __next__(self):
        return next(self._parent)

    def get_state(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "pipeline": self.fingerprint,
            "grain": _json_safe(self._parent.get_state()),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError(
                "not an input-pipeline state of this version (expected the dict that "
                "get_state() returned)"
            )
        saved = state["pipeline"]
        if saved != self.fingerprint:
            diff = sorted(
                k
                for k in set(saved) | set(self.fingerprint)
                if saved.get(k) != self.fingerprint.get(k)
            )
            details = ", ".join(
                f"{k}: saved {saved.get(k)!r}, now {self.fingerprint.get(k)!r}" for k in diff
            )
            raise ValueError(
                f"the saved input-pipeline state belongs to a different pipeline ({details}); "
                "resume with the same data, tokenizer, seq_len, batch size, seed and sharding"
            )
        self._parent.set_state(_restore_tuples(state["grain"]))


def _pad_to(x: np.ndarray, length: int, value) -> np.ndarray:
    out = np.full((length, *x.shape[1:]), value, dtype=x.dtype)
    out[: len(x)] = x
    return out


def _pad_row(element: dict, lengths: dict[str, int], pad_id: int) -> dict:
    """One unpacked example padded to fixed lengths; segment id 1 on its tokens, 0 on padding."""
    out = {}
    for key, value in element.items():
        group = "encoder_inputs" if key.startswith("encoder") else "inputs"
        if key not in lengths and group not in lengths or np.ndim(value) == 0:
            out[key] = value
            continue
        n = lengths[group]
        fill = 0 if key == "weights" else pad_id
        out[key] = _pad_to(np.asarray(value), n, fill)
        if key in ("inputs", "encoder_inputs"):
            real = len(value)
            out[f"{key}_segment_ids"] = (np.arange(n) < real).astype(np.int32)
            out[f"{key}_positions"] = np.where(np.arange(n) < real, np.arange(n), 0).astype(
                np.int32
            )
    return out


def _lead_with_bos(batch: dict, bos_id: int) -> dict:
    """The first input of every row, and of every piece of text packed into it (segment),
    replaced by bos; padding is left alone. The replaced token is the previous window's last
    target, so every token is still predicted exactly once; what changes is that each window,
    not only each document, starts at a token every position can attend to (NoPE reads
    positions off it; an attention sink)."""
    seg_BT = batch["segment_ids"]
    before_BT = np.pad(seg_BT, ((0, 0), (1, 0)), constant_values=-1)[:, :-1]
    starts_BT = (seg_BT > 0) & (seg_BT != before_BT)
    return {**batch, "inputs": np.where(starts_BT, bos_id, batch["inputs"]).astype(np.int32)}


def _finalize(batch: dict, batch_size: int, pad_id: int) -> dict:
    """Grain's packed keys -> the model's batch contract; pad a short last batch with empty
    rows."""
    out = {
        "inputs": batch["inputs"],
        "targets": batch["targets"],
        "segment_ids": batch["inputs_segment_ids"],
        "positions": batch["inputs_positions"],
    }
    if "encoder_inputs" in batch:
        out["encoder_inputs"] = batch["encoder_inputs"]
        out["encoder_segment_ids"] = batch["encoder_inputs_segment_ids"]
        out["encoder_positions"] = batch["encoder_inputs_positions"]
    real = out["segment_ids"] > 0
    weights = batch["weights"] if "weights" in batch else real
    out["weights"] = np.where(real, weights, 0).astype(np.float32)
    for key in ("inputs", "targets", "encoder_inputs"):
        if key in out:
            seg = out["encoder_segment_ids" if key == "encoder_inputs" else "segment_ids"]
            out[key] = np.where(seg > 0, out[key], pad_id).astype(np.int32)
    for key in ("segment_ids", "positions", "encoder_segment_ids", "encoder_positions"):
        if key in out:
            out[key] = np.where(
                (out["encoder_segment_ids"] if key.startswith("encoder") else real), out[key], 0
            ).astype(np.int32)
    for key in ("prefix_len", "lengths"):
        if key in batch:
            out[key] = np.asarray(batch[key], np.int32)
    rows = len(out["inputs"])
    if rows < batch_size:  # the last batch of a finite pass: pad with empty rows
        for key, value in out.items():
            fill = pad_id if key in ("inputs", "targets", "encoder_inputs") else 0
            out[key] = _pad_to(value, batch_size, fill)
    return out


# ----------------------------------------------------------------------------- datasets


def _as_documents(source) -> Documents | Sequence:
    if isinstance(source, Documents):
        return source
    if isinstance(source, (str, type(None))):
        raise TypeError("internal: specs are opened by make_lm_iterator")
    return [
        s if isinstance(s, Piece) else Piece(s.encode() if isinstance(s, str) else s, True, True)
        for s in source
    ]


def _tokenize_fn(tokenizer: Tokenizer, add_bos: bool, add_eos: bool) -> Callable:
    bos, eos = np.int32(tokenizer.bos_id), np.int32(tokenizer.eos_id)

    def tokenize(piece: Piece) -> dict | None:
        ids = tokenizer.encode(piece.text)
        parts = ([[bos]] if add_bos and piece.first else []) + [ids]
        parts += [[eos]] if add_eos and piece.last else []
        tokens = np.concatenate(parts).astype(np.int32) if len(parts) > 1 else ids
        if len(tokens) < 2:
            return None  # nothing to predict
        return {"inputs": tokens[:-1], "targets": tokens[1:]}

    return tokenize


def _tokenized_documents(
    documents: Documents | Sequence[str | bytes | Piece],
    tokenizer: Tokenizer,
    *,
    seed: int,
    shard: tuple[int, int],
    num_epochs: int | None,
    shuffle: bool,
    add_bos: bool,
    add_eos: bool,
    num_threads: int,
    prefetch: int,
) -> grain.IterDataset:
    """This host's share of random-access ``documents``, shuffled per epoch, tokenized."""
    index, count = shard
    documents = _as_documents(documents)
    if len(documents) == 0 or (
        isinstance(documents, list) and not any(p.text.strip() for p in documents)
    ):
        raise ValueError("the corpus is empty: no document has any text")
    if len(documents) < count:
        raise ValueError(
            f"{len(documents)} piece(s) of text cannot be shared by {count} hosts; every host "
            "needs at least one: use more text"
        )
    ds = grain.MapDataset.source(documents)
    if count > 1:
        ds = ds[index::count]
    if shuffle:
        ds = ds.shuffle(seed=seed % 2**32)
    if num_epochs != 1:
        ds = ds.repeat(num_epochs)
    ds = ds.map(_tokenize_fn(tokenizer, add_bos, add_eos))
    return ds.to_iter_dataset(
        grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
    )


def _tokenized_stream(stream: grain.IterDataset, tokenizer: Tokenizer, add_bos: bool,
                      add_eos: bool) -> grain.IterDataset:
    """A stream of ``Piece``s tokenized, pieces with nothing to predict left out."""
    return stream.map(_tokenize_fn(tokenizer, add_bos, add_eos)).filter(lambda e: e is not None)


def _batched(
    it: grain.IterDataset,
    tokenizer: Tokenizer,
    seq_len: int,
    batch_size: int,
    *,
    mode: str,
    seed: int,
    shuffle: bool,
    shuffle_rows: int,
    bos_per_row: bool,
) -> grain.IterDataset:
    """Tokenized pieces packed into rows of ``seq_len`` and batched (see ``lm_dataset``)."""
    lengths = {"inputs": seq_len, "targets": seq_len}
    if mode == "concat":
        it = grain.experimental.ConcatThenSplitIterDataset(it, length_struct=lengths)
    elif mode == "first_fit":
        it = grain.experimental.FirstFitPackIterDataset(
            _SplitIterDataset(it, seq_len, ("inputs", "targets")),
            length_struct=lengths,
            num_packing_bins=batch_size,
            seed=(seed + 1) % 2**32,
            shuffle_bins=shuffle,
        )
    else:
        it = _SplitIterDataset(it, seq_len, ("inputs", "targets")).map(
            lambda e: _pad_row(e, {"inputs": seq_len}, tokenizer.pad_id)
        )
    if shuffle and shuffle_rows > 1:
        # packing cuts each document into consecutive rows: without this a batch is mostly
        # one document's neighbouring windows
        it = grain.experimental.WindowShuffleIterDataset(
            it, window_size=shuffle_rows, seed=(seed + 2) % 2**32
        )
    it = it.batch(batch_size, drop_remainder=False)
    it = it.map(lambda b: _finalize(b, batch_size, tokenizer.pad_id))
    if bos_per_row:
        it = it.map(lambda b: _lead_with_bos(b, tokenizer.bos_id))
    return it


def lm_dataset(
    documents: Documents | Sequence[str | bytes | Piece],
    tokenizer: Tokenizer,
    seq_len: int,
    batch_size: int,
    *,
    seed: int = 0,
    pack: bool | str = True,
    shard: tuple[int, int] = (0, 1),
    num_epochs: int | None = None,
    shuffle: bool = True,
    add_bos: bool = True,
    add_eos: bool = True,
    bos_per_row: bool = False,
    shuffle_rows: int = 0,
    num_threads: int = 2,
    prefetch: int = 64,
) -> grain.IterDataset:
    """The per-host LM ``IterDataset`` (``batch_size`` rows per batch) over ``documents``;
    ``bos_per_row``: each row's and packed piece's first input is bos (``_lead_with_bos``);
    ``shuffle_rows``: packed rows shuffled within windows of that many rows (with ``shuffle``)."""
    mode = _resolve_packing(pack)
    check_sequence_length(seq_len, None)
    it = _tokenized_documents(documents, tokenizer, seed=seed, shard=shard,
                              num_epochs=num_epochs, shuffle=shuffle, add_bos=add_bos,
                              add_eos=add_eos, num_threads=num_threads, prefetch=prefetch)
    return _batched(it, tokenizer, seq_len, batch_size, mode=mode, seed=seed, shuffle=shuffle,
                    shuffle_rows=shuffle_rows, bos_per_row=bos_per_row)


def _is_stream(source: Any) -> bool:
    """A ``datasets.IterableDataset`` (not imported: ``datasets`` is slow to import)."""
    return hasattr(source, "load_state_dict") and hasattr(source, "n_shards")


def _source_pieces(
    source: str | None | Documents | Sequence | Any,
    tokenizer: Tokenizer,
    *,
    role: str,
    shard: tuple[int, int],
    seed: int,
    num_epochs: int | None,
    shuffle: bool,
    add_bos: bool,
    add_eos: bool,
    num_threads: int,
    split: str | None,
    open_kwargs: dict,
) -> tuple[grain.IterDataset, int | None, str]:
    """One source's tokenized pieces for this host: ``(dataset, pieces or None for a stream,
    its name in the fingerprint)``."""
    from transformers_jax.data import hub
    from transformers_jax.data.sources import parse_spec

    streamed = isinstance(source, str) and not open_kwargs.get("download") and (
        parse_spec(source).kind == "hf")
    if streamed or _is_stream(source):
        take_n = skip_n = None
        if streamed:
            what = f"--data {source}"
            if split is None:
                split, take_n, skip_n = hub.held_out_plan(source, role)
            request = hub.request(source, split)
        else:
            what, request = f"<{type(source).__name__}>", source
        open_stream, column = hub.stream_opener(
            request, field=open_kwargs.get("text_key"), shard=shard, take=take_n, skip=skip_n,
            what=what)
        stream = hub.StreamDataset(open_stream, column, num_epochs, what)
        name = source if streamed else what
        if streamed:
            name += f"@{request['split']}" + (f" skip {skip_n}" if skip_n else "") + (
                f" take {take_n}" if take_n else "")
        return _tokenized_stream(stream, tokenizer, add_bos, add_eos), None, name
    if isinstance(source, (str, type(None))):
        documents = open_documents(source, role, split=split, **open_kwargs)
        name = source or "default"
    else:
        documents = source
        name = f"<{type(source).__name__} of {len(source)}>"
    it = _tokenized_documents(documents, tokenizer, seed=seed, shard=shard,
                              num_epochs=num_epochs, shuffle=shuffle, add_bos=add_bos,
                              add_eos=add_eos, num_threads=num_threads, prefetch=64)
    return it, len(documents), name


def _fingerprint(tokenizer: Tokenizer, **kwargs) -> dict:
    return {
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        **{k: (list(v) if isinstance(v, tuple) else v) for k, v in kwargs.items()},
    }


def make_lm_iterator(
    source_spec: str | None | Documents | Sequence[str | bytes],
    tokenizer: Tokenizer,
    seq_len: int,
    global_batch_size: int,
    seed: int = 0,
    pack: bool | str = True,
    shard: tuple[int, int] | None = None,
    *,
    role: str = "train",
    num_epochs: int | None = None,
    shuffle: bool | None = None,
    max_len: int | None = None,
    val_fraction: float = 0.05,
    data_dir: str | None = None,
    text_key: str | None = None,
    unit: str | None = None,
    split: str | None = None,
    download: bool = False,
    add_bos: bool = True,
    add_eos: bool = True,
    bos_per_row: bool = False,
    shuffle_rows: int = 0,
    num_threads: int = 2,
) -> grain.DatasetIterator:
    """A resumable iterator of LM batches for this host.

    ``source_spec``: a spec string (``None``/"default", "tfds:NAME", "hf:NAME", "lines:PATH", a
    path; see ``sources``) or a mixture of them ("0.7*A,0.3*B", ``mixture``), a
    ``Documents``, a list of texts, or a ``datasets.IterableDataset`` (streamed, resumed at its
    own position). A finite pass (``num_epochs``) over a mixture ends with its first
    exhausted source. ``role``: "train" or "eval" (the
    held-out split). ``pack``: True/"concat" (concatenate and split: no padding),
    "first_fit" (whole pieces of up to ``seq_len`` tokens placed first-fit into the batch's
    rows), False/"none" (one piece per row, padded). ``shard``: (host index, host count),
    default ``(jax.process_index(), jax.process_count())``; each host reads a disjoint share of
    the documents and yields ``global_batch_size / count`` rows. ``shuffle`` defaults to True
    for training and False for eval. ``max_len``: the model's maximum length, checked.
    ``bos_per_row``: every row (and every piece packed into it) starts with bos, not only
    the rows where a document starts. ``shuffle_rows``: when shuffling, packed rows are
    shuffled within windows of that many rows, so a batch mixes many documents (0: off; the
    rows of a long document then come one after another).
    """
    check_sequence_length(seq_len, max_len)
    mode = _resolve_packing(pack)
    index, count = _resolve_shard(shard)
    batch = _host_batch(global_batch_size, count)
    if shuffle is None:
        shuffle = role == "train"
    common = dict(
        role=role, shard=(index, count), seed=seed, num_epochs=num_epochs, shuffle=shuffle,
        add_bos=add_bos, add_eos=add_eos, num_threads=num_threads, split=split,
        open_kwargs=dict(val_fraction=val_fraction, data_dir=data_dir, text_key=text_key,
                         unit=unit, download=download),
    )
    if isinstance(source_spec, str) and is_mixture(source_spec):
        parts = parse_mixture(source_spec)
        sources = [_source_pieces(part.spec, tokenizer, **common) for part in parts]
        pieces = grain.IterDataset.mix([it for it, _, _ in sources],
                                       [part.weight for part in parts])
        spec_id = source_spec
        documents = [n for _, n, _ in sources]
        names = [name for _, _, name in sources]
    else:
        pieces, documents, spec_id = _source_pieces(source_spec, tokenizer, **common)
        names = None
    ds = _batched(pieces, tokenizer, seq_len, batch, mode=mode, seed=seed, shuffle=shuffle,
                  shuffle_rows=shuffle_rows, bos_per_row=bos_per_row)
    fingerprint = _fingerprint(
        tokenizer,
        source=spec_id,
        role=role,
        split=split,
        val_fraction=val_fraction,
        seq_len=seq_len,
        global_batch_size=global_batch_size,
        seed=seed,
        pack=mode,
        shard=(index, count),
        num_epochs=num_epochs,
        shuffle=shuffle,
        documents=documents,
        # only when set: iterator states saved before the option existed still restore
        **({"bos_per_row": True} if bos_per_row else {}),
        **({"shuffle_rows": shuffle_rows} if shuffle and shuffle_rows > 1 else {}),
        **({"parts": names} if names else {}),
    )
    return iter(_Resumable(ds, fingerprint))


def make_lm_eval_iterator(
    source_spec, tokenizer: Tokenizer, seq_len: int, global_batch_size: int, **kwargs
) -> grain.DatasetIterator:
    """One pass over the held-out split in stored order (no shuffle, last batch padded)."""
    kwargs.setdefault("num_epochs", 1)
    return make_lm_iterator(
        source_spec, tokenizer, seq_len, global_batch_size, role="eval", **kwargs
    )


def take(iterator, n: int) -> list[dict]:
    """The next ``n`` batches (fewer if the iterator ends)."""
    return list(itertools.islice(iterator, n))


def make_tokenizer(
    kind: str,
    source_spec: str | None = None,
    vocab_size: int | None = None,
    *,
    max_bytes: int = 20_000_000,
    cache_dir: str | None = None,
    **source_kwargs,
) -> Tokenizer:
    """The tokenizer ``kind`` ("byte", "char", "sentencepiece", "sentencepiece_bpe", or
    "hf:PATH", a Hugging Face tokenizer.json read as it is) for the training text of
    ``source_spec``.

    Trained tokenizers see at most ``max_bytes`` of the training pieces (``training_texts``)
    and are cached by a hash of that text and the settings in ``cache_dir`` (default:
    ``<data dir>/tokenizers``), so a second run does not train again.
    ``source_kwargs`` go to ``open_documents`` (``data_dir``, ``val_fraction``, ...).
    """
    entry = trainable_kind(split_tokenizer_value(kind)[0])
    if not entry.needs_text or entry.from_path is not None:  # byte, or hf:PATH (a file)
        return train_tokenizer(kind)
    from transformers_jax.data.local_text import default_data_dir

    texts = training_texts(source_spec, max_bytes, **source_kwargs)
    if cache_dir is None:
        cache_dir = os.path.join(source_kwargs.get("data_dir") or default_data_dir(), "tokenizers")
    return train_tokenizer(kind, texts, vocab_size, cache_dir=cache_dir)


def training_texts(source_spec: str | None, max_bytes: int = 20_000_000,
                   **source_kwargs) -> list[bytes]:
    """The text a tokenizer is trained on: the training pieces of ``source_spec`` (never the
    held-out part), at most about ``max_bytes`` of them, evenly spaced over a large split; a
    stream's first records; each source of a mixture its share of ``max_bytes``.
    ``source_kwargs`` go to ``open_documents``."""
    from transformers_jax.data.sources import parse_spec

    if isinstance(source_spec, str) and is_mixture(source_spec):
        return [text for part in parse_mixture(source_spec)
                for text in training_texts(part.spec, max(1, int(max_bytes * part.weight)),
                                           **source_kwargs)]
    if (isinstance(source_spec, str) and not source_kwargs.get("download")
            and parse_spec(source_spec).kind == "hf"):
        return _stream_texts(source_spec, max_bytes, source_kwargs.get("text_key"))
    docs = open_documents(source_spec, "train", **source_kwargs)
    stride = 1
    if len(docs) > 1000:  # a large split: estimate its size from 1000 pieces, then sample
        step = len(docs) // 1000
        estimated_bytes = step * sum(len(docs[i].text) for i in range(0, len(docs), step))
        stride = max(1, estimated_bytes // max_bytes)
    texts, total = [], 0
    for i in range(0, len(docs), stride):
        text = docs[i].text
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def _stream_texts(spec: str, max_bytes: int, field: str | None) -> list[bytes]:
    """The first records of a stream's training share, up to about ``max_bytes``."""
    from transformers_jax.data import hub

    split, _, skip = hub.held_out_plan(spec, "train")
    open_stream, column = hub.stream_opener(hub.request(spec, split), field=field,
                                            shard=(0, 1), skip=skip, what=f"--data {spec}")
    texts, total = [], 0
    for piece in hub.StreamDataset(open_stream, column, 1, f"--data {spec}"):
        texts.append(piece.text)
        total += len(piece.text)
        if total >= max_bytes:
            break
    return texts


# ----------------------------------------------------------------------------- tasks


def make_task_iterator(
    task: str,
    tokenizer: Tokenizer,
    seq_len: int,
    global_batch_size: int,
    seed: int = 0,
    *,
    split: str = "train",
    train_lengths: tuple[int, int] = (1, 20),
    test_lengths: tuple[int, int] = (21, 80),
    fmt: str = "decoder",
    prefix: bool = False,
    encoder_len: int | None = None,
    pack: bool | str = False,
    shard: tuple[int, int] | None = None,
    num_examples: int | None = None,
    num_epochs: int | None = None,
    max_len: int | None = None,
    num_threads: int = 2,
) -> grain.DatasetIterator:
    """A resumable iterator of batches of a synthetic task (see ``synthetic``).

    ``fmt``: "decoder" (one sequence, loss on the answer) or "encdec" (``encoder_*`` keys of
    length ``encoder_len``, default ``seq_len``). ``prefix``: decoder rows also carry
    ``prefix_len`` ``[B]`` (the length of ``[bos] prompt [sep]``, for ``mask="prefix"``); not
    with packing, where a row holds several prompts.
    ``pack``: False (one example per row, padded) or "first_fit". Every batch also carries
    ``lengths`` ``[B]`` (the task length of each row; for packed rows, of its first example),
    for ``synthetic.accuracy_by_length``. The test split defaults to one pass
    (``num_epochs=1``); training repeats forever.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r}: valid choices: {', '.join(FORMATS)}")
    layout = FORMATS[fmt]
    mode = _resolve_packing(pack)
    if mode == "concat":
        raise ValueError("synthetic tasks pack whole examples: use pack='first_fit' or False")
    if prefix and not layout.takes_prefix:
        with_prefix = [name for name, f in FORMATS.items() if f.takes_prefix]
        raise ValueError(f"prefix=True needs fmt in {with_prefix} (not {fmt!r})")
    if prefix and mode != "none":
        raise ValueError("prefix=True needs pack=False (one prompt per row)")
    encoder_len = encoder_len or seq_len
    check_sequence_length(seq_len, max_len)
    if layout.encoder:
        check_sequence_length(encoder_len, max_len, "encoder_len")
    index, count = _resolve_shard(shard)
    batch = _host_batch(global_batch_size, count)
    source = task_source(
        task,
        split,
        train_lengths=train_lengths,
        test_lengths=test_lengths,
        num_examples=num_examples,
        seed=seed,
    )
    prompt_chars, answer_chars = source.max_chars()
    need = layout.row_lengths(prompt_chars, answer_chars)
    have = {"inputs": seq_len, "encoder_inputs": encoder_len}
    for key, n in need.items():
        if n > have[key]:
            name = "seq_len" if key == "inputs" else "encoder_len"
            raise ValueError(
                f"task {task!r} at length {source.lengths[1]} ({split} split) needs up to {n} "
                f"tokens but {name}={have[key]}; use {name}>={n} or shorter lengths"
            )
    if num_epochs is None and split == "test":
        num_epochs = 1
    fmt_fn = layout.example
    drop = () if prefix else ("prefix_len",)
    ds = grain.MapDataset.source(source)
    if count > 1:
        ds = ds[index::count]
    if num_epochs != 1:
        ds = ds.repeat(num_epochs)
    ds = ds.map(lambda ex: {k: v for k, v in fmt_fn(ex, tokenizer).items() if k not in drop})
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=64))
    lengths = {"inputs": seq_len, "targets": seq_len, "weights": seq_len}
    if layout.encoder:
        lengths["encoder_inputs"] = encoder_len
    if mode == "first_fit":
        it = grain.experimental.FirstFitPackIterDataset(
            it,
            length_struct=lengths,
            num_packing_bins=batch,
            seed=(seed + 1) % 2**32,
            shuffle_bins=split == "train",
            meta_features=("lengths",),
        )
        it = it.map(lambda e: {**e, "lengths": np.asarray(e["lengths"], np.int32).reshape(-1)[0]})
    else:
        it = it.map(
            lambda e: _pad_row(
                e, {"inputs": seq_len, "encoder_inputs": encoder_len}, tokenizer.pad_id
            )
        )
    it = it.batch(batch, drop_remainder=False)
    it = it.map(lambda b: _finalize(b, batch, tokenizer.pad_id))
    fingerprint = _fingerprint(
        tokenizer,
        task=task,
        split=split,
        lengths=source.lengths,
        fmt=fmt,
        prefix=prefix,
        seq_len=seq_len,
        encoder_len=encoder_len,
        global_batch_size=global_batch_size,
        seed=seed,
        pack=mode,
        shard=(index, count),
        num_examples=source.num_examples,
        num_epochs=num_epochs,
    )
    return iter(_Resumable(it, fingerprint))
