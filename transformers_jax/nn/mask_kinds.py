"""The ``mask`` switch (``registry.MASKS``): who attends to whom, as the rest of the model asks
it (causal? decodes? cache slots?). Each kind gives the static parts of an ``AttentionMask``;
the boolean maths is in ``masks.py``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

from transformers_jax.config import ConfigError
from transformers_jax.registry import MASKS, Switch

if TYPE_CHECKING:
    import jax


@dataclasses.dataclass(frozen=True)
class MaskKind(Switch):
    """Base of every ``registry.MASKS`` entry: what it tells the rest of the model.

    ``causal``: no query ever sees a later key (relative biases then bucket one direction).
    ``decodes``: tokens can be generated left to right with a KV cache (causal and prefix-LM).
    ``needs_prefix_len``: batches carry ``prefix_len`` ``[B]``.
    """

    causal: ClassVar[bool] = False
    decodes: ClassVar[bool] = False
    needs_prefix_len: ClassVar[bool] = False

    def parts(self, prefix_len: jax.Array | None) -> dict:
        """The static parts of an ``AttentionMask`` (padding and segments are added by
        ``build_mask`` for every kind)."""
        return {"causal": False}

    def cache_slots(self, total_len: int) -> int:
        """KV-cache slots needed to decode up to ``total_len`` tokens."""
        return total_len


@MASKS.register("causal")
@dataclasses.dataclass(frozen=True)
class Causal(MaskKind):
    causal: ClassVar[bool] = True
    decodes: ClassVar[bool] = True

    def parts(self, prefix_len):
        return {"causal": True}


@MASKS.register("bidirectional")
@dataclasses.dataclass(frozen=True)
class Bidirectional(MaskKind):
    """Every query sees every key (of its segment): encoders."""


@MASKS.register("prefix")
@dataclasses.dataclass(frozen=True)
class Prefix(MaskKind):
    """Prefix-LM: bidirectional over the first ``prefix_len`` tokens, causal after."""

    decodes: ClassVar[bool] = True
    needs_prefix_len: ClassVar[bool] = True

    def parts(self, prefix_len):
        if prefix_len is None:
            raise ValueError("mask=prefix needs prefix_len [batch]: the length of each prefix")
        return {"causal": True, "prefix_len": prefix_len}


@MASKS.register("sliding_window")
@dataclasses.dataclass(frozen=True)
class SlidingWindow(MaskKind):
    """Causal, and each query sees only the ``window`` most recent positions (its own
    included); a ring cache of ``window`` slots suffices for decoding."""

    causal: ClassVar[bool] = True
    decodes: ClassVar[bool] = True
    window: int | None = None

    def check(self, config: Any) -> None:
        if self.window is None or self.window <= 0:
            raise ConfigError(f"mask.window={self.window!r}: mask=sliding_window needs a "
                              "positive window (--model.mask.window=W)")

    def parts(self, prefix_len):
        return {"causal": True, "window": self.window}

    def cache_slots(self, total_len: int) -> int:
        return min(self.window, total_len)
