"""The JAX side of ``side_by_side.py``, one process per call; never imports torch.

    python benchmarks/side_by_side_jax.py prepare --dir D --shape a --steps 33
    python benchmarks/side_by_side_jax.py run --dir D [--dtype bfloat16] [--warmup 3] [--check]

``prepare`` writes what every contender starts from (``side_by_side_shared.py`` names the
files): our model's initial parameters exported to the GPT-2 layout with
``transformers_jax.convert.save_hf`` (Hugging Face and the plain PyTorch GPT load them), the
training batches (characters of Python's documentation), the learning rate of every step (our
schedule), the decoding prompts, and the optimizer's hyper-parameters.

``run`` converts the exported weights back with ``load_hf`` (so every contender holds the same
numbers), trains them with our jitted AdamW step on those batches, decodes greedily with our
compiled KV-cache loop, and prints one JSON object: losses, step times, tokens/s, the greedy
tokens, compile time, versions and the process's threads and load. ``--check``: no timing.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from side_by_side_shared import (
    DATA_FILE,
    HF_DIR,
    PLAN_FILE,
    SHAPES,
    add_run_options,
    emit,
    forbidden_imports,
    median,
    process_facts,
    read_plan,
    time_decoding,
)

from transformers_jax.backends import cpu_malloc as host_memory
from transformers_jax.config import TrainConfig


def train_config(plan: dict) -> TrainConfig:
    shape, hyper = plan["shape"], plan["optimizer"]
    return TrainConfig(steps=plan["steps"], batch_size=shape["batch"], seq_len=shape["train_len"],
                       learning_rate=hyper["learning_rate"], warmup_steps=hyper["warmup_steps"])


def char_ids(vocab: int, reserved: int = 0) -> np.ndarray:
    """The default corpus as ids: the ``vocab - reserved - 1`` most common characters, one id
    for every other character, ``reserved`` ids left free at the top (BERT's [MASK])."""
    from transformers_jax.data.corpus import default_corpus

    text = default_corpus()
    common = [c for c, _ in collections.Counter(text).most_common(vocab - reserved - 1)]
    table = {c: i for i, c in enumerate(common)}
    return np.array([table.get(c, len(common)) for c in text], np.int32)


def hf_layout(shape: dict) -> tuple[dict, dict]:
    """(Hugging Face config, the ``base_config`` to export with) of a GPT-2 or BERT shape, so
    that our weights have a Hugging Face (and, for GPT-2, plain PyTorch) layout."""
    if shape["kind"] == "gpt":
        # No bos/eos ids: GPT-2's defaults (50256) lie outside a small vocabulary.
        base = {"model_type": "gpt2", "bos_token_id": None, "eos_token_id": None,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
        return {**base, "vocab_size": shape["vocab"], "n_positions": shape["context"],
                "n_embd": shape["width"], "n_layer": shape["layers"], "n_head": shape["heads"],
                "activation_function": "gelu_new", "tie_word_embeddings": True}, base
    base = {"model_type": "bert", "architectures": ["BertForMaskedLM"], "pad_token_id": 0,
            "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    return {**base, "vocab_size": shape["vocab"], "hidden_size": shape["width"],
            "num_hidden_layers": shape["layers"], "num_attention_heads": shape["heads"],
            "intermediate_size": 4 * shape["width"], "max_position_embeddings": shape["context"],
            "type_vocab_size": 2, "hidden_act": "gelu", "layer_norm_eps": 1e-12}, base


def make_batches(shape: dict, steps: int, rng) -> dict:
    """``[steps, B, T]`` arrays: next-token inputs and targets for a GPT; for BERT, 15% of
    positions chosen (of those 80% [MASK], 10% a random id, 10% unchanged) with their weights."""
    length, batch = shape["train_len"], shape["batch"]
    if shape["kind"] == "gpt":
        ids = char_ids(min(shape["vocab"], 65))
        starts = rng.integers(0, len(ids) - length - 1, (steps, batch))
        rows = ids[starts[..., None] + np.arange(length + 1)]  # [steps, B, T + 1]
        return {"inputs": rows[..., :-1], "targets": rows[..., 1:]}
    mask_id = shape["vocab"] - 1
    ids = char_ids(shape["vocab"], reserved=1)
    starts = rng.integers(0, len(ids) - length, (steps, batch))
    rows = ids[starts[..., None] + np.arange(length)]
    chosen = rng.random(rows.shape) < 0.15
    how = rng.random(rows.shape)
    inputs = np.where(chosen & (how < 0.8), mask_id, rows)
    random_ids = rng.integers(0, mask_id, rows.shape)
    inputs = np.where(chosen & (how >= 0.8) & (how < 0.9), random_ids, inputs)
    return {"inputs": inputs.astype(np.int32), "targets": rows,
            "weights": chosen.astype(np.float32)}


def prepare(args) -> int:
    from transformers_jax.convert.api import save_hf
    from transformers_jax.convert.common import architecture_for
    from transformers_jax.learning.objectives import objective_for
    from transformers_jax.learning.optim import learning_rate_schedule
    from transformers_jax.models import build_model

    shape = SHAPES[args.shape]
    raw, base = hf_layout(shape)
    config = architecture_for(raw)[0].config_from_hf(raw)
    model = build_model(config)
    rng = np.random.default_rng(args.seed + 1)
    arrays = make_batches(shape, args.steps, rng)
    objective = objective_for(config.family)
    # one compiled program: op by op, the init compiles each of its ~100 operations
    init = jax.jit(lambda key, batch: objective.init_params(model, key, batch))
    params = init(jax.random.key(args.seed), {k: v[0] for k, v in arrays.items()})
    os.makedirs(args.dir, exist_ok=True)
    save_hf(os.path.join(args.dir, HF_DIR), config, params, base_config=base)
    hyper = TrainConfig()
    plan = {"shape": {"name": args.shape, **shape}, "steps": args.steps, "seed": args.seed,
            "optimizer": {"name": "AdamW", "learning_rate": args.learning_rate,
                          "warmup_steps": max(args.steps // 10, 1), "schedule":
                          "linear warm-up, cosine decay (transformers_jax.learning.optim)",
                          "b1": hyper.b1, "b2": hyper.b2, "eps": 1e-8,
                          "weight_decay": hyper.weight_decay, "weight_decay_on": "ndim >= 2",
                          "grad_clip_global_norm": hyper.grad_clip},
            "objective": ("next-token cross-entropy over every position" if shape["kind"] ==
                          "gpt" else "masked-LM cross-entropy over the 15% chosen positions") +
                         ", full-vocabulary logits",
            "data": "characters of Python's documentation (pydoc_data), random windows"}
    schedule = learning_rate_schedule(train_config(plan))
    arrays["learning_rates"] = np.array([float(schedule(i)) for i in range(args.steps)])
    for b in shape["decode_batches"]:
        arrays[f"prompts_b{b}"] = rng.integers(0, min(shape["vocab"], 65),
                                               (b, shape["prompt"])).astype(np.int32)
    np.savez(os.path.join(args.dir, DATA_FILE), **arrays)
    import json

    with open(os.path.join(args.dir, PLAN_FILE), "w") as f:
        json.dump(plan, f, indent=1)
    print(json.dumps({"prepared": args.dir, "torch_imported": forbidden_imports("torch")}))
    return 0


def load_converted(directory: str, attention: str, chunk: int):
    from transformers_jax.convert.api import load_hf

    checkpoint = load_hf(os.path.join(directory, HF_DIR), attention=attention)
    config = checkpoint.config
    if hasattr(config.attention, "chunk_size"):  # a tiled kernel: the tile length asked for
        config = config.replace(attention=dataclasses.replace(config.attention, chunk_size=chunk))
    return config, jax.tree.map(jnp.asarray, checkpoint.params)


def train(config, params, plan: dict, arrays: dict, warmup: int, timed: bool,
          groups: int = 1) -> dict:
    from transformers_jax.learning.objectives import objective_for
    from transformers_jax.learning.optim import learning_rate_schedule, make_optimizer
    from transformers_jax.learning.step import TrainState, make_train_step
    from transformers_jax.models import build_model

    cfg = train_config(plan)
    model = build_model(config)
    optimizer = make_optimizer(cfg)
    params = jax.tree.map(lambda x: jnp.array(x, jnp.dtype(config.param_dtype)), params)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                       opt_state=optimizer.init(params),
                       rng=jax.random.key_data(jax.random.key(0)))
    step = jax.jit(make_train_step(model, optimizer, learning_rate_schedule(cfg),
                                   objective_for(config.family), groups=groups),
                   donate_argnums=0)
    keys = [k for k in ("inputs", "targets", "weights") if k in arrays]
    batches = [{k: arrays[k][i] for k in keys} for i in range(plan["steps"])]
    start = time.perf_counter()
    compiled = step.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - start
    losses, seconds, rates = [], [], []
    for batch in batches:
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss"]))  # waits for the step
        seconds.append(time.perf_counter() - start)
        rates.append(float(metrics["learning_rate"]))
    out = {"losses": losses, "learning_rates": rates}
    if timed:
        timed_s = seconds[warmup:]
        tokens = plan["shape"]["batch"] * plan["shape"]["train_len"]
        out.update(tokens_per_s=tokens / median(timed_s), step_s=timed_s, warmup_steps=warmup,
                   compile_s=compile_s)
    return out


def decode(config, params, plan: dict, arrays: dict, repeats: int, timed: bool) -> dict:
    from transformers_jax.models import build_model
    from transformers_jax.sample import SamplingConfig, generate_tokens

    model = build_model(config)
    new = plan["shape"]["new_tokens"]
    greedy = SamplingConfig(max_new_tokens=new, temperature=0.0)
    out = {}
    for b in plan["shape"]["decode_batches"]:
        prompts = jnp.asarray(arrays[f"prompts_b{b}"])
        lengths = jnp.full((b,), prompts.shape[1], jnp.int32)

        def run(prompts=prompts, lengths=lengths):
            return jax.block_until_ready(generate_tokens(model, params, prompts, lengths,
                                                         jax.random.key(0), cfg=greedy))

        out[f"batch_{b}"] = time_decoding(run, lambda t: np.asarray(t).tolist(), b * new,
                                          repeats, timed)
    return out


def versions() -> dict:
    import flax
    import jaxlib
    import optax

    from transformers_jax import __version__

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
            "optax": optax.__version__, "numpy": np.__version__, "transformers_jax": __version__}


def run(args) -> int:
    facts_start = process_facts()
    plan, arrays = read_plan(args.dir)
    config, params = load_converted(args.dir, args.attention, args.chunk)
    grouped = f"_g{args.groups}" if args.groups > 1 else ""
    result = {"contender": f"jax_{args.dtype}{grouped}", "library": "transformers_jax",
              "concurrent_groups": args.groups,
              "host_malloc": host_memory.status(),  # set as tjax sets it: see main()
              "attention": {"implementation": args.attention, "chunk": args.chunk},
              "dtype": args.dtype, "timed": not args.check}
    if not args.no_train:
        result["training"] = train(config.replace(dtype=args.dtype, param_dtype="float32"),
                                   params, plan, arrays, args.warmup, not args.check,
                                   args.groups)
    if not args.no_decode and plan["shape"]["decode_batches"]:
        # Inference: parameters stored in the compute dtype.
        cast = jax.tree.map(lambda x: x.astype(args.dtype), params)
        result["decoding"] = decode(config.replace(dtype=args.dtype, param_dtype=args.dtype),
                                    cast, plan, arrays, args.decode_repeats, not args.check)
    result.update(process_start=facts_start, process_end=process_facts(), versions=versions(),
                  threads={"xla_cpu_devices": jax.device_count(),
                           "note": "XLA:CPU's own thread pool, one thread per allowed CPU"},
                  device=jax.devices()[0].device_kind, platform=jax.default_backend(),
                  torch_imported=forbidden_imports("torch"))
    emit(result, args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--dir", required=True)
    p.add_argument("--shape", choices=sorted(SHAPES), default="a")
    p.add_argument("--steps", type=int, required=True, help="training steps of every process")
    p.add_argument("--learning-rate", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run")
    r.add_argument("--dir", required=True)
    r.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    r.add_argument("--attention", default="chunked")
    r.add_argument("--chunk", type=int, default=64)
    r.add_argument("--groups", type=int, default=1,
                   help="train.concurrent_groups: the batch as this many independent row groups")
    r.add_argument("--host-malloc", choices=("default", "reuse"), default="default",
                   help="reuse: run as under TJAX_HOST_MALLOC=reuse (transformers_jax/"
                        "backends/cpu_malloc.py)")
    add_run_options(r)
    args = parser.parse_args(argv)
    if args.command == "run":  # as every tjax command runs
        if args.host_malloc == "reuse":  # the driver removed TJAX_HOST_MALLOC: set it here
            os.environ[host_memory.OPT_OUT] = "reuse"
        host_memory.relaunch_with_tunables()
    return prepare(args) if args.command == "prepare" else run(args)


if __name__ == "__main__":
    sys.exit(main())
