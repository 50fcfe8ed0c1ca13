"""``t5``: a learned scalar per (distance bucket, head) added to the scores (Raffel et al.);
the bias module is in ``t5_bias.py``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from transformers_jax.config import ConfigError
from transformers_jax.nn.positions.base import PositionScheme
from transformers_jax.registry import POSITIONS

if TYPE_CHECKING:
    import flax.linen as nn


@POSITIONS.register("t5")
@dataclasses.dataclass(frozen=True)
class T5(PositionScheme):
    """``num_buckets`` buckets (half per direction when bidirectional); distances from
    ``max_distance`` on share the last one."""

    num_buckets: int = 32
    max_distance: int = 128

    def check(self, config: Any) -> None:
        if self.num_buckets < 4 or self.max_distance <= self.num_buckets // 2:
            raise ConfigError(
                f"position.num_buckets={self.num_buckets!r}: t5 needs >= 4 buckets and "
                f"position.max_distance (now {self.max_distance}) above half of them")

    @classmethod
    def length_settings(cls, train_len: int, max_eval: int) -> dict[str, Any]:
        return {"max_distance": train_len, "num_buckets": min(32, train_len)}  # all buckets train

    def length_warnings(self, config: Any, seq_len: int) -> list[str]:
        if self.max_distance <= seq_len:
            return []
        return [f"position.max_distance={self.max_distance} exceeds the training length "
                f"{seq_len}: the buckets for distances {seq_len}-{self.max_distance} never "
                f"train; set position.max_distance to at most {seq_len}"]

    def bias(self, config: Any, bidirectional: bool) -> nn.Module:
        from transformers_jax.nn.positions.t5_bias import T5RelativeBias

        return T5RelativeBias(config.n_heads, self.num_buckets, self.max_distance,
                              bidirectional)
