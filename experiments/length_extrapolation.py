"""Experiment 1: length extrapolation on text, for every position scheme.

Train a GPT at a short context, then measure held-out loss at 1x, 2x, 4x and 8x that length,
with non-overlapping windows (every token scored) and sliding windows (stride L/4: each scored
token sees at least 3L/4 tokens of context). The published result to echo (Press et al. 2022,
ALiBi, WikiText-103): sinusoidal and rotary degrade quickly past the training length, T5 bias
less, ALiBi stays flat; a learned table cannot go past its length at all.

    python -m experiments.length_extrapolation          # default: 2 seeds, ~6 min on 2 cores
    python -m experiments.length_extrapolation --scale large   # a GPU/TPU-sized run
    python -m experiments.length_extrapolation --data tfds:tiny_shakespeare --seeds 3
"""

from __future__ import annotations

import argparse
import math

from experiments.common import (
    eval_loss,
    markdown_table,
    mean_std,
    text_tokens,
    train_and_load,
    unigram_loss,
    write_results,
)
from transformers_jax import ModelConfig, TrainConfig

SCHEMES = ["none", "sinusoidal", "learned", "rope", "alibi", "t5", "fire"]

SCALES = {
    # name: (model fields, train fields, eval multiples, held-out tokens)
    "tiny": (dict(d_model=32, n_layers=1, n_heads=2), dict(steps=20, batch_size=4, seq_len=16),
             (1, 2), 2_000),
    "default": (dict(d_model=128, n_layers=3, n_heads=4), dict(steps=400, batch_size=16,
                seq_len=64), (1, 2, 4, 8), 24_000),
    "large": (dict(d_model=512, n_layers=8, n_heads=8), dict(steps=5000, batch_size=64,
              seq_len=256), (1, 2, 4, 8, 16), 400_000),
}


def run(scale: str, seeds: int, schemes: list[str], data: str | None) -> dict:
    model_fields, train_fields, multiples, n_eval = SCALES[scale]
    train_len = train_fields["seq_len"]
    lengths = [m * train_len for m in multiples]
    results = {}
    eval_tokens = baseline = None
    for scheme in schemes:
        for seed in range(seeds):
            model_cfg = ModelConfig(position=scheme, max_len=train_len, **model_fields)
            train_cfg = TrainConfig(seed=seed, data=data, eval_every=train_fields["steps"],
                                    log_every=max(train_fields["steps"] // 4, 1),
                                    **train_fields)
            model, params, tokenizer, final = train_and_load(model_cfg, train_cfg)
            if eval_tokens is None:
                eval_tokens = text_tokens(tokenizer, data, n_eval)
                train_stream = text_tokens(tokenizer, data, 20 * n_eval, role="train")
                baseline = unigram_loss(train_stream, eval_tokens, tokenizer.vocab_size)
            row = {"train_loss": final["train_loss"], "flat": {}, "sliding": {}}
            for length in lengths:
                if scheme == "learned" and length > train_len:
                    row["flat"][length] = row["sliding"][length] = math.nan  # no table rows
                    continue
                row["flat"][length] = eval_loss(model, params, eval_tokens, length)
                row["sliding"][length] = eval_loss(model, params, eval_tokens, length,
                                                   stride=max(length // 4, 1))
            results.setdefault(scheme, []).append(row)
            print(f"{scheme} seed {seed}: " + ", ".join(
                f"{n}={row['flat'][n]:.3f}/{row['sliding'][n]:.3f}" for n in lengths), flush=True)
    return {"scale": scale, "seeds": seeds, "train_len": train_len, "lengths": lengths,
            "unigram_loss": baseline, "results": results}


def report(out: dict) -> None:
    lengths, results = out["lengths"], out["results"]
    header = ["position"] + [f"{n} ({n // out['train_len']}x)" for n in lengths]
    tables, summary = [], {}
    for mode in ("flat", "sliding"):
        rows = []
        for scheme, runs in results.items():
            cells = []
            for n in lengths:
                mean, std = mean_std([r[mode][n] for r in runs])
                summary.setdefault(scheme, {}).setdefault(mode, {})[n] = mean
                cells.append("n/a (beyond table)" if math.isnan(mean)
                             else f"{mean:.3f} ± {std:.3f}")
            rows.append([scheme, *cells])
        title = ("Non-overlapping windows" if mode == "flat"
                 else "Sliding windows (stride L/4)")
        tables.append(f"**{title}**: held-out loss in nats/token (mean ± std over "
                      f"{out['seeds']} seeds)\n\n" + markdown_table(header, rows))
    tables.append(f"Unigram baseline: {out['unigram_loss']:.3f} nats/token; training length "
                  f"{out['train_len']}.")
    # sanity: every model must beat the unigram baseline at its training length
    for scheme, modes in summary.items():
        if not modes["flat"][lengths[0]] < out["unigram_loss"]:
            tables.append(f"WARNING: {scheme} does not beat the unigram baseline: a bug or far "
                          "too little training.")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, mode in zip(axes, ("flat", "sliding"), strict=True):
        for scheme, modes in summary.items():
            ys = [modes[mode][n] for n in lengths]
            ax.plot(lengths, ys, marker="o", label=scheme)
        ax.axvline(out["train_len"], color="grey", linestyle=":", linewidth=1)
        ax.axhline(out["unigram_loss"], color="black", linestyle="--", linewidth=0.8,
                   label="unigram")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("evaluation length (tokens)")
        ax.set_title("non-overlapping" if mode == "flat" else "sliding window")
    axes[0].set_ylabel("held-out loss (nats/token)")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"Length extrapolation (trained at {out['train_len']} tokens)")
    write_results(f"length_extrapolation_{out['scale']}", out, "\n\n".join(tables), fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=sorted(SCALES), default="default")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--data", default=None, help="text to train on (default corpus)")
    args = parser.parse_args(argv)
    out = run(args.scale, args.seeds, args.schemes.split(","), args.data)
    report(out)


if __name__ == "__main__":
    main()
