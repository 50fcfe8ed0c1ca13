"""Experiment 2: RoPE context extension.

A RoPE model trained at L tokens is evaluated from L to 16L with no scaling, linear position
interpolation (PI), NTK-aware, dynamic NTK, YaRN and Llama 3's rule (factor 4, original length
L), first as is (zero-shot) and then after a short fine-tune at 4L. Dynamic NTK is evaluated as
it decodes: each position uses its own length for the base (``length='position'``), which
equals token-by-token decoding with the KV cache. The published picture to echo (Chen et al.
2023; Peng et al. 2023): without scaling the loss blows up past L; PI needs fine-tuning to
recover; NTK/dynamic NTK/YaRN do better zero-shot; after a short fine-tune all scalings are
close, YaRN best.

    python -m experiments.rope_extension      # default: 3 seeds, 20-60 min on 2 cores
    python -m experiments.rope_extension --scale large
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

from experiments.common import (
    baselines_line,
    eval_loss,
    fit_ylim,
    heldout_split,
    markdown_table,
    mean_std,
    plot_seeds,
    position_losses,
    reference_lines,
    train_and_load,
    write_results,
)
from experiments.stats import block_means, paired_interval
from transformers_jax import ModelConfig, Rope, TrainConfig
from transformers_jax.models import build_model
from transformers_jax.registry import ROPE_SCALINGS

SCALINGS = ["none", "linear", "ntk", "dynamic_ntk", "yarn", "llama3"]
FACTOR = 4
MULTIPLES = (1, 2, 4, 8, 16)  # evaluation lengths, in training lengths

SCALES = {
    "tiny": (dict(d_model=32, n_layers=1, n_heads=2), dict(steps=16, batch_size=4, seq_len=16),
             4, 2_000),
    # the length experiment's budget at L=64 (3.1M tokens; ALiBi there beat the 3-gram from
    # about 1.3M on), then a 200-step fine-tune at 4L
    "default": (dict(d_model=128, n_layers=4, n_heads=4), dict(steps=3000, batch_size=16,
                seq_len=64), 200, 200_000),
    "large": (dict(d_model=512, n_layers=8, n_heads=8), dict(steps=5000, batch_size=64,
              seq_len=256), 400, 400_000),
}


def rope_for(scaling: str, train_len: int) -> Rope:
    """RoPE with the scaling rule ``scaling`` extending ``train_len`` by FACTOR, as it applies
    when decoding (dynamic NTK: the base grows with each token's position)."""
    rule = ROPE_SCALINGS.get(scaling).extending(float(FACTOR), train_len)
    return Rope(scaling=rule.as_decoded())


def _scored(model, params, tokens, length) -> tuple[float, list[float]]:
    """Mean held-out loss and its per-chunk means (chunks of ``length``: pairs seeds/schemes)."""
    losses = position_losses(model, params, tokens, length)
    return float(np.nanmean(losses)), block_means(losses, length).tolist()


def run(scale: str, seeds: int, data: str | None, scalings=tuple(SCALINGS),
        split_seed: int = 0) -> dict:
    model_fields, train_fields, tune_steps, n_eval = SCALES[scale]
    L = train_fields["seq_len"]
    results: dict = {}
    baseline_1x = []
    split, tokens, base = heldout_split(data, n_eval, split_seed)
    for seed in range(seeds):
        with tempfile.TemporaryDirectory() as tmp:
            base_dir = os.path.join(tmp, "base")
            base_cfg = ModelConfig(position="rope", **model_fields)
            train_cfg = TrainConfig(seed=seed, data=split.train_data, val_fraction=0.01,
                                    eval_every=train_fields["steps"],
                                    log_every=max(train_fields["steps"] // 4, 1), **train_fields)
            _, params, tokenizer, _ = train_and_load(base_cfg, train_cfg, base_dir)
            base_model = build_model(base_cfg.replace(vocab_size=tokenizer.vocab_size))
            baseline_1x.append(eval_loss(base_model, params, tokens, L))
            for scaling in scalings:
                cfg = base_cfg.replace(position=rope_for(scaling, L),
                                       vocab_size=tokenizer.vocab_size)
                zs_model = build_model(cfg)
                zero_shot, zs_blocks = _scored(zs_model, params, tokens, FACTOR * L)
                zs_curve = {m: eval_loss(zs_model, params, tokens, m * L) for m in MULTIPLES}
                tune = train_cfg.replace(steps=tune_steps, seq_len=FACTOR * L,
                                         batch_size=max(train_fields["batch_size"] // FACTOR, 1),
                                         init_from=base_dir, warmup_steps=0,
                                         learning_rate=train_cfg.learning_rate / 4,
                                         eval_every=tune_steps)
                model, tuned, _, _ = train_and_load(cfg, tune)
                tuned_loss, ft_blocks = _scored(model, tuned, tokens, FACTOR * L)
                ft_curve = {m: eval_loss(model, tuned, tokens, m * L) for m in MULTIPLES}
                results.setdefault(scaling, []).append({
                    "zero_shot": zero_shot, "fine_tuned": tuned_loss,
                    "zero_shot_blocks": zs_blocks, "fine_tuned_blocks": ft_blocks,
                    "zero_shot_by_length": zs_curve, "fine_tuned_by_length": ft_curve})
                print(f"seed {seed} {scaling}: zero-shot {zero_shot:.3f}, fine-tuned "
                      f"{tuned_loss:.3f}", flush=True)
    return {"scale": scale, "seeds": seeds, "train_len": L, "eval_len": FACTOR * L,
            "factor": FACTOR, "multiples": list(MULTIPLES), "fine_tune_steps": tune_steps,
            "loss_at_train_len": baseline_1x,
            "data": split.meta(), "heldout_tokens": int(tokens.size), "baselines": base,
            "results": results, "comparisons": comparisons(results)}


def comparisons(results: dict) -> dict:
    """Paired 95% intervals (``experiments.stats``) of each scaling against no scaling
    (zero-shot) and against PI (after the fine-tune), seed i paired with seed i."""
    out = {}
    for when, reference in (("zero_shot", "none"), ("fine_tuned", "linear")):
        if reference not in results:
            continue
        ref = np.array([r[f"{when}_blocks"] for r in results[reference]])
        for scaling, runs in results.items():
            if scaling != reference:
                diff = np.array([r[f"{when}_blocks"] for r in runs]) - ref
                out[f"{when}: {scaling} - {reference}"] = paired_interval(diff).as_dict()
    return out


def report(out: dict) -> None:
    rows, means = [], {}
    for scaling, runs in out["results"].items():
        zs = mean_std([r["zero_shot"] for r in runs])
        ft = mean_std([r["fine_tuned"] for r in runs])
        means[scaling] = (zs[0], ft[0])
        rows.append([scaling, f"{zs[0]:.3f} ± {zs[1]:.3f}", f"{ft[0]:.3f} ± {ft[1]:.3f}"])
    base = mean_std(out["loss_at_train_len"])
    table = (f"Held-out loss (nats/token) at {out['eval_len']} tokens of a RoPE model trained at "
             f"{out['train_len']} (its loss at {out['train_len']}: {base[0]:.3f}); fine-tune: "
             f"{out['fine_tune_steps']} steps at {out['eval_len']}; mean ± std over "
             f"{out['seeds']} seeds.\n\n"
             + markdown_table(["scaling", "zero-shot", "after fine-tune"], rows))
    if out.get("baselines"):
        table += "\n\n" + baselines_line(out["baselines"])
    if out.get("comparisons"):
        table += ("\n\nPaired differences in nats/token (mean over seeds and held-out chunks, "
                  "[95% interval], negative: the first is better):\n\n" + markdown_table(
                      ["comparison", "difference"],
                      [[k, f"{v['mean']:+.3f} [{v['low']:+.3f}, {v['high']:+.3f}]"]
                       for k, v in out["comparisons"].items()]))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    multiples = out.get("multiples") or [out["factor"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    values = [base[0]]
    for ax, (key, title) in zip(axes, (("zero_shot", "zero-shot"),
                                       ("fine_tuned", f"after {out['fine_tune_steps']} steps "
                                                      f"at {out['eval_len']}")), strict=True):
        for name in means:
            runs = out["results"][name]
            if f"{key}_by_length" in runs[0]:
                ys = [[r[f"{key}_by_length"][str(m)] if str(m) in r[f"{key}_by_length"]
                       else r[f"{key}_by_length"][m] for m in multiples] for r in runs]
                xs = [m * out["train_len"] for m in multiples]
            else:  # results written before the length sweep: the one length
                ys, xs = [[r[key]] for r in runs], [out["eval_len"]]
            values += [v for y in ys for v in y if np.isfinite(v)]
            plot_seeds(ax, xs, ys, name)
        ax.set_xscale("log", base=2)
        ax.axvline(out["eval_len"], color="grey", linewidth=0.8, linestyle=":")
        ax.set_xlabel("evaluation length (tokens); dotted: the scaling's target")
        ax.set_title(title)
    low, high = fit_ylim(axes[0], values)
    axes[1].set_ylim(low, high)
    refs = {f"RoPE at {out['train_len']}": base[0]}
    if out.get("baselines"):
        refs |= {k: out["baselines"][k] for k in ("3-gram", "4-gram")}
    for ax in axes:
        reference_lines(ax, refs)
    axes[0].set_ylabel("held-out loss (nats/token); band: range over seeds")
    axes[0].legend(fontsize=8)
    write_results(f"rope_extension_{out['scale']}", out, table, fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=sorted(SCALES), default="default")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--data", default=None, help="a file/folder/glob, lines:PATH or "
                        "tfds:NAME (default: the embedded corpus)")
    parser.add_argument("--split-seed", type=int, default=0, help="seed of the held-out draw")
    parser.add_argument("--scalings", default=",".join(SCALINGS))
    args = parser.parse_args(argv)
    report(run(args.scale, args.seeds, args.data, args.scalings.split(","), args.split_seed))


if __name__ == "__main__":
    main()
