"""What the ring's backward keeps, and what zigzag order costs in collectives: compiler figures
on 8 fake CPU devices (nothing is run), one JSON line per figure.

    python benchmarks/context_ring.py            # docs/scaling.md quotes its output
    python benchmarks/context_ring.py --time     # also wall-clock seconds (runs on the CPU)

- ``memory``: temporary bytes per device of the gradient of ring attention alone (B 1, T 8192,
  8 heads of 64, context 8), each step's scores kept (``recompute=False``) or recomputed.
- ``collectives``: the collective-permutes of a whole training step (1-layer GPT, width 32,
  4 x 64 tokens, data=2,context=4) by ``ring`` and ``ring_zigzag``, under the ``jit`` and
  ``shard_map`` strategies: the zigzag order's extra hops and bytes, and what each strategy
  adds around them (every kind's count).
- ``time`` (with ``--time``): seconds of that gradient at 1 x 4096 tokens, 4 heads of 32,
  on 4 fake CPU devices (all sharing this host's cores: no picture of the balance on real
  chips), median and range of 5 after a warm-up; and ``step_time``: seconds of a training
  step (2-layer GPT, width 64, 8 x 512 tokens, data=2,context=4) under ``jit`` and
  ``shard_map`` by each method.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from transformers_jax import ModelConfig, build_model  # noqa: E402
from transformers_jax.nn.masks import build_mask  # noqa: E402
from transformers_jax.parallel import make_trainer  # noqa: E402
from transformers_jax.parallel.context import ring_attention  # noqa: E402
from transformers_jax.plan.compiled import collectives  # noqa: E402


def ring_loss(recompute: bool, zigzag: bool, batch, length, dim, ways):
    """``(q, k, v) -> sum(out * q)`` of causal ring attention over ``ways`` devices."""
    mesh = jax.make_mesh((ways,), ("context",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:ways])
    pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))

    def loss(q, k, v):
        mask = build_mask("causal", pos, pos)

        def local(q, k, v, mask):
            return ring_attention(q, k, v, None, mask, axis="context", ways=ways, zigzag=zigzag,
                                  scale=dim**-0.5, recompute=recompute)[0]

        spec = P(None, "context")
        out = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, spec),
                            out_specs=spec)(q, k, v, mask)
        return jnp.sum(out * q)

    return loss


def ring_memory(recompute: bool, zigzag: bool, batch=1, length=8192, heads=8, dim=64, ways=8):
    """Per device: the bytes of the residuals the forward pass keeps for the backward (what
    ``jax.vjp`` holds), and the temporary bytes of the compiled gradient of
    ``sum(out * q)`` (forward and backward in one program), causal mask."""
    x = jax.ShapeDtypeStruct((batch, length, heads, dim), jnp.float32)
    loss = ring_loss(recompute, zigzag, batch, length, dim, ways)
    kept = jax.eval_shape(lambda q, k, v: jax.vjp(loss, q, k, v)[1], x, x, x)
    residual = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(kept))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
    return {"residual_bytes": residual // ways,  # global arrays, split over the devices
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes}


def ring_seconds(zigzag: bool, batch=1, length=4096, heads=4, dim=32, ways=4, runs=5):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(batch, length, heads, dim)), jnp.float32)
               for _ in range(3))
    grad = jax.jit(jax.grad(ring_loss(True, zigzag, batch, length, dim, ways), argnums=(0, 1, 2)))
    jax.block_until_ready(grad(q, k, v))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(grad(q, k, v))
        times.append(time.perf_counter() - start)
    return {"median_s": float(np.median(times)), "min_s": min(times), "max_s": max(times),
            "load_average": os.getloadavg()[0]}


def step_collectives(method: str, strategy: str = "jit", mesh_spec="data=2,context=4", batch=4,
                     length=64):
    """The step's collective-permutes, and how many collectives of every kind it has."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                      max_len=length)
    tokens = np.zeros((batch, length), np.int32)
    data = {"inputs": tokens, "targets": tokens, "weights": np.ones((batch, length), np.float32)}
    trainer = make_trainer(strategy, build_model(cfg), optax.sgd(0.1), data, mesh=mesh_spec,
                           context_attention=method)
    lowered = trainer.lower(trainer.abstract_state(), trainer.abstract_batch(data))
    found = collectives(lowered.compile().as_text(), 8)
    return {**found.get("collective-permute", {"count": 0, "ici_bytes": 0.0}),
            "all_kinds": {kind: figure["count"] for kind, figure in sorted(found.items())}}


def step_seconds(strategy: str, method: str, batch=8, length=512, runs=5):
    """Wall-clock seconds of a training step (2-layer GPT, width 64, rope) on data=2,context=4
    of fake CPU devices: median and range of ``runs`` after a warm-up."""
    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      max_len=length, position="rope")
    tokens = np.random.default_rng(0).integers(0, 256, (batch, length + 1)).astype(np.int32)
    data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "weights": np.ones((batch, length), np.float32)}
    trainer = make_trainer(strategy, build_model(cfg), optax.sgd(0.1), data,
                           mesh="data=2,context=4", context_attention=method)
    state, placed = trainer.init_state(0), trainer.place_batch(data)
    state, metrics = trainer.step(state, placed)
    jax.block_until_ready(metrics)
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        state, metrics = trainer.step(state, placed)
        jax.block_until_ready(metrics)
        seconds.append(time.perf_counter() - start)
    return {"median_s": float(np.median(seconds)), "min_s": min(seconds),
            "max_s": max(seconds), "load_average": os.getloadavg()[0]}


def main() -> None:
    for zigzag in (False, True):
        for recompute in (False, True):
            print(json.dumps({"figure": "memory", "zigzag": zigzag, "recompute": recompute,
                              **ring_memory(recompute, zigzag)}), flush=True)
    for strategy in ("jit", "shard_map"):
        for method in ("ring", "ring_zigzag"):
            print(json.dumps({"figure": "collectives", "strategy": strategy, "method": method,
                              **step_collectives(method, strategy)}), flush=True)
    if "--time" in sys.argv[1:]:
        for zigzag in (False, True):
            print(json.dumps({"figure": "time", "zigzag": zigzag, **ring_seconds(zigzag)}),
                  flush=True)
        for strategy in ("jit", "shard_map"):
            for method in ("ring", "ring_zigzag", "all_gather"):
                print(json.dumps({"figure": "step_time", "strategy": strategy,
                                  "method": method, **step_seconds(strategy, method)}),
                      flush=True)


if __name__ == "__main__":
    main()
