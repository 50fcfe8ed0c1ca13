"""What a positional scheme is: one frozen config that carries the hooks the model calls.

Shape legend: B batch, T length, H heads, D head width, C model width, Q query length,
K key length.

Positions are explicit int32 arrays ``[B, T]`` (``[B, Q]`` / ``[B, K]``): they restart in each
packed segment and carry the cache offset while decoding, so no hook reads a position off an
array index. A scheme fills the hooks it needs and inherits no-ops for the rest:

=======================  ====================================================  ================
hook                     called by                                             filled by
=======================  ====================================================  ================
``embedding(cfg)``       the embedder: a module ``positions [B, T] ->          learned,
                         [B, T, C]`` added to the token embeddings             sinusoidal
``token_scale(cfg)``     the embedder: a factor on the token embeddings        sinusoidal
                                                                               (vaswani form)
``rotate(cfg, x, pos,    self-attention, on queries (``role="query"``) and     rope, xpos
role)``                  keys (``role="key"``) before the dot product
``bias(cfg, bidir.)``    the layer stack, once per forward pass (every layer   alibi, t5, fire,
                         shares it): a module ``(q_pos [B, Q], k_pos [B, K])   kerple
                         -> float32 [B|1, H, Q, K]``; also at cache positions
``train_positions(rng,   the layer stack in training: the positions the other  randomized
pos)``                   hooks see (masks keep the real ones)
``eval_positions(pos)``  the same outside training (no RNG: fixed by a seed)   randomized
``shard_refusal(cfg)``   the shard_map strategy with a context axis: why the   randomized,
                         hooks cannot run on a shard of the sequence, or None  rope (a rule
                                                                               of the window)
``cacheable``            whether KV-cache decoding can reproduce a forward     (all but
                         pass (checked when a cache is made)                   sampled eval)
``max_length(cfg)``      config checks, sampling, data: longest input or None  learned
``length_field(cfg)``    the setting that sets ``max_length`` (errors name it)  randomized
``length_warnings(cfg,   the training loop: settings that will not train at    t5, fire
seq_len)``               this length (buckets past it, an inactive threshold)
=======================  ====================================================  ================

Cross-attention (queries and keys from different sequences) calls none of them.

A config is built and checked without JAX, so a built-in scheme's file imports none at the top:
its hooks import what they compute with when the model calls them, JAX itself or the module
beside it that holds its Flax module (``t5.py`` and ``t5_bias.py``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from transformers_jax.registry import Switch

if TYPE_CHECKING:
    import flax.linen as nn
    import jax

Role = Literal["query", "key"]


@dataclasses.dataclass(frozen=True)
class PositionScheme(Switch):
    """Base of every entry of ``registry.POSITIONS``; the defaults add no position at all."""

    extrapolates: ClassVar[bool] = True  # whether lengths past training are meaningful

    def max_length(self, config: Any) -> int | None:
        """The longest sequence the scheme can encode, or None for no limit."""
        return None

    def length_field(self, config: Any) -> str:
        """The setting that sets ``max_length``: the one a length error tells the user to
        raise."""
        return "model.max_len"

    def limit_text(self, config: Any) -> str:
        """``"64 positions, set by model.position.max_position"``, for length errors."""
        return f"{self.max_length(config)} positions, set by {self.length_field(config)}"

    @classmethod
    def length_settings(cls, train_len: int, max_eval: int) -> dict[str, Any]:
        """The settings an experiment that trains at ``train_len`` and evaluates up to
        ``max_eval`` gives this scheme (the fields ``length_warnings`` checks), as overrides of
        the defaults; empty when the defaults fit any length."""
        return {}

    def length_warnings(self, config: Any, seq_len: int) -> list[str]:
        """Why training at ``seq_len`` leaves part of the scheme untrained or inactive (each a
        sentence naming the field to change); empty when nothing is wrong."""
        return []

    def embedding(self, config: Any) -> nn.Module | None:
        """A module ``positions [B, T] -> [B, T, C]`` added to the token embeddings."""
        return None

    def token_scale(self, config: Any) -> float:
        """A factor the embedder multiplies the token embeddings by (before adding the
        position embedding); 1 for every scheme but the original transformer's sinusoidal."""
        return 1.0

    def rotate(self, config: Any, x_BTHD: jax.Array, positions_BT: jax.Array,
               role: Role) -> jax.Array:
        """Queries or keys ``[B, T, H, D]`` after the position transform (same shape, dtype)."""
        return x_BTHD

    def bias(self, config: Any, bidirectional: bool) -> nn.Module | None:
        """A module ``(q_pos [B, Q], k_pos [B, K]) -> float32 [B|1, H, Q, K]`` added to the
        attention scores; ``bidirectional`` says whether queries may see later keys."""
        return None

    def train_positions(self, rng: jax.Array, positions_BT: jax.Array, config: Any,
                        segment_ids: jax.Array | None = None) -> jax.Array:
        """The positions the hooks see in training (the real ones by default);
        ``segment_ids`` [B, T] (packed documents, 0 = padding) when the batch has them."""
        return positions_BT

    def eval_positions(self, positions_BT: jax.Array, config: Any,
                       segment_ids: jax.Array | None = None) -> jax.Array:
        """The positions the hooks see outside training (the real ones by default)."""
        return positions_BT

    def shard_refusal(self, config: Any) -> str | None:
        """Why the hooks cannot run on one device's shard of a sequence, given that shard's
        global positions (``train.strategy=shard_map`` with a ``context`` axis), or None. Every
        hook that reads positions token by token can; a bias module is given every key's
        positions (``nn.attention.every_key``)."""
        return None

    @property
    def cacheable(self) -> bool:
        """Whether decoding token by token with a KV cache computes what a forward pass over
        the whole sequence does (not when positions depend on the final length)."""
        return True

    @property
    def adds_bias(self) -> bool:
        """Whether ``bias`` gives a module (asked without building it, so without JAX)."""
        return type(self).bias is not PositionScheme.bias

    @property
    def randomizes(self) -> bool:
        """Whether ``train_positions`` changes anything (then training needs an RNG)."""
        return type(self).train_positions is not PositionScheme.train_positions


def distance_BQK(q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """``i - j`` for query position i and key position j: int ``[B, Q, K]``."""
    return q_pos[:, :, None] - k_pos[:, None, :]
