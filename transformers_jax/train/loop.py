"""The training loop behind ``tjax train``: data, jit-compiled steps, eval, logging, metrics."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from transformers_jax.config import ModelConfig, TrainConfig, check_lengths
from transformers_jax.data.batches import lm_batch, split_tokens
from transformers_jax.data.corpus import read_text
from transformers_jax.data.tokenizers import ByteTokenizer
from transformers_jax.models import build_model
from transformers_jax.nn.layers import count_params
from transformers_jax.train.flops import device_peak, flops_per_token
from transformers_jax.train.optim import learning_rate_schedule, make_optimizer
from transformers_jax.train.step import init_state, make_eval_step, make_train_step


def _mean_metrics(rows: list[dict]) -> dict[str, float]:
    return {k: float(np.mean([float(r[k]) for r in rows])) for k in rows[0]}


class MetricsLog:
    """Console lines (through tqdm, so the bar stays intact) and an optional JSONL file."""

    def __init__(self, run_dir: str | None, bar: tqdm | None):
        self.bar = bar
        self.file = None
        if run_dir:
            os.makedirs(run_dir, exist_ok=True)
            self.file = open(os.path.join(run_dir, "metrics.jsonl"), "a")  # noqa: SIM115

    def write(self, kind: str, step: int, values: dict[str, float], text: str) -> None:
        if self.file:
            self.file.write(json.dumps({"kind": kind, "step": step, **values}) + "\n")
            self.file.flush()
        (self.bar.write if self.bar is not None else print)(text, file=sys.stderr)

    def close(self) -> None:
        if self.file:
            self.file.close()


def evaluate(eval_step, params, batches: list[dict]) -> dict[str, float]:
    """Mean metrics over a fixed list of held-out batches."""
    rows = [eval_step(params, batch) for batch in batches]
    return _mean_metrics(jax.device_get(rows))


def train(model_cfg: ModelConfig, cfg: TrainConfig) -> dict[str, Any]:
    """Train a causal LM on ``cfg.data`` (or the default corpus); return the final metrics."""
    check_lengths(model_cfg, cfg.seq_len)
    tokenizer = ByteTokenizer()
    if model_cfg.vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"model.vocab_size={model_cfg.vocab_size} is smaller than the {tokenizer.name} "
            f"tokenizer's {tokenizer.vocab_size} ids; set model.vocab_size>="
            f"{tokenizer.vocab_size}"
        )
    splits = split_tokens(tokenizer.encode(read_text(cfg.data)), cfg.val_fraction, cfg.seq_len)

    model = build_model(model_cfg)
    schedule = learning_rate_schedule(cfg)
    optimizer = make_optimizer(cfg)
    prefix = model_cfg.mask == "prefix"

    def batch_at(tokens, seed, index):
        return lm_batch(tokens, cfg.batch_size, cfg.seq_len, seed, index, prefix=prefix)

    state = init_state(model, optimizer, cfg.seed, batch_at(splits.train, cfg.seed, 0))
    train_step = jax.jit(make_train_step(model, optimizer, schedule), donate_argnums=0)
    eval_step = jax.jit(make_eval_step(model))

    # The same held-out windows at every evaluation, so eval losses are comparable.
    eval_batches = [batch_at(splits.val, -1, i) for i in range(cfg.eval_batches)]
    n_params = count_params(state.params)
    flops = flops_per_token(model_cfg, cfg.seq_len)
    peak, peak_source = device_peak("bfloat16" if model_cfg.dtype == "bfloat16" else "float32")
    tokens_per_step = cfg.batch_size * cfg.seq_len

    bar = tqdm(total=cfg.steps, desc="train", disable=not cfg.progress, dynamic_ncols=True)
    log = MetricsLog(cfg.run_dir, bar if cfg.progress else None)
    log.write(
        "start",
        0,
        {"params": n_params, "flops_per_token": flops, "peak_flops": peak},
        f"{model_cfg.family}: {n_params / 1e6:.2f}M params, attention={model_cfg.attention}, "
        f"mask={model_cfg.mask}, position={model_cfg.position}; {len(splits.train):,} train / "
        f"{len(splits.val):,} val tokens; peak {peak / 1e9:.0f} GFLOP/s ({peak_source})",
    )

    history: list[dict] = []
    window: list[dict] = []
    compile_s = 0.0
    timed_s, timed_steps = 0.0, 0
    last_eval: dict[str, float] = {}
    t_window = time.perf_counter()
    for step in range(cfg.steps):
        batch = batch_at(splits.train, cfg.seed, step)
        start = time.perf_counter()
        state, metrics = train_step(state, batch)
        if step == 0:  # the first call compiles; keep it out of the throughput figures
            jax.block_until_ready(state)
            compile_s = time.perf_counter() - start
            t_window = time.perf_counter()
        if window:  # keep one step in flight, so the bar tracks finished steps
            jax.block_until_ready(window[-1]["loss"])
        window.append(metrics)
        bar.update(1)

        last = step + 1 == cfg.steps
        if (step + 1) % cfg.log_every == 0 or last:
            rows = jax.device_get(window)  # waits for the queued steps
            now = time.perf_counter()
            steps_timed = len(rows) - (1 if step + 1 == len(rows) else 0)
            elapsed = now - t_window
            timed_s, timed_steps = timed_s + elapsed, timed_steps + steps_timed
            tps = steps_timed * tokens_per_step / elapsed if steps_timed and elapsed else 0.0
            values = {**_mean_metrics(rows), "tokens_per_s": tps, "mfu": tps * flops / peak}
            history.append({"step": step + 1, **values})
            bar.set_postfix(loss=f"{values['loss']:.3f}", tok_s=f"{tps:,.0f}")
            log.write(
                "train",
                step + 1,
                values,
                f"step {step + 1:>6} | loss {values['loss']:.4f} | lr "
                f"{values['learning_rate']:.2e} | {tps:,.0f} tokens/s | MFU "
                f"{100 * values['mfu']:.1f}%",
            )
            window, t_window = [], time.perf_counter()

        if (step + 1) % cfg.eval_every == 0 or last:
            jax.block_until_ready(state)  # queued train steps count as training time
            t_eval = time.perf_counter()
            last_eval = evaluate(eval_step, state.params, eval_batches)
            log.write(
                "eval",
                step + 1,
                last_eval,
                f"step {step + 1:>6} | eval loss {last_eval['loss']:.4f} "
                f"({last_eval['loss'] / math.log(2):.3f} bits/byte)",
            )
            t_window += time.perf_counter() - t_eval  # eval time is not training throughput
    bar.close()

    tokens_per_s = timed_steps * tokens_per_step / timed_s if timed_s else 0.0
    final = {
        "steps": cfg.steps,
        "params": n_params,
        "train_loss": history[-1]["loss"],
        "eval_loss": last_eval.get("loss"),
        "eval_accuracy": last_eval.get("accuracy"),
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops / peak,
        "flops_per_token": flops,
        "peak_flops": peak,
        "peak_source": peak_source,
        "compile_s": compile_s,
        "device": jax.devices()[0].device_kind,
        "history": history,
    }
    log.write("final", cfg.steps, {k: v for k, v in final.items() if k != "history"},
              f"done: eval loss {final['eval_loss']:.4f}, {tokens_per_s:,.0f} tokens/s, "
              f"MFU {100 * final['mfu']:.1f}%, first step (compile) {compile_s:.1f}s")
    log.close()
    return final
