"""Side by side with Hugging Face ``transformers`` (PyTorch): the same models, the same shapes,
the same weights, in one process, alternating.

Prints one JSON object (and writes it with ``--out``): for each configuration, training
tokens/s of our float32 and bfloat16 steps against their float32 step, decoding tokens/s with
the KV cache against ``generate``, the per-token cost as the prefix grows, and every ratio
``ours / theirs`` (above 1: we are faster). Configurations (issue 9):

- ``a``: GPT-2 architecture, 4 layers, 4 heads, width 128, context 256, batch 16, vocab 65
  (``GPT2LMHeadModel`` from a ``GPT2Config``; ours: learned positions, gelu, layernorm, tied);
- ``b``: the same shape as a BERT masked LM (``BertForMaskedLM``; ours: family ``bert``);
- ``c``: GPT-2 small (12 x 12 x 768, vocab 50257): decoding at batch 1 and a few training steps.

How the comparison is kept fair:

- Both sides start from the same weights: the Hugging Face model is built from its config with
  a fixed seed, saved, and converted with ``transformers_jax.convert.load_hf`` (so our config is
  derived from theirs, not written by hand); the logits are compared before anything is timed.
- Training step = forward + backward + AdamW update on both sides, with the same objective
  (full-vocabulary logits, cross-entropy over every position for a GPT, over the chosen 15%
  for BERT), global-norm clipping at 1.0, weight decay 0.1 on matrices only, betas
  (0.9, 0.95), the same warm-up + cosine learning rate, dropout 0, float32 on their side with
  their default attention (``sdpa``). Our bfloat16 computes in bfloat16 with float32 master
  parameters and float32 accumulation.
- Both see the same batches (text of Python's documentation, characters mapped to the
  vocabulary), so the three loss curves can be compared (``--plot``).
- Each timed round runs one step of every contender, in turn, in this process; medians over
  the timed rounds (after ``--warmup`` rounds; our compile time is reported on its own).
- Decoding: greedy, their ``generate`` with its KV cache (``use_cache=True``, no stop token)
  against our compiled ``sample`` loop; both include the prefill. Runs alternate; medians.
  Our bfloat16 decoding stores the weights in bfloat16 (inference); theirs stays float32.
- ``torch.set_num_threads(--torch-threads)`` (2). ``OMP_WAIT_POLICY=PASSIVE`` is set before
  torch is imported unless you set it yourself: on this shared 2-core machine an actively
  spinning OpenMP barrier made their step up to 10x slower under load (BENCHMARKS.md), which
  would flatter us.

    python benchmarks/side_by_side.py                        # a, b, c (about 15-25 minutes)
    python benchmarks/side_by_side.py --configs a --rounds 150 --plot loss_a.png
    python benchmarks/side_by_side.py --tiny                 # a smoke run in seconds
    python benchmarks/side_by_side.py --attention-lengths    # attention alone: memory, speed
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from transformers_jax.bench import cpu_model, emit_json  # noqa: E402
from transformers_jax.config import TrainConfig  # noqa: E402
from transformers_jax.models import build_model  # noqa: E402
from transformers_jax.nn.kvcache import init_cache  # noqa: E402
from transformers_jax.train.flops import flops_per_token, measure_matmul_peak  # noqa: E402
from transformers_jax.train.optim import learning_rate_schedule, make_optimizer  # noqa: E402
from transformers_jax.train.step import TrainState, make_train_step  # noqa: E402

# ------------------------------------------------------------------------------------------
# The configurations


def configurations(tiny: bool) -> dict:
    """Shapes of configs a, b, c (``tiny``: the same code paths at a toy size, for tests)."""
    if tiny:
        small = dict(layers=1, heads=2, width=32, context=32, batch=2, vocab=65)
        return {
            "a": dict(kind="gpt", **small, decode_batches=(1, 2), prompt=4, new_tokens=12,
                      prefixes=(8, 16)),
            "b": dict(kind="bert", **small),
            "c": dict(kind="gpt", layers=2, heads=2, width=32, context=64, batch=2, vocab=300,
                      train_context=16, decode_batches=(1,), prompt=4, new_tokens=8,
                      prefixes=(8, 32)),
        }
    return {
        "a": dict(kind="gpt", layers=4, heads=4, width=128, context=256, batch=16, vocab=65,
                  decode_batches=(1, 8), prompt=16, new_tokens=240, prefixes=(32, 64, 128, 240)),
        "b": dict(kind="bert", layers=4, heads=4, width=128, context=256, batch=16, vocab=65),
        "c": dict(kind="gpt", layers=12, heads=12, width=768, context=1024, batch=4,
                  vocab=50257, train_context=128, decode_batches=(1,), prompt=16,
                  new_tokens=112, prefixes=(64, 256, 512, 1000)),
    }


def hf_model(shape: dict, seed: int):
    import torch
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    if shape["kind"] == "gpt":
        config = GPT2Config(
            vocab_size=shape["vocab"], n_positions=shape["context"], n_embd=shape["width"],
            n_layer=shape["layers"], n_head=shape["heads"], activation_function="gelu_new",
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
            eos_token_id=None, pad_token_id=None, tie_word_embeddings=True,
        )
        return GPT2LMHeadModel(config)
    config = BertConfig(
        vocab_size=shape["vocab"], hidden_size=shape["width"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], intermediate_size=4 * shape["width"],
        max_position_embeddings=shape["context"], hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, type_vocab_size=2, pad_token_id=0,
    )
    return BertForMaskedLM(config)


def converted(hf, attention: str, chunk: int):
    """Our config and params for the Hugging Face model ``hf`` (through a saved directory)."""
    from transformers_jax.convert.api import load_hf

    with tempfile.TemporaryDirectory() as directory:
        hf.save_pretrained(directory)
        checkpoint = load_hf(directory, attention=attention)
    config = checkpoint.config
    if hasattr(config.attention, "chunk_size"):  # a tiled kernel: the tile length asked for
        config = config.replace(attention=dataclasses.replace(config.attention, chunk_size=chunk))
    return config, jax.tree.map(jnp.asarray, checkpoint.params)


# ------------------------------------------------------------------------------------------
# Data: the same batches for every contender


def char_ids(vocab: int, reserved: int) -> np.ndarray:
    """The default corpus as ids: the ``vocab - reserved - 1`` most common characters, one id
    for every other character, and ``reserved`` ids left free at the top (BERT's [MASK])."""
    from transformers_jax.data.corpus import default_corpus

    text = default_corpus()
    common = [c for c, _ in collections.Counter(text).most_common(vocab - reserved - 1)]
    other = len(common)
    table = {c: i for i, c in enumerate(common)}
    return np.array([table.get(c, other) for c in text], np.int32)


def make_batches(shape: dict, rounds: int, seed: int) -> list[dict]:
    vocab, batch = shape["vocab"], shape["batch"]
    length = shape.get("train_context", shape["context"])
    rng = np.random.default_rng(seed)
    if shape["kind"] == "gpt":
        ids = char_ids(min(vocab, 65), 0)
        out = []
        for _ in range(rounds):
            starts = rng.integers(0, len(ids) - length - 1, batch)
            rows = np.stack([ids[s : s + length + 1] for s in starts])
            out.append({"inputs": rows[:, :-1], "targets": rows[:, 1:]})
        return out
    # BERT masked LM: 15% of positions chosen; of those 80% [MASK], 10% random, 10% unchanged.
    mask_id = vocab - 1
    ids = char_ids(vocab, 1)
    out = []
    for _ in range(rounds):
        starts = rng.integers(0, len(ids) - length, batch)
        rows = np.stack([ids[s : s + length] for s in starts])
        chosen = rng.random(rows.shape) < 0.15
        how = rng.random(rows.shape)
        inputs = np.where(chosen & (how < 0.8), mask_id, rows)
        random_ids = rng.integers(0, mask_id, rows.shape)
        inputs = np.where(chosen & (how >= 0.8) & (how < 0.9), random_ids, inputs)
        out.append({"inputs": inputs.astype(np.int32), "targets": rows,
                    "weights": chosen.astype(np.float32)})
    return out


# ------------------------------------------------------------------------------------------
# Training steps


class OurTrainer:
    """Our jitted train step (forward + backward + AdamW) on a converted model."""

    def __init__(self, config, params, train_cfg: TrainConfig, batch: dict, kind: str):
        from transformers_jax.train.objectives import OBJECTIVES

        self.config = config
        self.model = build_model(config)
        objective = OBJECTIVES.get("lm" if kind == "gpt" else "mlm")
        optimizer = make_optimizer(train_cfg)
        params = jax.tree.map(lambda x: jnp.array(x, jnp.dtype(config.param_dtype)), params)
        self.state = TrainState(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
            rng=jax.random.key_data(jax.random.key(0)),
        )
        step = jax.jit(
            make_train_step(self.model, optimizer, learning_rate_schedule(train_cfg), objective),
            donate_argnums=0,
        )
        start = time.perf_counter()
        self.compiled = step.lower(self.state, batch).compile()
        self.compile_s = time.perf_counter() - start
        memory = self.compiled.memory_analysis()
        self.temp_bytes = getattr(memory, "temp_size_in_bytes", None)

    def step(self, batch: dict) -> float:
        self.state, metrics = self.compiled(self.state, batch)
        return float(metrics["loss"])  # waits for the step


class TheirTrainer:
    """Their model in training mode with torch AdamW, matched to our optimizer."""

    def __init__(self, hf, train_cfg: TrainConfig, kind: str):
        import torch

        self.torch, self.hf, self.kind = torch, hf, kind
        hf.train()
        decay = [p for p in hf.parameters() if p.ndim >= 2]
        no_decay = [p for p in hf.parameters() if p.ndim < 2]
        self.params = decay + no_decay
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": train_cfg.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=train_cfg.learning_rate, betas=(train_cfg.b1, train_cfg.b2), eps=1e-8,
        )
        schedule = learning_rate_schedule(train_cfg)
        self.rates = [float(schedule(i)) for i in range(train_cfg.steps)]
        self.clip = train_cfg.grad_clip
        self.count = 0

    def step(self, batch: dict) -> float:
        torch = self.torch
        for group in self.optimizer.param_groups:
            group["lr"] = self.rates[min(self.count, len(self.rates) - 1)]
        self.count += 1
        logits = self.hf(input_ids=torch.from_numpy(batch["inputs"]).long()).logits
        targets = torch.from_numpy(np.asarray(batch["targets"])).long()
        if self.kind == "bert":
            targets = torch.where(torch.from_numpy(batch["weights"]) > 0, targets, -100)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.item())


def compare_training(shape: dict, hf, config, params, args, log) -> dict:
    """Alternate one step of each contender per round; medians over the timed rounds."""
    length = shape.get("train_context", shape["context"])
    warmup = shape.get("train_warmup", args.warmup)
    rounds = warmup + shape.get("train_rounds", args.rounds)
    train_cfg = TrainConfig(steps=rounds, batch_size=shape["batch"], seq_len=length,
                            learning_rate=args.learning_rate, warmup_steps=max(rounds // 10, 1))
    batches = make_batches(shape, rounds, seed=1)
    contenders = {}
    for name, dtype in (("ours_float32", "float32"), ("ours_bfloat16", "bfloat16")):
        if dtype not in args.dtypes:
            continue
        log(f"  compiling {name}")
        contenders[name] = OurTrainer(config.replace(dtype=dtype, param_dtype="float32"),
                                      params, train_cfg, batches[0], shape["kind"])
    # Train a copy: decoding later starts from the same (untrained) weights on both sides.
    contenders["theirs_float32"] = TheirTrainer(copy.deepcopy(hf), train_cfg, shape["kind"])
    times = {name: [] for name in contenders}
    losses = {name: [] for name in contenders}
    for i, batch in enumerate(batches):
        for name, trainer in contenders.items():
            start = time.perf_counter()
            loss = trainer.step(batch)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
            losses[name].append(loss)
        if i % 25 == 0 or i == len(batches) - 1:
            log(f"  round {i}: " + ", ".join(f"{n} {losses[n][-1]:.4f}" for n in contenders))
    tokens = shape["batch"] * length
    model_cfg = config
    flops = flops_per_token(model_cfg, length)
    out = {"batch": shape["batch"], "seq_len": length, "timed_rounds": len(times["theirs_float32"]),
           "warmup_rounds": warmup, "flops_per_token": flops}
    for name, ts in times.items():
        median = statistics.median(ts)
        entry = {"tokens_per_s": tokens / median, "step_ms_median": 1e3 * median,
                 "step_ms_min": 1e3 * min(ts), "final_loss": losses[name][-1]}
        if name.startswith("ours"):
            trainer = contenders[name]
            dtype = trainer.config.dtype
            peak = measure_matmul_peak(dtype)
            entry.update(compile_s=trainer.compile_s, compiled_temp_bytes=trainer.temp_bytes,
                         mfu=flops * tokens / median / peak, peak_flops=peak, peak_dtype=dtype)
        else:
            entry["mfu_vs_float32_peak"] = flops * tokens / median / measure_matmul_peak("float32")
        out[name] = entry
    theirs = out["theirs_float32"]["tokens_per_s"]
    for name in contenders:
        if name.startswith("ours"):
            out[f"ratio_{name[5:]}_vs_theirs_float32"] = out[name]["tokens_per_s"] / theirs
    out["losses"] = losses
    if "ours_bfloat16" in losses:
        out["bf16_tracking"] = loss_tracking(losses["ours_bfloat16"], losses["ours_float32"])
    out["ours_vs_theirs_float32_tracking"] = loss_tracking(
        losses["ours_float32"] if "ours_float32" in losses else losses["ours_bfloat16"],
        losses["theirs_float32"])
    return out


def loss_tracking(candidate: list[float], reference: list[float], tolerance: float = 0.02,
                  window: int = 10) -> dict:
    """How closely one loss curve follows another: the relative gap of their moving averages
    (``window`` steps), worst after the first ``window`` steps, and at the end. Tracking means
    the worst gap is within ``tolerance`` (2%)."""
    a = np.convolve(candidate, np.ones(window) / window, mode="valid")
    b = np.convolve(reference, np.ones(window) / window, mode="valid")
    if len(a) == 0:
        a, b = np.asarray(candidate), np.asarray(reference)
    gap = np.abs(a - b) / np.abs(b)
    return {"tolerance": tolerance, "window": window, "worst_relative_gap": float(gap.max()),
            "final_relative_gap": float(gap[-1]), "tracks": bool(gap.max() <= tolerance)}


# ------------------------------------------------------------------------------------------
# Decoding


def our_decoder(config, params, prompts: np.ndarray, new_tokens: int):
    """(run, compile seconds, prefill): ``run()`` greedy-decodes ``new_tokens`` after
    ``prompts`` with the KV cache, prefill included, and returns the new tokens."""
    from transformers_jax.sample import SamplingConfig, generate_tokens
    from transformers_jax.sample import prefill as start_decoding

    model = build_model(config)
    batch, prompt_len = prompts.shape
    lengths = jnp.full((batch,), prompt_len, jnp.int32)
    tokens = jnp.asarray(prompts, jnp.int32)
    greedy = SamplingConfig(max_new_tokens=new_tokens, temperature=0.0)

    def run():
        return jax.block_until_ready(generate_tokens(model, params, tokens, lengths,
                                                     jax.random.key(0), cfg=greedy))

    prefill_fn = jax.jit(lambda p, t, n: start_decoding(model, p, t, n, new_tokens)[0])

    def prefill():
        return jax.block_until_ready(prefill_fn(params, tokens, lengths))

    start = time.perf_counter()
    run()
    compile_s = time.perf_counter() - start
    prefill()
    return run, compile_s, prefill


def their_decoder(hf, prompts: np.ndarray, new_tokens: int):
    import torch
    from transformers import GenerationConfig

    hf.eval()
    ids = torch.from_numpy(prompts).long()
    attention = torch.ones_like(ids)

    def generate(n):
        config = GenerationConfig(max_new_tokens=n, do_sample=False, num_beams=1, use_cache=True,
                                  eos_token_id=None, pad_token_id=0)
        with torch.inference_mode():
            return hf.generate(input_ids=ids, attention_mask=attention, generation_config=config)

    return (lambda: generate(new_tokens)), (lambda: generate(1))


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def compare_decoding(shape: dict, hf, config, params, args, log) -> dict:
    out = {"prompt_len": shape["prompt"], "new_tokens": shape["new_tokens"]}
    vocab = shape["vocab"]
    rng = np.random.default_rng(2)
    for batch in shape["decode_batches"]:
        prompts = rng.integers(0, min(vocab, 65), (batch, shape["prompt"])).astype(np.int32)
        contenders = {}
        compile_s = {}
        for dtype in args.dtypes:
            # Inference: parameters stored in the compute dtype (bfloat16 weights are half the
            # bytes to stream per token); their side keeps float32.
            cfg = config.replace(dtype=dtype, param_dtype=dtype)
            cast = jax.tree.map(lambda x, t=dtype: x.astype(t), params)
            run, compile_s[dtype], prefill = our_decoder(cfg, cast, prompts, shape["new_tokens"])
            contenders[f"ours_{dtype}"] = (run, prefill)
        contenders["theirs_float32"] = their_decoder(hf, prompts, shape["new_tokens"])
        runs = {name: [] for name in contenders}
        firsts = {name: [] for name in contenders}
        tokens = {}
        for run, first in contenders.values():  # warm-up (their first call builds state)
            run()
            first()
        for _ in range(args.decode_repeats):
            for name, (run, first) in contenders.items():
                seconds, result = timed(run)
                runs[name].append(seconds)
                tokens[name] = np.asarray(result)
                firsts[name].append(timed(first)[0])
        new = batch * shape["new_tokens"]
        entry = {}
        for name in contenders:
            median = statistics.median(runs[name])
            entry[name] = {"tokens_per_s": new / median, "ms_per_token_step":
                           1e3 * median / shape["new_tokens"],
                           "time_to_first_token_ms": 1e3 * statistics.median(firsts[name])}
            if name.startswith("ours"):
                entry[name]["compile_s"] = compile_s[name[5:]]
        theirs = entry["theirs_float32"]["tokens_per_s"]
        for name in contenders:
            if name.startswith("ours"):
                entry[f"ratio_{name[5:]}_vs_theirs_float32"] = entry[name]["tokens_per_s"] / theirs
        their_new = tokens["theirs_float32"][:, shape["prompt"]:]
        if "ours_float32" in tokens:
            entry["greedy_tokens_identical_float32"] = float(
                np.mean(tokens["ours_float32"] == their_new))
        out[f"batch_{batch}"] = entry
        log(f"  decode batch {batch}: " + ", ".join(
            f"{n} {entry[n]['tokens_per_s']:.0f} tok/s" for n in contenders))
    out["per_token_by_prefix"] = per_token_by_prefix(shape, hf, config, params, args)
    return out


def per_token_by_prefix(shape: dict, hf, config, params, args) -> dict:
    """Milliseconds for one new token (batch 1) after a prefix of L tokens with the cache, as
    one call from Python on each side (both include their dispatch overhead). Each side keeps
    its cache in place across repeats (ours is donated to the step, theirs appends), so the
    prefix grows by one token per repeat on both sides."""
    import torch

    model = build_model(config)
    size = max(shape["prefixes"]) + args.prefix_repeats + 2
    prefill = jax.jit(lambda p, c, t: model.apply({"params": p}, t, c, method="decode_step"))
    step = jax.jit(lambda p, c, t: model.apply({"params": p}, t, c, method="decode_step"),
                   donate_argnums=1)
    rows = []
    rng = np.random.default_rng(3)
    hf.eval()
    for length in shape["prefixes"]:
        length = min(length, shape["context"] - args.prefix_repeats - 1)  # room to grow
        prefix = rng.integers(0, min(shape["vocab"], 65), (1, length)).astype(np.int32)
        _, cache = prefill(params, init_cache(config, 1, size), jnp.asarray(prefix[:, :-1]))
        token = jnp.asarray(prefix[:, -1:])
        ids = torch.from_numpy(prefix).long()
        ours_s, theirs_s = [], []
        with torch.inference_mode():
            their_cache = hf(input_ids=ids[:, :-1], use_cache=True).cache
            for i in range(args.prefix_repeats + 1):
                start = time.perf_counter()
                logits, cache = step(params, cache, token)
                jax.block_until_ready(logits)
                ours = time.perf_counter() - start
                start = time.perf_counter()
                hf(input_ids=ids[:, -1:], cache=their_cache, use_cache=True)
                theirs = time.perf_counter() - start
                if i:  # the first call compiles ours
                    ours_s.append(ours)
                    theirs_s.append(theirs)
        rows.append({"prefix": length, "ours_ms": 1e3 * statistics.median(ours_s),
                     "theirs_ms": 1e3 * statistics.median(theirs_s)})
    first, last = rows[0], rows[-1]
    return {"rows": rows, "growth_first_to_last": {
        "ours": last["ours_ms"] / first["ours_ms"],
        "theirs": last["theirs_ms"] / first["theirs_ms"]}}


# ------------------------------------------------------------------------------------------


def max_logit_difference(shape: dict, hf, config, params) -> float:
    import torch

    length = min(shape.get("train_context", shape["context"]), 64)
    tokens = np.random.default_rng(4).integers(0, min(shape["vocab"], 65), (2, length))
    hf.eval()
    with torch.inference_mode():
        theirs = hf(input_ids=torch.from_numpy(tokens).long()).logits.numpy()
    ours = build_model(config).apply({"params": params}, jnp.asarray(tokens, jnp.int32))
    return float(np.abs(np.asarray(ours) - theirs).max())


def versions() -> dict:
    import flax
    import optax
    import torch
    import transformers

    cpu = cpu_model()
    return {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "numpy": np.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "cpu": cpu, "cores": os.cpu_count(), "jax_device": jax.devices()[0].device_kind,
            "platform": jax.default_backend()}


def plot_losses(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [k for k in results["configs"] if "training" in results["configs"][k]]
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        losses = results["configs"][name]["training"]["losses"]
        for label, values in losses.items():
            ax.plot(values, label=label.replace("_", " "), linewidth=1)
        ax.set_title(f"config {name}: training loss, same weights and batches")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def targets(results: dict) -> dict:
    """The issue's targets, with the measured value and whether it was met."""
    out = {}
    configs = results["configs"]

    def add(name, target, value):
        if value is not None:
            out[name] = {"target": target, "measured": value, "met": value >= target}

    a = configs.get("a", {})
    train = a.get("training", {})
    add("a_train_float32_vs_theirs", 0.8, train.get("ratio_float32_vs_theirs_float32"))
    add("a_train_bfloat16_vs_theirs_float32", 1.0, train.get("ratio_bfloat16_vs_theirs_float32"))
    decode = a.get("decoding", {})
    add("a_decode_batch1_vs_generate", 5.0,
        decode.get("batch_1", {}).get("ratio_float32_vs_theirs_float32"))
    add("a_decode_batch8_vs_generate", 3.0,
        decode.get("batch_8", {}).get("ratio_float32_vs_theirs_float32"))
    c = configs.get("c", {}).get("decoding", {})
    add("c_decode_batch1_vs_generate", 1.3,
        c.get("batch_1", {}).get("ratio_float32_vs_theirs_float32"))
    if "ours_float32" in train:
        out["a_compile_s_below_3"] = {"target": 3.0, "measured": train["ours_float32"]["compile_s"],
                                      "met": train["ours_float32"]["compile_s"] < 3.0}
    if "bf16_tracking" in train:
        tracking = train["bf16_tracking"]
        out["a_bf16_loss_tracks_float32"] = {"target": tracking["tolerance"],
                                            "measured": tracking["worst_relative_gap"],
                                            "met": tracking["tracks"]}
    return out


def attention_lengths(args, log) -> dict:
    """Attention alone, causal, forward + backward: compiled temporary bytes from 1k to 16k
    tokens (memory_analysis; nothing is run) and speed at short lengths against xla and torch's
    ``scaled_dot_product_attention`` (4 heads of 32: config a's attention)."""
    import torch

    from transformers_jax.nn.attention import dot_product_attention
    from transformers_jax.nn.masks import build_mask

    heads, dim = 4, 32

    def grad_fn(impl, chunk):
        def loss(q, k, v, pos):
            mask = build_mask("causal", pos, pos)
            out = dot_product_attention(q, k, v, mask=mask, implementation=impl,
                                        chunk_size=chunk)
            return jnp.sum(out.astype(jnp.float32) ** 2)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    kernels = {"xla": ("xla", 128), "reference": ("reference", 128),
               "chunked_64": ("chunked", 64), "chunked_128": ("chunked", 128)}
    memory = []
    for length in args.memory_lengths:
        spec = jax.ShapeDtypeStruct((1, length, heads, dim), jnp.float32)
        pos = jax.ShapeDtypeStruct((1, length), jnp.int32)
        row = {"length": length, "one_score_matrix_bytes": 4 * heads * length * length}
        for name, (impl, chunk) in kernels.items():
            if name == "reference" and length > 4096:
                continue
            compiled = grad_fn(impl, chunk).lower(spec, spec, spec, pos).compile()
            row[f"{name}_temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
        memory.append(row)
        log(f"  memory at {length}: " + ", ".join(
            f"{k} {v / 2**20:.1f} MiB" for k, v in row.items() if k.endswith("bytes")))
    speed = []
    rng = np.random.default_rng(5)
    for length in args.speed_lengths:
        batch = max(4096 // length, 1)
        q, k, v = (jnp.asarray(rng.normal(size=(batch, length, heads, dim)), jnp.float32)
                   for _ in range(3))
        pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        fns = {name: grad_fn(impl, chunk) for name, (impl, chunk) in kernels.items()
               if name != "reference"}
        tq, tk, tv = (torch.tensor(np.asarray(x).transpose(0, 2, 1, 3), requires_grad=True)
                      for x in (q, k, v))

        def torch_sdpa(tq=tq, tk=tk, tv=tv):
            out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
            (out**2).sum().backward()

        contenders = {name: (lambda f=f, a=(q, k, v, pos): jax.block_until_ready(f(*a)))
                      for name, f in fns.items()}
        contenders["torch_sdpa"] = torch_sdpa
        for fn in contenders.values():
            fn()
        times = {name: [] for name in contenders}
        for _ in range(args.attention_repeats):
            for name, fn in contenders.items():
                times[name].append(timed(fn)[0])
        row = {"length": length, "batch": batch}
        row.update({f"{name}_ms": 1e3 * statistics.median(ts) for name, ts in times.items()})
        for name in ("chunked_64", "chunked_128", "torch_sdpa"):
            row[f"{name}_speedup_vs_xla"] = row["xla_ms"] / row[f"{name}_ms"]
        speed.append(row)
        log(f"  speed at {length}: " + ", ".join(
            f"{k} {v:.1f}" for k, v in row.items() if k.endswith("_ms")))
    return {"heads": heads, "head_dim": dim, "mask": "causal", "dtype": "float32",
            "memory_forward_backward": memory, "speed_forward_backward_4096_tokens": speed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="a,b,c", help="comma-separated subset of a,b,c")
    parser.add_argument("--rounds", type=int, default=40,
                        help="timed training rounds for a and b (one step of each contender "
                        "per round)")
    parser.add_argument("--c-rounds", type=int, default=3,
                        help="timed training rounds for c (after one warm-up round)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--decode-repeats", type=int, default=5)
    parser.add_argument("--prefix-repeats", type=int, default=10)
    parser.add_argument("--attention", default="chunked", help="our attention implementation")
    parser.add_argument("--chunk", type=int, default=64, help="our chunked attention tile")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="our compute dtypes")
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="toy sizes: a smoke run")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--plot", help="PNG of the loss curves of the trained configs")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--no-train", action="store_true", help="decoding only")
    parser.add_argument("--attention-lengths", action="store_true",
                        help="instead: attention alone, memory 1k-16k and speed at short lengths")
    parser.add_argument("--memory-lengths", default="1024,2048,4096,8192,16384")
    parser.add_argument("--speed-lengths", default="128,256,512,1024")
    parser.add_argument("--attention-repeats", type=int, default=15)
    args = parser.parse_args(argv)
    args.dtypes = tuple(args.dtypes.split(","))
    args.memory_lengths = [int(x) for x in filter(None, args.memory_lengths.split(","))]
    args.speed_lengths = [int(x) for x in filter(None, args.speed_lengths.split(","))]

    import torch

    torch.set_num_threads(args.torch_threads)

    def log(message):
        if not args.quiet:
            print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {message}",
                  file=sys.stderr, flush=True)

    shapes = configurations(args.tiny)
    results = {
        "command": "python benchmarks/side_by_side.py " + " ".join(argv or sys.argv[1:]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "load_average_start": list(os.getloadavg()),
        "versions": versions(),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "our_attention": {"implementation": args.attention, "chunk": args.chunk},
        "configs": {},
    }
    if args.attention_lengths:
        results["attention_lengths"] = attention_lengths(args, log)
        args.configs = ""
    for name in filter(None, args.configs.split(",")):
        shape = dict(shapes[name])
        log(f"config {name}: {shape}")
        if name == "c":
            shape["train_rounds"], shape["train_warmup"] = args.c_rounds, 1
        hf = hf_model(shape, args.seed)
        config, params = converted(hf, args.attention, args.chunk)
        entry = {"shape": shape, "our_config": {k: v for k, v in config.to_dict().items()
                                                 if k != "rope"},
                 "max_logit_difference_float32": max_logit_difference(shape, hf, config, params),
                 "load_average_before": list(os.getloadavg())}
        if not args.no_train:
            entry["training"] = compare_training(shape, hf, config, params, args, log)
        if shape["kind"] == "gpt":
            entry["decoding"] = compare_decoding(shape, hf, config, params, args, log)
        entry["load_average_after"] = list(os.getloadavg())
        results["configs"][name] = entry
        del hf
    results["load_average_end"] = list(os.getloadavg())
    results["targets"] = targets(results)
    if args.plot:
        plot_losses(results, args.plot)
        results["plot"] = args.plot
    emit_json(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
