"""A/B of the two orders of a batch-1 decoding step (``nn.kvcache.RowSlot``).

``read_first`` (the default at batch 1): attend over the cache as it was plus the new token,
then write the token in place. ``write_first`` (the default at batch > 1): write, then attend
over the written cache. Both compiled generate loops run alternately (config a: 4 x 4 x 128,
vocab 65; prompt 16, 1000 new tokens, a 1,024-slot cache); the greedy tokens must agree. Prints
medians as JSON.

    python benchmarks/decode_order_ab.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformers_jax import ModelConfig, build_model
from transformers_jax.models import gpt as gpt_module
from transformers_jax.nn import kvcache
from transformers_jax.sample import DECODE_COMPILER_OPTIONS, SamplingConfig, generate_tokens

ORIGINAL = kvcache.plan_step


def write_first(cache, n_new, lengths):
    step = ORIGINAL(cache, n_new, lengths)
    if isinstance(step.write, kvcache.RowSlot) and step.write.read_first:
        step = step._replace(kv_positions=step.meta["positions"], kv_valid=step.meta["valid"],
                             write=step.write._replace(read_first=False))
    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    cfg = ModelConfig(family="gpt", vocab_size=65, d_model=128, n_layers=4, n_heads=4,
                      max_len=1024)
    model = build_model(cfg)
    tokens = jnp.zeros((1, 16), jnp.int32)
    lengths = jnp.array([16], jnp.int32)
    params = nn.meta.unbox(model.init(jax.random.key(0), tokens)["params"])
    sampling = SamplingConfig(max_new_tokens=1000, temperature=0.0)
    runs, outputs = {}, {}
    for name, plan in (("read_first", ORIGINAL), ("write_first", write_first)):
        gpt_module.plan_step = plan  # traced now, so each compiled loop keeps its order
        run = jax.jit(lambda p, t, n, k: generate_tokens.__wrapped__(
            model, p, t, n, k, cfg=sampling), compiler_options=DECODE_COMPILER_OPTIONS)
        outputs[name] = run(params, tokens, lengths, jax.random.key(0)).block_until_ready()
        runs[name] = run
    gpt_module.plan_step = ORIGINAL
    assert (outputs["read_first"] == outputs["write_first"]).all(), "orders disagree"
    times: dict[str, list[float]] = {name: [] for name in runs}
    load_start = os.getloadavg()
    for _ in range(args.repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run(params, tokens, lengths, jax.random.key(0)).block_until_ready()
            times[name].append(time.perf_counter() - start)
    print(json.dumps({
        "command": "python benchmarks/decode_order_ab.py",
        "decode_tokens_per_s_batch_1": {k: round(1000 / statistics.median(v))
                                        for k, v in times.items()},
        "greedy_tokens_identical": True,
        "load_average_start": load_start, "load_average_end": os.getloadavg(),
        "jax": jax.__version__, "device": str(jax.devices()[0]),
    }, indent=1))


if __name__ == "__main__":
    main()
