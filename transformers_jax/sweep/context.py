"""Context usage, after Khandelwal et al. 2018 ("Sharp Nearby, Fuzzy Far Away"): held-out
windows whose context farther than ``b`` tokens from the first scored token is perturbed,
everything nearer kept.

A window is ``window + 1`` tokens ``w_T``: a model reads ``w_T[:-1]`` and predicts ``w_T[1:]``,
and only its last ``target`` predictions are scored, the first of them ``w_T[first]`` with
``first = window + 1 - target``. The far context is ``w_T[:first - b]``; a perturbation
replaces it and keeps ``w_T[first - b:]`` (the ``b`` nearest tokens and the targets) as it was.

Everything here is numpy and a function of its ``rng``: the sweep draws the windows and every
perturbation from the spec's seed (``draw_windows``), so each cell and each seed scores the
very same perturbed windows, and their losses pair window by window.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import zlib
from collections.abc import Callable

import numpy as np

from transformers_jax.registry import Registry


@dataclasses.dataclass(frozen=True)
class Sources:
    """Where replacement tokens come from: the training tokens' unigram distribution, and the
    held-out stream with the document of each position (documents are joined by eos)."""

    unigram_V: np.ndarray  # probability of each token id among the training tokens
    heldout_N: np.ndarray
    document_N: np.ndarray  # [i]: the held-out document position i belongs to

    @classmethod
    def of(cls, train_N: np.ndarray, heldout_N: np.ndarray, eos_id: int, vocab: int) -> Sources:
        counts_V = np.bincount(train_N, minlength=vocab).astype(np.float64)
        if counts_V.sum() == 0:
            raise ValueError("no training tokens to draw the unigram replacements from")
        # the eos that ends a document belongs to it
        document_N = np.concatenate([[0], np.cumsum(heldout_N[:-1] == eos_id)])
        return cls(counts_V / counts_V.sum(), np.asarray(heldout_N), document_N)

    def elsewhere(self, length: int, start: int, stop: int, rng) -> np.ndarray:
        """``length`` consecutive held-out tokens from documents that the window at
        ``heldout_N[start:stop]`` does not touch: fluent text, not this one's."""
        first, last = self.document_N[start], self.document_N[stop - 1]
        before = int(np.searchsorted(self.document_N, first))  # where the window's docs begin
        after = int(np.searchsorted(self.document_N, last, side="right"))  # and end
        n_before = max(before - length + 1, 0)  # starts of spans wholly before them
        n_after = max(len(self.heldout_N) - after - length + 1, 0)  # wholly after
        if n_before + n_after == 0:
            raise ValueError(
                f"no span of {length} held-out tokens lies outside the documents "
                f"of the window at {start}:{stop}: hold out more text"
            )
        k = int(rng.integers(0, n_before + n_after))
        at = k if k < n_before else after + (k - n_before)
        return self.heldout_N[at : at + length].copy()


@dataclasses.dataclass(frozen=True)
class Far:
    """What a perturbation sees besides the far context itself: where the window lies in the
    held-out stream (``start:stop``), the replacement sources and the local shuffle's span."""

    start: int
    stop: int
    sources: Sources
    span: int


@dataclasses.dataclass(frozen=True)
class Perturbation:
    about: str  # one line for the report ({span}: the spec's local span)
    apply: Callable[[np.ndarray, np.random.Generator, Far], np.ndarray]  # far_F -> new far


PERTURBATIONS: Registry[Perturbation] = Registry("context perturbation")


def _shuffle_local(far_F: np.ndarray, rng, where: Far) -> np.ndarray:
    # spans counted back from the boundary, so the one next to the near context is whole
    out = far_F.copy()
    for stop in range(len(out), 0, -where.span):
        piece = out[max(stop - where.span, 0) : stop]
        out[max(stop - where.span, 0) : stop] = rng.permutation(piece)
    return out


PERTURBATIONS.add(
    "truncate",
    Perturbation(
        "the far context removed: the model reads only the b nearest tokens",
        lambda far_F, rng, where: far_F[:0],
    ),
)
PERTURBATIONS.add(
    "shuffle",
    Perturbation(
        "the far context's tokens in a random order (a bag of its tokens)",
        lambda far_F, rng, where: rng.permutation(far_F),
    ),
)
PERTURBATIONS.add(
    "shuffle_local",
    Perturbation(
        "the far context shuffled within spans of {span} tokens (their order kept)", _shuffle_local
    ),
)
PERTURBATIONS.add(
    "replace_unigram",
    Perturbation(
        "the far context replaced by tokens drawn from the training tokens' unigram distribution",
        lambda far_F, rng, where: rng.choice(
            len(where.sources.unigram_V), size=len(far_F), p=where.sources.unigram_V
        ).astype(far_F.dtype),
    ),
)
PERTURBATIONS.add(
    "replace_elsewhere",
    Perturbation(
        "the far context replaced by as many consecutive tokens of other held-out documents",
        lambda far_F, rng, where: where.sources.elsewhere(
            len(far_F), where.start, where.stop, rng
        ).astype(far_F.dtype),
    ),
)


def perturb(name: str, window_T: np.ndarray, first: int, b: int, rng, where: Far) -> np.ndarray:
    """``window_T`` with its context farther than ``b`` tokens before ``window_T[first]`` (the
    first scored token) perturbed by ``name``; the rest, ``window_T[first - b:]``, unchanged."""
    cut = first - b
    if not 0 < cut < len(window_T):
        raise ValueError(
            f"distance {b} leaves no far context before token {first} of a "
            f"window of {len(window_T)}"
        )
    far_F = PERTURBATIONS.get(name).apply(window_T[:cut].copy(), rng, where)
    return np.concatenate([far_F, window_T[cut:]]).astype(window_T.dtype)


def rng_for(seed: int, name: str, b: int) -> np.random.Generator:
    """The generator of one perturbation at one distance: the same for every cell and seed,
    and independent of which other perturbations and distances a spec lists."""
    return np.random.default_rng([seed, zlib.crc32(name.encode()), b])


@dataclasses.dataclass(frozen=True)
class Windows:
    """The held-out windows a sweep scores for context usage, intact and perturbed."""

    window: int  # tokens a model reads
    target: int  # the last ones of them scored
    starts_W: np.ndarray  # where each window begins in the held-out stream
    intact_WT: np.ndarray  # [W, window + 1]
    perturbed: dict[tuple[str, int], np.ndarray]  # (perturbation, b) -> [W, T'] (T' shorter
    # when truncated)

    @functools.cached_property
    def digest(self) -> str:
        """Of every token scored: equal digests, equal windows."""
        h = hashlib.sha256(self.intact_WT.tobytes())
        for key in sorted(self.perturbed):
            h.update(repr(key).encode() + self.perturbed[key].tobytes())
        return h.hexdigest()


def draw_windows(
    sources: Sources,
    window: int,
    target: int,
    distances,
    names,
    n_windows: int,
    seed: int,
    span: int,
) -> Windows:
    """``n_windows`` windows of ``window + 1`` held-out tokens at distinct random starts, and
    each of them perturbed by each of ``names`` at each distance in ``distances``."""
    heldout_N = sources.heldout_N
    room = len(heldout_N) - window
    if room < n_windows:
        raise ValueError(
            f"the held-out stream of {len(heldout_N):,} tokens has {max(room, 0)} "
            f"windows of {window + 1} tokens, fewer than the {n_windows} asked for"
        )
    starts_W = np.sort(np.random.default_rng([seed, 0]).choice(room, n_windows, replace=False))
    intact_WT = np.stack([heldout_N[s : s + window + 1] for s in starts_W]).astype(np.int32)
    first = window + 1 - target
    perturbed = {}
    for name in names:
        for b in distances:
            rng = rng_for(seed, name, b)
            perturbed[(name, b)] = np.stack(
                [
                    perturb(
                        name, w_T, first, b, rng, Far(int(s), int(s) + window + 1, sources, span)
                    )
                    for s, w_T in zip(starts_W, intact_WT, strict=True)
                ]
            )
    return Windows(window, target, starts_W, intact_WT, perturbed)
