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

The API (``dot_product_attention``, ``attend_to_cache``) is in ``api.py``; the config's switch,
``AttentionImpl`` and one entry per implementation (what it supports; ``attend`` calls its
kernel), in ``implementations.py``; each kernel is one file:

- ``reference.py``: einsum + softmax over the whole ``[Q, K]`` score matrix; the oracle (and
  ``attention_weights``, its softmax weights, for inspection).
- ``jax_nn.py``: ``xla`` and ``cudnn``, ``jax.nn.dot_product_attention`` with
  ``implementation="xla"`` or ``"cudnn"`` (NVIDIA GPUs only).
- ``chunked.py``: blockwise online softmax (flash attention) in pure JAX with its own backward
  pass; memory linear in the sequence length, runs on any backend.
- ``pallas.py``: the Pallas flash-attention kernels shipped with JAX, TPU (and NVIDIA GPU via
  Triton) only; causal/segment masks; a clear error on other backends.
- ``splash.py``: JAX's Pallas TPU splash attention: causal, sliding-window and segment masks,
  soft-capping, grouped heads; an interpreter mode (``interpret=True``) for tests on any backend.

``platform.py`` holds what the kernels ask about where they run, ``per_shard.py`` how a Pallas
kernel is mapped over the devices' shards. Adding an implementation: a
new file with its kernel and an ``AttentionImpl`` subclass decorated with
``@ATTENTION.register("name")`` whose ``attend`` calls it, and one import line in
``load_attention`` of ``transformers_jax/builtins.py``. The names below load on first use: a
config imports ``implementations.py``, and so this package, without JAX.
"""

from __future__ import annotations

from transformers_jax.lazy import lazy_exports

# public name -> the module that defines it
_EXPORTS = {
    "ATTENTION": "transformers_jax.registry",
    "Mask": "transformers_jax.nn.attention.api",
    "across_shards": "transformers_jax.nn.attention.api",
    "attend_to_cache": "transformers_jax.nn.attention.api",
    "dot_product_attention": "transformers_jax.nn.attention.api",
    "every_key": "transformers_jax.nn.attention.api",
    "AttentionImpl": "transformers_jax.nn.attention.implementations",
    "Chunked": "transformers_jax.nn.attention.implementations",
    "Cudnn": "transformers_jax.nn.attention.implementations",
    "Pallas": "transformers_jax.nn.attention.implementations",
    "Reference": "transformers_jax.nn.attention.implementations",
    "Splash": "transformers_jax.nn.attention.implementations",
    "Xla": "transformers_jax.nn.attention.implementations",
    "chunked_attention": "transformers_jax.nn.attention.chunked",
    "cudnn_attention": "transformers_jax.nn.attention.jax_nn",
    "xla_attention": "transformers_jax.nn.attention.jax_nn",
    "pallas_attention": "transformers_jax.nn.attention.pallas",
    "splash_attention": "transformers_jax.nn.attention.splash",
    "attention_weights": "transformers_jax.nn.attention.reference",
    "reference_attention": "transformers_jax.nn.attention.reference",
    "reference_probs": "transformers_jax.nn.attention.reference",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports("transformers_jax.nn.attention", _EXPORTS, globals())
