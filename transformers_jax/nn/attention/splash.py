"""``splash``: JAX's Pallas TPU splash attention (``jax.experimental.pallas.ops.tpu.
splash_attention``), a flash kernel that skips the blocks its mask hides.

Splash takes its mask as a static object (a pattern over array indices, fixed when the program
is traced) and'ed with per-row segment ids (data). An ``AttentionMask`` maps onto that as:

- causal: ``CausalMask``; a sliding window of W (causal): ``LocalMask`` reaching W - 1 keys back;
- packed segments: ``SegmentIds`` (one row of ids per batch row);
- key padding: the padded keys get segment id -1, which no query has (as in ``pallas``);
- prefix-LM: refused. Each row's prefix length is data, and the kernel's mask is not; the union
  "causal or in the prefix" is not a mask and'ed with segment ids either.

Causality and windows are by array index, which equals the mask's rule by position when each
row's positions count up from 0 by one, restarting in each packed segment (what the model
feeds); no KV cache (queries and keys must be as many). No additive bias (ALiBi, T5, FIRE,
KERPLE): the kernel has no bias input.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from transformers_jax.nn.attention.per_shard import kernel_segments, per_shard
from transformers_jax.nn.attention.platform import platform_compiled_for
from transformers_jax.nn.masks import AttentionMask

LANES = 128  # the kernel's blocks are multiples of the TPU's 128 lanes


def splash_parts(mask, q_len: int, k_len: int):
    """(causal, window or None, segment ids ``([B, Q], [B, K])`` or None) of ``mask``, or a
    ValueError naming what splash cannot express and the kernel that can."""
    if mask is None:
        return False, None, None
    if not isinstance(mask, AttentionMask):
        raise ValueError(
            "attention implementation 'splash' takes an AttentionMask (causal, sliding window, "
            "segments, padding), not a dense boolean mask; use chunked, xla or reference")
    if mask.prefix_len is not None:
        raise ValueError(
            "attention implementation 'splash' cannot apply a prefix-LM mask: each row's "
            "prefix length is data, and the kernel's mask is fixed when compiled; use chunked")
    if (mask.causal or mask.window is not None) and q_len != k_len:
        raise ValueError(
            "attention implementation 'splash' applies causality and windows by index, which "
            f"needs as many queries as keys (got {q_len} and {k_len}: a KV cache); decode with "
            "chunked or xla")
    return mask.causal, mask.window, kernel_segments(mask, q_len, k_len)


def _kernel(heads: int, kv_heads: int, q_len: int, k_len: int, causal: bool,
            window: int | None, block: int, logit_softcap, interpret: bool):
    """The splash kernel for one batch row: q ``[H, Q, D]``, k and v ``[N, K, D]`` (``[K, D]``
    when N == 1)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    shape = (q_len, k_len)
    if window is not None:  # q - k < window, and (causal) q - k >= 0
        one = sa.LocalMask(shape, window_size=(window - 1, 0 if causal else None), offset=0)
    elif causal:
        one = sa.CausalMask(shape)
    else:
        one = sa.FullMask(shape)
    bq, bkv = math.gcd(block, q_len), math.gcd(block, k_len)
    sizes = sa.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq,
                          block_kv_dkv=bkv, block_kv_dkv_compute=bkv, block_q_dq=bq,
                          block_kv_dq=bkv)
    # One k/v head: the MQA kernel keeps it in place for every query head. Several: the MHA
    # kernel reads k/v head h // G for query head h itself, so k and v are never repeated.
    make = sa.make_splash_mqa if kv_heads == 1 else sa.make_splash_mha
    return make(sa.MultiHeadMask([one] * heads), block_sizes=sizes, head_shards=1,
                q_seq_shards=1, attn_logits_soft_cap=logit_softcap, interpret=interpret)


def splash_attention(q, k, v, *, bias, mask, scale, logit_softcap, block: int = 512,
                     interpret: bool = False):
    """Splash attention of q ``[B, Q, H, D]`` over k, v ``[B, K, N, D]`` -> ``[B, Q, H, D]``.

    ``block``: the largest query and key block (each is the largest divisor of its length up to
    ``block``, a multiple of 128). ``interpret``: run the kernel in the Pallas interpreter, on
    any backend (slow: for tests). The scale is applied to q before the kernel (it has no scale
    argument); soft-capping is the kernel's own ``attn_logits_soft_cap``, on the scaled scores.
    Like ``pallas``, the kernel runs per shard inside ``shard_map`` over the batch and head mesh
    axes, and inside a ``shard_map`` only with ``check_vma=False``. A query that sees no key
    (all its keys padding) gets a finite output the kernel does not define, not zero.
    """
    if bias is not None:
        raise ValueError(
            "attention implementation 'splash' takes no additive bias (ALiBi, T5, FIRE, "
            "KERPLE); use chunked (any backend) or pallas (TPU)")
    platform = platform_compiled_for()
    if platform != "tpu" and not interpret:
        raise RuntimeError(
            f"attention implementation 'splash' needs a TPU (jax backend is {platform!r}): use "
            "chunked (blockwise, any backend), xla or reference; tests run it with "
            "interpret=True")
    q_len, k_len = q.shape[1], k.shape[1]
    causal, window, segments = splash_parts(mask, q_len, k_len)
    for name, length in (("query", q_len), ("key", k_len)):
        if length % LANES:
            raise ValueError(
                f"attention implementation 'splash' needs {name} lengths that are a multiple "
                f"of {LANES}; got {length}: pad the sequence or use chunked")
    q = (q.astype(jnp.float32) * scale).astype(q.dtype)

    def kernel(q, k, v, ab, segments):  # [b, T, h, D] in and out, this shard's rows and heads
        del ab
        heads, kv_heads = q.shape[2], k.shape[2]
        run = _kernel(heads, kv_heads, q_len, k_len, causal, window, block, logit_softcap,
                      interpret)
        q_BHQD = q.transpose(0, 2, 1, 3)
        k_BNKD, v_BNKD = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        if kv_heads == 1:
            k_BNKD, v_BNKD = k_BNKD[:, 0], v_BNKD[:, 0]
        if segments is None:
            out = jax.vmap(lambda q, k, v: run(q, k, v))(q_BHQD, k_BNKD, v_BNKD)
        else:
            from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

            out = jax.vmap(lambda q, k, v, s_q, s_kv: run(q, k, v, segment_ids=SegmentIds(
                s_q, s_kv)))(q_BHQD, k_BNKD, v_BNKD, *segments)
        return out.transpose(0, 2, 1, 3)

    return per_shard(kernel, "splash", q, k, v, None, segments).astype(q.dtype)
