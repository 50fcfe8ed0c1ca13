"""``xla`` and ``cudnn``: ``jax.nn.dot_product_attention``, with XLA's fused-by-compiler
einsum and softmax, or cuDNN's fused flash attention (NVIDIA GPUs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from transformers_jax.nn.attention.api import as_4d, refuse_softcap
from transformers_jax.nn.attention.platform import platform_compiled_for
from transformers_jax.nn.masks import as_dense


def _jax_nn_attention(q, k, v, *, bias, mask, scale, logit_softcap, implementation):
    refuse_softcap(implementation, logit_softcap)
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
    )
