"""The attention switch of the config (``registry.ATTENTION``): each entry says what its kernel
supports and calls it. The kernels are one file each (``reference.py``, ``jax_nn.py``,
``chunked.py``, ``pallas.py``, ``splash.py``); a config is built and checked without JAX, so
``attend`` imports its kernel when the model calls it."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

from transformers_jax.config import ConfigError
from transformers_jax.registry import ATTENTION, Switch

if TYPE_CHECKING:
    import jax


@dataclasses.dataclass(frozen=True)
class AttentionImpl(Switch):
    """Base of every ``registry.ATTENTION`` entry: ``attend`` calls its kernel, and the class
    says what that supports. ``softcap``: can apply ``attn_logit_softcap``. ``dense_masks``:
    takes any boolean mask (otherwise only causal and segment masks: no window, no prefix-LM).
    ``backends``: the JAX platforms it runs on. ``typed_under_shard_map``: its outputs carry
    the varying-axis types ``shard_map(check_vma=True)`` needs (the shard_map strategy turns
    the check off for a kernel without them). ``decodes``: attends from a few new queries to a
    longer KV cache (causality by position, not by array index). ``bias_backends``: the
    platforms on which it adds a bias (ALiBi, T5, FIRE, KERPLE). ``oracle``: the plain
    definition the others are checked against (every score materialised, every feature): for
    tests, never a candidate in a speed comparison. Settings of the kernel are dataclass
    fields."""

    oracle: ClassVar[bool] = False
    softcap: ClassVar[bool] = True
    dense_masks: ClassVar[bool] = True
    windows: ClassVar[bool] = False
    decodes: ClassVar[bool] = True
    backends: ClassVar[tuple[str, ...]] = ("cpu", "gpu", "tpu")
    bias_backends: ClassVar[tuple[str, ...] | None] = None  # None: every backend it runs on
    typed_under_shard_map: ClassVar[bool] = True

    def attend(self, q, k, v, *, bias, mask, scale, logit_softcap) -> jax.Array:
        """The kernel's output for ``dot_product_attention``'s checked inputs (``scale``
        resolved to a number)."""
        raise NotImplementedError

    def check(self, config: Any) -> None:
        if config.attn_logit_softcap is not None and not self.softcap:
            raise ConfigError(
                f"attention={self.name!r}: the {self.name} kernel cannot soft-cap attention "
                "logits; use attention=reference or attention=chunked with attn_logit_softcap")
        window = getattr(config.mask, "window", None)
        windowed = window is not None and not self.windows
        if not self.dense_masks and (windowed or config.mask.needs_prefix_len):
            kinds = "causal, sliding-window" if self.windows else "causal"
            raise ConfigError(
                f"attention={self.name!r}: supports {kinds} and segment masks only, not "
                f"mask={config.mask.name}; use attention=chunked")

    def platform_refusal(self, platform: str, config: Any) -> str | None:
        """Why the kernel cannot run on ``platform`` (the devices of a run about to start), or
        None. Asked before any work; a compile for another platform (``tjax plan`` for a TPU
        from a CPU host) does not ask."""
        if platform not in self.backends:
            return (f"attention={self.name!r} runs on {' or '.join(self.backends)}, and this "
                    f"run's devices are {platform}; use attention=chunked (blockwise, any "
                    "backend), xla or reference: the same weights give the same numbers")
        if (self.bias_backends is not None and platform not in self.bias_backends
                and config.position.adds_bias):
            return (f"attention={self.name!r} on {platform} takes no additive bias, and "
                    f"position={config.position.name} adds one; use attention=chunked or a "
                    "position without a bias (rope, none)")
        return None

    def check_decoding(self, config: Any) -> None:
        """Refuse KV-cache decoding before it starts when the kernel cannot do it."""
        if not self.decodes:
            raise ConfigError(
                f"attention={self.name!r} cannot decode with a KV cache (its causal mask is "
                "by array index, so it needs as many queries as keys); sample with "
                "--model.attention=chunked or xla: the same weights give the same numbers")


@ATTENTION.register("reference")
@dataclasses.dataclass(frozen=True)
class Reference(AttentionImpl):
    """Einsum + softmax over the whole ``[Q, K]`` score matrix: the oracle."""

    oracle: ClassVar[bool] = True

    def attend(self, q, k, v, **options) -> jax.Array:
        from transformers_jax.nn.attention.reference import reference_attention

        return reference_attention(q, k, v, **options)


@ATTENTION.register("xla")
@dataclasses.dataclass(frozen=True)
class Xla(AttentionImpl):
    """``jax.nn.dot_product_attention``, fused by XLA."""

    softcap: ClassVar[bool] = False

    def attend(self, q, k, v, **options) -> jax.Array:
        from transformers_jax.nn.attention.jax_nn import xla_attention

        return xla_attention(q, k, v, **options)


@ATTENTION.register("cudnn")
@dataclasses.dataclass(frozen=True)
class Cudnn(AttentionImpl):
    """cuDNN's fused flash attention through ``jax.nn`` (NVIDIA GPUs)."""

    softcap: ClassVar[bool] = False
    backends: ClassVar[tuple[str, ...]] = ("gpu",)

    def attend(self, q, k, v, **options) -> jax.Array:
        from transformers_jax.nn.attention.jax_nn import cudnn_attention

        return cudnn_attention(q, k, v, **options)


@ATTENTION.register("chunked")
@dataclasses.dataclass(frozen=True)
class Chunked(AttentionImpl):
    """Blockwise online softmax in plain JAX, any backend. ``chunk_size``: the tile length
    (queries and keys). ``unroll_tiles``: unroll the tile loops of a call with at most this
    many tiles (faster steps, longer compiles; 0: never)."""

    chunk_size: int = 128
    unroll_tiles: int = 16

    def attend(self, q, k, v, **options) -> jax.Array:
        from transformers_jax.nn.attention.chunked import chunked_attention

        return chunked_attention(q, k, v, **options, chunk_size=self.chunk_size,
                                 unroll_tiles=self.unroll_tiles)

    def check(self, config: Any) -> None:
        super().check(config)
        if self.chunk_size <= 0:
            raise ConfigError(f"attention.chunk_size={self.chunk_size!r}: must be positive")
        if self.unroll_tiles < 0:
            raise ConfigError(f"attention.unroll_tiles={self.unroll_tiles!r}: must be >= 0 "
                              "(0 keeps the tile loops rolled)")


@ATTENTION.register("pallas")
@dataclasses.dataclass(frozen=True)
class Pallas(AttentionImpl):
    """The Pallas flash-attention kernels shipped with JAX (TPU; NVIDIA GPU via Triton)."""

    softcap: ClassVar[bool] = False
    dense_masks: ClassVar[bool] = False
    decodes: ClassVar[bool] = False
    backends: ClassVar[tuple[str, ...]] = ("gpu", "tpu")
    bias_backends: ClassVar[tuple[str, ...]] = ("tpu",)  # the Triton kernel takes no bias
    typed_under_shard_map: ClassVar[bool] = False  # pallas_call outputs have no vma

    def attend(self, q, k, v, **options) -> jax.Array:
        from transformers_jax.nn.attention.pallas import pallas_attention

        return pallas_attention(q, k, v, **options)


@ATTENTION.register("splash")
@dataclasses.dataclass(frozen=True)
class Splash(AttentionImpl):
    """JAX's Pallas splash attention (TPU): a flash kernel that skips masked blocks; causal,
    sliding-window, segment masks, soft-capping, grouped heads without repeating them. No
    prefix-LM (per-row prefix lengths are data, its mask is static), no bias, no KV cache.
    ``block``: the largest query/key block (a multiple of 128). ``interpret``: run in the
    Pallas interpreter on any backend (slow; for tests)."""

    dense_masks: ClassVar[bool] = False
    windows: ClassVar[bool] = True
    decodes: ClassVar[bool] = False
    backends: ClassVar[tuple[str, ...]] = ("tpu",)
    typed_under_shard_map: ClassVar[bool] = False  # pallas_call outputs have no vma

    block: int = 512
    interpret: bool = False

    def platform_refusal(self, platform: str, config: Any) -> str | None:
        return None if self.interpret else super().platform_refusal(platform, config)

    def attend(self, q, k, v, **options) -> jax.Array:
        from transformers_jax.nn.attention.splash import splash_attention

        return splash_attention(q, k, v, **options, block=self.block, interpret=self.interpret)

    def check(self, config: Any) -> None:
        super().check(config)
        if config.position.adds_bias:
            raise ConfigError(
                f"attention='splash' takes no additive bias, and position="
                f"{config.position.name} adds one to the scores; use attention=chunked (any "
                "backend) or attention=pallas (TPU), or a position without a bias (rope, none)")
        if self.block <= 0 or self.block % 128:
            raise ConfigError(f"attention.block={self.block!r}: must be a positive multiple of "
                              "128 (the TPU's lanes), e.g. 512")
