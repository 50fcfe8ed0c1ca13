"""``pallas``: the Pallas flash-attention kernels that ship with JAX (TPU; NVIDIA GPU via
Triton)."""

from __future__ import annotations

import jax.numpy as jnp

from transformers_jax.nn.attention.api import as_4d, refuse_softcap
from transformers_jax.nn.attention.per_shard import kernel_segments, per_shard
from transformers_jax.nn.attention.platform import platform_compiled_for
from transformers_jax.nn.masks import AttentionMask


def _pallas_mask_parts(mask, q_len: int, k_len: int, implementation: str):
    """(causal, segment ids or None) for a Pallas kernel, or a ValueError naming what it cannot
    express. The kernels take causality by array index and masks by segment-id equality."""
    if mask is None:
        return False, None
    if not isinstance(mask, AttentionMask):
        raise ValueError(
            f"attention implementation {implementation!r} takes an AttentionMask (causal and/or "
            "segments), not a dense boolean mask; use chunked, xla or reference"
        )
    if mask.window is not None or mask.prefix_len is not None:
        raise ValueError(
            f"attention implementation {implementation!r} supports causal and segment masks "
            "only (no sliding window, no prefix-LM); use chunked"
        )
    if mask.causal and q_len != k_len:
        raise ValueError(
            f"attention implementation {implementation!r} applies causality by index, which "
            f"needs as many queries as keys (got {q_len} and {k_len}: a KV cache); decode "
            "with chunked or xla"
        )
    return mask.causal, kernel_segments(mask, q_len, k_len)


def pallas_attention(q, k, v, *, bias, mask, scale, logit_softcap, chunk_size=128):
    """Pallas flash attention: ``jax.experimental.pallas.ops.tpu.flash_attention`` on TPU, the
    Triton kernel ``jax.experimental.pallas.ops.gpu.attention.mha`` on NVIDIA GPUs.

    Causal and packed-segment masks (and key padding, as a segment) only, causality by index
    (queries and keys aligned, no KV cache); bias on TPU only; grouped k/v heads are repeated to
    the query heads. The path follows the devices compiled for (``platform_compiled_for``), and the
    kernel runs per shard inside ``shard_map`` over the batch and head mesh axes of the logical
    rules in context (XLA cannot partition a Mosaic/Triton call itself), so it works under
    the single and jit strategies with any data/FSDP/tensor mesh, and under pmap. Inside a
    ``shard_map`` the kernel runs on the local shard as it is, but only with
    ``check_vma=False``: JAX's kernels give their outputs no varying-axis types (a clear error
    says so); the shard_map strategy turns the check off for it (``typed_under_shard_map``).
    ``tjax plan`` compiles it for TPU; CI has no TPU or GPU to run it on (on a TPU VM, ``tjax
    bench --model.attention=pallas`` runs it).
    """
    del chunk_size
    refuse_softcap("pallas", logit_softcap)
    platform = platform_compiled_for()
    if platform not in ("tpu", "gpu"):
        raise RuntimeError(
            f"attention implementation 'pallas' needs a TPU (Pallas flash attention) or an "
            f"NVIDIA GPU (Pallas Triton flash attention); jax backend is {platform!r}: use "
            "chunked (the same blockwise algorithm in plain JAX, any backend), xla or reference"
        )
    b, q_len, h, d = q.shape
    n = k.shape[2]
    if n != h:  # the kernels want one k/v head per query head
        k, v = jnp.repeat(k, h // n, axis=2), jnp.repeat(v, h // n, axis=2)
    k_len = k.shape[1]
    causal, segments = _pallas_mask_parts(mask, q_len, k_len, "pallas")
    for name, length in (("query", q_len), ("key", k_len)):  # the kernels' 128-wide blocks
        if length % min(128, length) or (platform == "tpu" and length % 128):
            raise ValueError(
                f"attention implementation 'pallas' needs {name} lengths that are a multiple "
                f"of 128{' (or below 128 on GPU)' if platform == 'gpu' else ''}; got {length}: "
                "pad the sequence or use chunked"
            )
    if platform == "tpu":
        from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

        ab = None
        if bias is not None:
            ab = jnp.broadcast_to(as_4d(bias), (b, h, q_len, k_len)).astype(jnp.float32)

        def kernel(q, k, v, ab, segments):  # [B, T, H, D] in and out, per shard
            out = tpu_flash.flash_attention(
                q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                ab=ab, segment_ids=None if segments is None else tpu_flash.SegmentIds(*segments),
                causal=causal, sm_scale=scale,
            )
            return out.transpose(0, 2, 1, 3)

        return per_shard(kernel, "pallas", q, k, v, ab, segments).astype(q.dtype)
    if bias is not None:
        raise ValueError(
            "attention implementation 'pallas' takes no bias on GPU (the Triton kernel has "
            "none); use cudnn, chunked or xla for ALiBi/T5/FIRE"
        )
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    if segments is not None and (mask.kv_valid is not None or mask.q_segments is not
                                 mask.kv_segments):
        raise ValueError(
            "the Pallas GPU kernel takes one segment-id array for queries and keys (packed "
            "self-attention); key padding or distinct key segments need cudnn or chunked"
        )

    def gpu_kernel(q, k, v, ab, segments):
        del ab
        return gpu_attention.mha(q, k, v, segment_ids=None if segments is None else segments[0],
                                 sm_scale=scale, causal=causal)

    return per_shard(gpu_kernel, "pallas", q, k, v, None, segments).astype(q.dtype)
