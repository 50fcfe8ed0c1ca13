"""Masked-LM corruption (Devlin et al. 2019, section 3.1), a pure function of a JAX key.

Shape legend: B batch, T length.

Of the *eligible* tokens of each row (not special, not padding), a share ``rate`` (15%) is
chosen for prediction. Each chosen token is then, independently, replaced by ``[MASK]`` with
probability ``mask_fraction`` (80%), by a random ordinary token with probability
``random_fraction`` (10%), or left as it is (the remaining 10%). The loss and the accuracy see
the chosen positions only: ``weights`` is 1 there and 0 everywhere else.

Two ways to choose, both jit-able:

- ``exact_count=True`` (default, BERT's own recipe): each row with n eligible tokens gets exactly
  ``round(rate * n)`` chosen (at least 1 when n > 0), uniformly without replacement;
- ``exact_count=False`` (the Hugging Face collator): each eligible token is chosen independently
  with probability ``rate``.

The random replacement is drawn uniformly from the ordinary (non-special) ids, so it may equal
the original token, as in BERT; that case then counts as "unchanged" in the observed input.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class MaskingConfig:
    """How many tokens the masked-LM objective predicts and how their inputs are corrupted."""

    rate: float = 0.15  # share of eligible tokens chosen for prediction
    mask_fraction: float = 0.8  # of the chosen: input becomes [MASK]
    random_fraction: float = 0.1  # of the chosen: input becomes a random ordinary token
    exact_count: bool = True  # round(rate * n) per row (BERT) or Bernoulli(rate) per token

    def __post_init__(self) -> None:
        if not 0.0 < self.rate <= 1.0:
            raise ValueError(f"masking rate={self.rate!r}: must be in (0, 1] (BERT uses 0.15)")
        for name in ("mask_fraction", "random_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"masking {name}={value!r}: must be in [0, 1]")
        if self.mask_fraction + self.random_fraction > 1.0 + 1e-9:
            raise ValueError(
                f"masking mask_fraction + random_fraction = "
                f"{self.mask_fraction + self.random_fraction}: must be at most 1 (the rest of "
                "the chosen tokens are left unchanged)"
            )

    @property
    def keep_fraction(self) -> float:
        """Of the chosen tokens, the share whose input is left unchanged."""
        return max(0.0, 1.0 - self.mask_fraction - self.random_fraction)


BERT_MASKING = MaskingConfig()  # 15%, then 80% [MASK] / 10% random / 10% unchanged


def special_ids_of(tokenizer) -> tuple[int, ...]:
    """Every special id of a tokenizer (its ``special`` name -> id mapping, plus ``unk_id`` if
    it has one), sorted: ids that are never chosen and never drawn as replacements."""
    ids = {int(i) for i in tokenizer.special.values()}
    unk = getattr(tokenizer, "unk_id", None)
    if unk is not None:
        ids.add(int(unk))
    return tuple(sorted(ids))


def ordinary_ids(vocab_size: int, special_ids: Iterable[int]) -> np.ndarray:
    """The ids a random replacement may take: ``[0, vocab_size)`` minus the special ids."""
    special = set(int(i) for i in special_ids)
    ids = np.array([i for i in range(vocab_size) if i not in special], np.int32)
    if ids.size == 0:
        raise ValueError("every id of the vocabulary is special: no ordinary token to draw")
    return ids


@partial(jax.jit, static_argnames=("mask_id", "special_ids", "vocab_size", "config"))
def mask_tokens(
    key: jax.Array,
    tokens_BT: jax.Array,
    *,
    mask_id: int,
    special_ids: tuple[int, ...],
    vocab_size: int,
    config: MaskingConfig = BERT_MASKING,
    valid_BT: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """Corrupt ``tokens_BT`` (int ``[B, T]``) for the masked-LM loss; a pure function of ``key``.

    Args:
      key: a JAX PRNG key; the same key gives the same output, bit for bit.
      mask_id: the ``[MASK]`` id.
      special_ids: ids never chosen and never drawn as random replacements (pad, bos, eos,
        mask, cls, sep, ...).
      vocab_size: random replacements come from ``[0, vocab_size)`` minus ``special_ids``.
      config: the rate and the 80/10/10 split.
      valid_BT: optional boolean ``[B, T]``; False marks padding (e.g. ``segment_ids == 0``),
        which is never chosen even if its id is ordinary.

    Returns ``inputs`` (corrupted, int32 ``[B, T]``), ``targets`` (the original tokens) and
    ``weights`` (float32 ``[B, T]``, 1 on chosen positions).
    """
    tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
    k_choose, k_kind, k_random = jax.random.split(key, 3)
    specials = jnp.asarray(sorted(set(special_ids)), jnp.int32)
    eligible_BT = ~jnp.isin(tokens_BT, specials)
    if valid_BT is not None:
        eligible_BT &= jnp.asarray(valid_BT, bool)

    if config.exact_count:
        # Rank the eligible positions of each row in a random order; choose the first `count`.
        score_BT = jnp.where(eligible_BT, jax.random.uniform(k_choose, tokens_BT.shape), 2.0)
        rank_BT = jnp.argsort(jnp.argsort(score_BT, axis=-1), axis=-1)
        n_B = eligible_BT.sum(-1)
        count_B = jnp.round(n_B.astype(jnp.float32) * config.rate).astype(jnp.int32)
        count_B = jnp.where(n_B > 0, jnp.maximum(count_B, 1), 0)
        chosen_BT = eligible_BT & (rank_BT < count_B[:, None])
    else:
        chosen_BT = eligible_BT & (jax.random.uniform(k_choose, tokens_BT.shape) < config.rate)

    u_BT = jax.random.uniform(k_kind, tokens_BT.shape)
    to_mask_BT = chosen_BT & (u_BT < config.mask_fraction)
    to_random_BT = (
        chosen_BT
        & (u_BT >= config.mask_fraction)
        & (u_BT < config.mask_fraction + config.random_fraction)
    )
    pool = jnp.asarray(ordinary_ids(vocab_size, special_ids))
    random_BT = pool[jax.random.randint(k_random, tokens_BT.shape, 0, pool.shape[0])]

    inputs_BT = jnp.where(to_mask_BT, mask_id, jnp.where(to_random_BT, random_BT, tokens_BT))
    return {
        "inputs": inputs_BT.astype(jnp.int32),
        "targets": tokens_BT,
        "weights": chosen_BT.astype(jnp.float32),
    }


def mask_batch(key: jax.Array, batch: dict, tokenizer, config: MaskingConfig = BERT_MASKING,
               vocab_size: int | None = None) -> dict:
    """``batch`` with ``inputs``/``targets``/``weights`` replaced by a masked-LM corruption of
    ``batch["inputs"]``; padding (``segment_ids == 0``, if present) is never chosen. Other keys
    (``segment_ids``, ``positions``, ``token_types``) pass through."""
    segments = batch.get("segment_ids")
    out = mask_tokens(
        key,
        batch["inputs"],
        mask_id=int(tokenizer.special["mask"]),
        special_ids=special_ids_of(tokenizer),
        vocab_size=tokenizer.vocab_size if vocab_size is None else vocab_size,
        config=config,
        valid_BT=None if segments is None else jnp.asarray(segments) > 0,
    )
    return {**batch, **out}
