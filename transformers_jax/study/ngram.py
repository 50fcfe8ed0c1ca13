"""Interpolated Kneser-Ney n-gram language model over token ids: the baseline a transformer
must beat before its positional scheme can matter.

Why a numpy implementation rather than a package: ``kenlm`` (PyPI) only *queries* ARPA files;
training one needs its C++ ``lmplz`` binary, which pip does not build. ``nltk``'s
``KneserNeyInterpolated`` computes each probability with Python-level recursion over
dictionaries and needs minutes for the ~10^5 held-out tokens and 10^6 training tokens here.
Sorted-key arrays and ``searchsorted`` do the same counts in seconds, and they are exactly
the textbook estimator, so the baseline can be checked against numbers worked by hand.

The estimator (Chen & Goodman 1998, interpolated KN with one discount per order):

    P_k(w | h) = max(c_k(h w) - D_k, 0) / c_k(h) + D_k N1+(h .) / c_k(h) * P_{k-1}(w | h')
    P_0(w)     = 1 / V

where ``h'`` drops the oldest token of ``h``; ``c_k`` is the raw count at the highest order
and the continuation count ``N1+(. h w)`` (distinct tokens seen before ``h w``) below it;
``c_k(h) = sum_w c_k(h w)``; ``N1+(h .)`` the number of distinct ``w`` with ``c_k(h w) > 0``;
``D_k = n1 / (n1 + 2 n2)`` from the number of ``k``-grams counted once and twice. A context
never seen (``c_k(h) = 0``) falls through to ``P_{k-1}``. Every distribution sums to 1 over the
vocabulary, and no token gets probability 0.

Scoring a stream gives each token the last ``order - 1`` tokens as context (fewer at the start
of the stream, where the lower orders' distributions are used). A transformer scored in
windows gives a window's first positions fewer than that; a sweep's ``loss_k@L`` scores both
on the positions with ``order - 1`` tokens of context or more.
"""

from __future__ import annotations

import numpy as np


def _lookup(sorted_keys: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Index of each key in ``sorted_keys``, or -1 where absent (or where ``keys`` < 0)."""
    if sorted_keys.size == 0:
        return np.full(keys.shape, -1, np.int64)
    idx = np.searchsorted(sorted_keys, keys)
    idx = np.minimum(idx, sorted_keys.size - 1)
    found = (sorted_keys[idx] == keys) & (keys >= 0)
    return np.where(found, idx, -1)


class KneserNey:
    """``KneserNey(order, vocab_size).fit(train_ids)``; ``token_losses(ids)`` in nats.

    k-grams are keyed as ``rank(prefix (k-1)-gram) * V + last token`` (ranks in the sorted
    training (k-1)-grams), so keys stay within int64 for any vocabulary and order.
    """

    def __init__(self, order: int, vocab_size: int):
        if not 1 <= order <= 8:
            raise ValueError(f"order={order}: use 1-8")
        if vocab_size < 1:
            raise ValueError(f"vocab_size={vocab_size}: must be positive")
        self.order, self.V = order, int(vocab_size)
        self.keys: list[np.ndarray] = []  # per order k-1: sorted unique k-gram keys
        self.counts: list[np.ndarray] = []  # the count used at that order (raw or continuation)
        self.ctx_total: list[np.ndarray] = []  # per order: c_k(h), indexed by rank of h
        self.ctx_types: list[np.ndarray] = []  # N1+(h .), indexed by rank of h
        self.discounts: list[float] = []

    # ----------------------------------------------------------------------------- fitting

    def fit(self, ids: np.ndarray) -> KneserNey:
        ids = np.asarray(ids, np.int64)
        if ids.ndim != 1 or ids.size < self.order:
            raise ValueError(f"need a 1-D stream of at least {self.order} tokens")
        if ids.min() < 0 or ids.max() >= self.V:
            raise ValueError(f"token ids must lie in [0, {self.V})")
        n, V = ids.size, self.V
        # keys_at[k-1][i]: key of the k-gram ending at position i (valid for i >= k-1)
        keys_at, uniq = [], []
        prev = None
        for k in range(1, self.order + 1):
            if k == 1:
                key = ids.copy()
            else:
                rank = np.full(n, -1, np.int64)
                rank[k - 1 :] = np.searchsorted(uniq[-1], prev[k - 2 : n - 1])
                key = np.where(rank >= 0, rank * V + ids, -1)
            keys_at.append(key)
            uniq.append(np.unique(key[k - 1 :]))
            prev = key
        self.keys, self.counts, self.ctx_total, self.ctx_types, self.discounts = [], [], [], [], []
        for k in range(1, self.order + 1):
            if k == self.order:  # raw counts
                keys, counts = np.unique(keys_at[k - 1][k - 1 :], return_counts=True)
            else:  # continuation counts: distinct (k+1)-grams whose suffix is this k-gram
                _, first = np.unique(keys_at[k][k:], return_index=True)
                suffix = keys_at[k - 1][k:][first]
                keys, counts = np.unique(suffix, return_counts=True)
            counts = counts.astype(np.float64)
            n1, n2 = float(np.sum(counts == 1)), float(np.sum(counts == 2))
            discount = n1 / (n1 + 2 * n2) if n1 > 0 else 0.5
            n_ctx = 1 if k == 1 else uniq[k - 2].size
            ctx = keys // V if k > 1 else np.zeros_like(keys)
            self.keys.append(keys)
            self.counts.append(counts)
            self.ctx_total.append(np.bincount(ctx, weights=counts, minlength=n_ctx))
            self.ctx_types.append(np.bincount(ctx, minlength=n_ctx).astype(np.float64))
            self.discounts.append(discount)
        self._uniq = uniq
        return self

    # ----------------------------------------------------------------------------- scoring

    def next_probs(self, contexts_MK: np.ndarray, targets_M: np.ndarray) -> np.ndarray:
        """P(target | context) for each row; ``contexts_MK`` holds the previous tokens (most
        recent last, ``K >= order - 1``), -1 where there is none (stream start)."""
        if not self.keys:
            raise RuntimeError("fit the model first")
        ctx = np.asarray(contexts_MK, np.int64)
        w = np.asarray(targets_M, np.int64)
        M, V = w.size, self.V
        if ctx.shape[0] != M or ctx.shape[1] < self.order - 1:
            raise ValueError(f"contexts must be [M, >= {self.order - 1}]")
        ctx = ctx[:, ctx.shape[1] - (self.order - 1) :] if self.order > 1 else ctx[:, :0]
        p = np.full(M, 1.0 / V)
        for k in range(1, self.order + 1):
            # rank of the context (k-1)-gram: the last k-1 tokens, keyed left to right
            if k == 1:
                rank = np.zeros(M, np.int64)
            else:
                key = ctx[:, -(k - 1)]
                for j in range(k - 2, 0, -1):
                    r = _lookup(self._uniq[k - 2 - j], key)
                    key = np.where((r >= 0) & (ctx[:, -j] >= 0), r * V + ctx[:, -j], -1)
                rank = _lookup(self._uniq[k - 2], key)
            seen = rank >= 0
            safe = np.maximum(rank, 0)
            total = np.where(seen, self.ctx_total[k - 1][safe], 0.0)
            types = np.where(seen, self.ctx_types[k - 1][safe], 0.0)
            idx = _lookup(self.keys[k - 1], np.where(seen, safe * V + w, -1))
            count = np.where(idx >= 0, self.counts[k - 1][np.maximum(idx, 0)], 0.0)
            D = self.discounts[k - 1]
            has = total > 0
            denom = np.where(has, total, 1.0)
            mixed = np.maximum(count - D, 0.0) / denom + D * types / denom * p
            p = np.where(has, mixed, p)
        return p

    def token_losses(self, ids: np.ndarray) -> np.ndarray:
        """``-log P(ids[i] | ids[i-order+1 : i])`` for every position i >= 1, in nats."""
        ids = np.asarray(ids, np.int64)
        K = max(self.order - 1, 1)
        padded = np.concatenate([np.full(K, -1, np.int64), ids])
        rows = np.lib.stride_tricks.sliding_window_view(padded[:-1], K)[1:]  # context of i>=1
        out = np.empty(ids.size - 1)
        for s in range(0, ids.size - 1, 1 << 18):  # bounded memory
            e = min(s + (1 << 18), ids.size - 1)
            out[s:e] = -np.log(self.next_probs(rows[s:e], ids[1 + s : 1 + e]))
        return out

    def loss(self, ids: np.ndarray) -> float:
        """Mean held-out loss in nats/token (every token after the first)."""
        return float(self.token_losses(ids).mean())


def ngram_losses(train_ids: np.ndarray, eval_ids: np.ndarray, vocab_size: int,
                 orders=(2, 3, 4, 5)) -> dict[str, float]:
    """Held-out nats/token of KN n-gram models fitted on ``train_ids``, keyed "2-gram"... ."""
    return {f"{k}-gram": KneserNey(k, vocab_size).fit(train_ids).loss(eval_ids)
            for k in orders}
