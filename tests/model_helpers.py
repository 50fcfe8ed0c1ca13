"""Tiny models shared by the model tests (small enough that each compile takes about a second)."""

import dataclasses

import flax.linen as nn
import jax
import numpy as np

from transformers_jax import ModelConfig, build_model
from transformers_jax.registry import ATTENTION, MASKS
from transformers_jax.registry import POSITIONS as POSITION_REGISTRY

# Every registered scheme and every implementation that runs here: a new entry is covered the
# moment it is registered.
POSITIONS = POSITION_REGISTRY.names()
CPU_ATTENTION = [name for name, impl in ATTENTION.items() if "cpu" in impl.backends]


def packed_rows(cut: np.ndarray, length: int) -> dict:
    """Two documents a row, the second from ``cut[row]``: segment ids 1 and 2, and positions
    restarting at the cut (what packing feeds the model)."""
    seg = (np.arange(length)[None] >= cut[:, None]).astype(np.int32) + 1
    positions = np.where(seg == 1, np.arange(length), np.arange(length) - cut[:, None])
    return {"segment_ids": seg, "positions": positions.astype(np.int32)}


def mask_settings(name: str, window: int = 3) -> dict:
    """The settings that make a small test of registered mask kind ``name`` meaningful: a
    window where the kind takes one."""
    fields = {f.name for f in dataclasses.fields(MASKS.get(name)) if f.init}
    return {"window": window} if "window" in fields else {}


def attention(name: str, chunk_size: int = 4):
    """An attention switch with small tiles, so tests cross tile edges."""
    return {"name": name, "chunk_size": chunk_size} if name == "chunked" else name


def tiny(**changes) -> ModelConfig:
    base = dict(vocab_size=32, d_model=32, n_layers=2, n_heads=4, max_len=16)
    return ModelConfig(**{**base, **changes})


def init(cfg, T=12, B=2, seed=0, **inputs):
    """(model, unboxed params, random tokens [B, T])."""
    model = build_model(cfg)
    tokens = jax.random.randint(jax.random.key(seed + 1), (B, T), 0, cfg.vocab_size)
    variables = model.init(jax.random.key(seed), tokens, **inputs)
    return model, nn.meta.unbox(variables["params"]), tokens


def assert_attention_implementations_agree(tiny, position, loss_for):
    """The one-layer GQA model of ``tiny(position=..., attention=impl, ...)`` gives the reference
    implementation's outputs and parameter gradients (a learned bias's gradient is the extra
    path the kernels must get right) through every implementation that runs on the CPU.
    Shared by the families, which differ only in their configs and inputs:
    ``loss_for(cfg) -> (loss, params)`` with ``loss(params) -> (scalar, outputs)``."""
    results = {}
    for impl in CPU_ATTENTION:
        cfg = tiny(position=position, attention=attention(impl), n_kv_heads=2, n_layers=1)
        loss, params = loss_for(cfg)
        results[impl] = jax.jit(jax.grad(loss, has_aux=True))(params)[::-1]
    ref_logits, ref_grads = results["reference"]
    for impl in CPU_ATTENTION:
        logits, grads = results[impl]
        np.testing.assert_allclose(logits, ref_logits, atol=1e-5, rtol=1e-5)
        if grads is not None:
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4),
                         grads, ref_grads)
