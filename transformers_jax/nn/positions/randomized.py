"""``randomized``: randomized positional encodings (Ruoss et al. 2023, "Randomized Positional
Encodings Boost Length Generalization of Transformers") on top of a base scheme.

Shape legend: B batch, T length, L ``max_position``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from transformers_jax.config import ConfigError
from transformers_jax.nn.positions.base import PositionScheme, Role
from transformers_jax.registry import POSITIONS, switch_field

if TYPE_CHECKING:
    import flax.linen as nn
    import jax


def sample_positions(rng: jax.Array, positions_BT: jax.Array, max_position: int,
                     segment_ids: jax.Array | None = None) -> jax.Array:
    """An ordered random subset of ``[0, max_position)`` for each sequence, int32 ``[B, T]``.

    A sequence is a run of consecutive positions (p, p+1, ...) within one segment: packed
    segments restart their positions (and padding is segment 0), so each is sampled on its own,
    uniformly among the subsets of its size, and its k-th token gets the k-th smallest position
    drawn. How: each row draws T distinct values in random order (the top-T indices of L uniform
    numbers); any fixed set of n of them is a uniform n-subset; sorting the values within each
    run (runs are contiguous, so one lexicographic sort by (run, value) does it) orders them.
    The top-n indices are the first n of the top-T ones, so a sequence's draw does not depend
    on what is appended after it (padding, longer rows).
    """
    import jax  # here, not at the top: a config reads this file without JAX
    import jax.numpy as jnp

    B, T = positions_BT.shape
    if T > max_position:
        raise ValueError(f"a sequence of {T} tokens needs at least {T} positions to sample from; "
                         f"position.max_position is {max_position}")
    follows_BT = positions_BT[:, 1:] == positions_BT[:, :-1] + 1
    if segment_ids is not None:
        follows_BT &= segment_ids[:, 1:] == segment_ids[:, :-1]
    starts_BT = jnp.concatenate([jnp.ones((B, 1), bool), ~follows_BT], axis=1)
    run_BT = jnp.cumsum(starts_BT, axis=1)
    _, drawn_BT = jax.lax.top_k(jax.random.uniform(rng, (B, max_position)), T)
    order_BT = jnp.lexsort((drawn_BT, run_BT), axis=-1)
    return jnp.take_along_axis(drawn_BT, order_BT, axis=-1).astype(jnp.int32)


@POSITIONS.register("randomized")
@dataclasses.dataclass(frozen=True)
class Randomized(PositionScheme):
    """The ``base`` scheme fed, in training, a sorted random subset of positions drawn from
    ``[0, max_position)`` for each sequence (packed segments each draw their own, see
    ``sample_positions``), so that every position up to ``max_position`` (L, at least the
    longest test length) is trained even when training sequences are short. Every other hook
    is the base's.

    Evaluation (``evaluate``): the paper samples at test time too (its Figure 1; the reference
    code, ``google-deepmind/randomized_positional_encodings``, draws a fresh ordered subset of
    M positions from [0, L) on every call, training and ``range_evaluation`` alike, with no
    train/test switch). ``evaluate="sample"`` (the default) does that in every deterministic
    forward pass, with a draw fixed by ``eval_seed`` so evaluations are reproducible; the
    subset depends on the length of the whole sequence, so KV-cache decoding is refused (it
    cannot reproduce it). ``evaluate="real"`` evaluates and decodes on positions 0 .. T-1.
    Masks always test the real positions (sorted draws keep every order a causal mask tests;
    windows and prefixes measure real distances).

    ``base``: rope, xpos, learned or sinusoidal (a scheme that embeds or rotates positions and
    has no bias; the paper's noisy relative and ALiBi variants randomize a distance table,
    which this does not do). With ``learned`` the table needs ``max_position`` rows:
    ``model.max_len >= max_position``. ``max_length`` is at most ``max_position``: a sequence
    cannot draw more distinct positions than there are.
    """

    max_position: int = 2048
    base: PositionScheme = switch_field(POSITIONS, "rope")
    evaluate: str = "sample"  # "sample" (the paper) or "real" (0..T-1; decodes with a cache)
    eval_seed: int = 0

    @classmethod
    def length_settings(cls, train_len: int, max_eval: int) -> dict[str, Any]:
        return {"base": "rope", "max_position": max_eval}  # every evaluated position is drawn

    def check(self, config: Any) -> None:
        if self.evaluate not in ("sample", "real"):
            raise ConfigError(f"position.evaluate={self.evaluate!r}: valid choices: sample (draw "
                              "positions at evaluation too, as the paper), real (0..T-1)")
        if self.max_position <= 0:
            raise ConfigError(f"position.max_position={self.max_position!r}: must be positive "
                              "(the number of positions to sample from, at least the longest "
                              "test length)")
        base = self.base
        # which hooks the base fills, asked of its class: building its modules needs JAX
        acts = (type(base).embedding is not PositionScheme.embedding
                or type(base).rotate is not PositionScheme.rotate)
        has_bias = type(base).bias is not PositionScheme.bias
        if not acts or has_bias or base.randomizes:
            has = ("its own randomization" if base.randomizes else "its own bias" if has_bias
                   else "no position embedding or rotation to feed")
            raise ConfigError(
                f"position.base={base.name}: randomized positions need a base that embeds or "
                f"rotates positions without a bias (rope, xpos, learned, sinusoidal); "
                f"{base.name} has {has}")
        base.check(config)
        limit = base.max_length(config)
        if limit is not None and limit < self.max_position:
            raise ConfigError(
                f"position.max_position={self.max_position}: position.base={base.name} encodes "
                f"only {limit} positions (set by {base.length_field(config)}); raise "
                f"{base.length_field(config)} to at least max_position or lower max_position")

    def max_length(self, config: Any) -> int:
        limit = self.base.max_length(config)
        return self.max_position if limit is None else min(limit, self.max_position)

    def length_field(self, config: Any) -> str:
        limit = self.base.max_length(config)
        if limit is not None and limit < self.max_position:
            return self.base.length_field(config)
        return "model.position.max_position"

    def embedding(self, config: Any) -> nn.Module | None:
        return self.base.embedding(config)

    def token_scale(self, config: Any) -> float:
        return self.base.token_scale(config)

    def rotate(self, config: Any, x_BTHD: jax.Array, positions_BT: jax.Array,
               role: Role) -> jax.Array:
        return self.base.rotate(config, x_BTHD, positions_BT, role)

    def bias(self, config: Any, bidirectional: bool) -> nn.Module | None:
        return self.base.bias(config, bidirectional)

    @property
    def adds_bias(self) -> bool:
        return self.base.adds_bias

    def train_positions(self, rng: jax.Array, positions_BT: jax.Array, config: Any,
                        segment_ids: jax.Array | None = None) -> jax.Array:
        return sample_positions(rng, positions_BT, self.max_position, segment_ids)

    def eval_positions(self, positions_BT: jax.Array, config: Any,
                       segment_ids: jax.Array | None = None) -> jax.Array:
        import jax

        if self.evaluate == "real":
            return positions_BT
        return sample_positions(jax.random.key(self.eval_seed), positions_BT, self.max_position,
                                segment_ids)

    def shard_refusal(self, config: Any) -> str | None:
        return ("position=randomized draws the positions of each sequence as a whole, which "
                "one shard of it cannot reproduce")

    @property
    def cacheable(self) -> bool:
        return self.evaluate == "real"
