"""``xla`` and ``cudnn``: ``jax.nn.dot_product_attention``, with XLA's fused-by-compiler
einsum and softmax, or cuDNN's fused flash attention (NVIDIA GPUs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from transformers_jax.nn.attention.api import as_4d, refuse_softcap
from transformers_jax.nn.attention.platform import platform_compiled_for
from transformers_jax.nn.masks import AttentionMask, as_dense


def index_rule(mask, q_len: int, k_len: int) -> dict | None:
    """``jax.nn``'s own arguments for ``mask`` when it is a causal rule (a sliding window of W
    included) over positions 0..T-1 in every row, with no padding, segments or prefix: the
    kernel then masks by index and no ``[B, 1, Q, K]`` mask is built or read (for cuDNN, a
    mask is an extra input the size of the scores). None for any other mask."""
    if not isinstance(mask, AttentionMask) or not (mask.causal and mask.aligned):
        return None
    if q_len != k_len or mask.prefix_len is not None or mask.kv_valid is not None or (
            mask.q_segments is not None or mask.kv_segments is not None):
        return None
    # sliding_window_mask keeps q - k < W: W - 1 keys back and the query's own
    window = None if mask.window is None else (mask.window - 1, 0)
    return {"is_causal": True, "local_window_size": window}


def _jax_nn_attention(q, k, v, *, bias, mask, scale, logit_softcap, implementation,
                      by_index: bool = False):
    refuse_softcap(implementation, logit_softcap)
    rule = index_rule(mask, q.shape[1], k.shape[1]) if by_index else None
    if rule is not None:  # every query sees itself: no row to zero
        bias = None if bias is None else as_4d(bias)
        return jax.nn.dot_product_attention(q, k, v, bias=bias, scale=scale,
                                            implementation=implementation, **rule)
    mask = as_dense(mask)
    mask = None if mask is None else as_4d(mask)
    bias = None if bias is None else as_4d(bias)
    out = jax.nn.dot_product_attention(
        q, k, v, bias=bias, mask=mask, scale=scale, implementation=implementation
    )
    if mask is not None:
        # jax.nn fills masked scores with a large negative number, so a query that sees no
        # key gets the average of v; make it zero like the other implementations.
        seen = jnp.any(mask, axis=-1).transpose(0, 2, 1)[..., None]  # [B|1, Q, H|1, 1]
        out = jnp.where(seen, out, jnp.zeros_like(out))
    return out


def xla_attention(q, k, v, *, bias, mask, scale, logit_softcap, chunk_size=None):
    """``jax.nn.dot_product_attention`` with XLA's fused-by-compiler einsum/softmax."""
    del chunk_size
    return _jax_nn_attention(
        q,
        k,
        v,
        bias=bias,
        mask=mask,
        scale=scale,
        logit_softcap=logit_softcap,
        implementation="xla",
    )


def cudnn_attention(q, k, v, *, bias, mask, scale, logit_softcap, chunk_size=None):
    """cuDNN's fused flash attention through ``jax.nn``; NVIDIA GPUs, bf16/fp16 inputs."""
    del chunk_size
    refuse_softcap("cudnn", logit_softcap)
    platform = platform_compiled_for()
    if platform != "gpu":
        raise RuntimeError(
            f"attention implementation 'cudnn' needs an NVIDIA GPU (jax backend is "
            f"{platform!r}); use xla, chunked or reference"
        )
    return _jax_nn_attention(
        q,
        k,
        v,
        bias=bias,
        mask=mask,
        scale=scale,
        logit_softcap=logit_softcap,
        implementation="cudnn",
        by_index=True,
    )
