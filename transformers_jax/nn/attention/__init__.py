"""Scaled dot-product attention, several ways, all agreeing with one plain reference.

Shape legend: B batch, Q query length, K key length, H query heads, N key/value heads,
G = H // N query heads per key/value head, D head dimension.

q is ``[B, Q, H, D]``, k and v are ``[B, K, N, D]``; query head h reads key/value head
``h // G`` (the usual contiguous grouping: MHA when N == H, GQA when 1 < N < H, MQA when N == 1).
Grouped heads are handled by reshaping q to ``[B, Q, N, G, D]``, never by repeating k and v.

For every implementation the scores are, in this order::

    s = scale * q.k                      # scale defaults to 1/sqrt(D)
    s = cap * tanh(s / cap)              # only with logit_softcap (Gemma 2)
    s = s + bias                         # additive: ALiBi, T5, FIRE
    p = softmax(s) over visible keys     # float32, whatever the input dtype
    out = p @ v

A query that sees no key at all (a padded query, an empty segment) gets an output of exactly
zero, and zero gradients, rather than NaN or an average of masked values.

The API (``dot_product_attention``, ``attend_to_cache``, the ``AttentionImpl`` base every
implementation extends) is in ``api.py``; each implementation, registered in
``registry.ATTENTION``, is one file:

- ``reference.py``: einsum + softmax over the whole ``[Q, K]`` score matrix; the oracle (and
  ``attention_weights``, its softmax weights, for inspection).
- ``jax_nn.py``: ``xla`` and ``cudnn``, ``jax.nn.dot_product_attention`` with
  ``implementation="xla"`` or ``"cudnn"`` (NVIDIA GPUs only).
- ``chunked.py``: blockwise online softmax (flash attention) in pure JAX with its own backward
  pass; memory linear in the sequence length, runs on any backend.
- ``pallas.py``: the Pallas flash-attention kernels shipped with JAX, TPU (and NVIDIA GPU via
  Triton) only; causal/segment masks; a clear error on other backends.

``platform.py`` holds what the kernels ask about where they run. Adding an implementation: a
new file with an ``AttentionImpl`` subclass decorated with ``@ATTENTION.register("name")``, and
one import line in ``load_attention`` of ``transformers_jax/builtins.py``.
"""

from transformers_jax.nn.attention.api import (
    AttentionImpl,
    Mask,
    attend_to_cache,
    dot_product_attention,
)
from transformers_jax.nn.attention.chunked import Chunked, chunked_attention
from transformers_jax.nn.attention.jax_nn import Cudnn, Xla, cudnn_attention, xla_attention
from transformers_jax.nn.attention.pallas import Pallas, pallas_attention
from transformers_jax.nn.attention.reference import (
    Reference,
    attention_weights,
    reference_attention,
    reference_probs,
)
from transformers_jax.registry import ATTENTION

__all__ = [
    "ATTENTION", "AttentionImpl", "Chunked", "Cudnn", "Mask", "Pallas", "Reference", "Xla",
    "attend_to_cache", "attention_weights", "chunked_attention", "cudnn_attention",
    "dot_product_attention", "pallas_attention", "reference_attention", "reference_probs",
    "xla_attention",
]
