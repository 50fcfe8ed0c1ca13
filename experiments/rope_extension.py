"""Experiment 2: RoPE context extension.

A RoPE model trained at L tokens is evaluated from L to 16L with no scaling, linear position
interpolation (PI), NTK-aware, dynamic NTK, YaRN and Llama 3's rule (factor 4, original length
L), first as is (zero-shot) and then after a short fine-tune at 4L. Dynamic NTK is evaluated as
it decodes: each position uses its own length for the base (``length='position'``), which
equals token-by-token decoding with the KV cache. The published picture to echo (Chen et al.
2023; Peng et al. 2023): without scaling the loss blows up past L; PI needs fine-tuning to
recover; NTK/dynamic NTK/YaRN do better zero-shot; after a short fine-tune all scalings are
close, YaRN best.

Passkey retrieval (``experiments.passkey``) is scored by length and depth for every scaling,
zero-shot and after the fine-tune. The training text carries key/query pairs so that the model
can retrieve at all; its accuracy at the training length is the positive control, and a
scaling's retrieval beyond L is read only where that control passes.

    python -m experiments.rope_extension      # default: 3 seeds, about 60 min on 2 cores
    python -m experiments.rope_extension --scale large
"""

from __future__ import annotations

import argparse

import numpy as np

from experiments import common
from experiments.common import (
    baselines_line,
    eval_loss,
    fit_ylim,
    heldout_split,
    markdown_table,
    mean_std,
    plot_seeds,
    reference_lines,
    scored_chunks,
    trained,
    trained_dir,
    write_results,
)
from experiments.passkey import DEPTHS, accuracy_grid, control_passed, mixed_training_data
from experiments.stats import paired_interval
from transformers_jax import ModelConfig, Rope, TrainConfig
from transformers_jax.backends import prepare_host
from transformers_jax.models import build_model
from transformers_jax.registry import ROPE_SCALINGS

SCALINGS = ["none", "linear", "ntk", "dynamic_ntk", "yarn", "llama3"]
FACTOR = 4
MULTIPLES = (1, 2, 4, 8, 16)  # evaluation lengths, in training lengths

SCALES = {
    "tiny": (dict(d_model=32, n_layers=1, n_heads=2), dict(steps=16, batch_size=4, seq_len=32),
             4, 2_000, 2),
    # the length experiment's budget at L=64 (3.1M tokens; ALiBi there beat the 3-gram from
    # about 1.3M on), then a 200-step fine-tune at 4L
    "default": (dict(d_model=128, n_layers=4, n_heads=4), dict(steps=3000, batch_size=16,
                seq_len=64), 200, 200_000, 20),
    "large": (dict(d_model=512, n_layers=8, n_heads=8), dict(steps=5000, batch_size=64,
              seq_len=256), 400, 400_000, 50),
}


def references(scalings) -> dict[str, str | None]:
    """The scaling each phase is compared with: zero-shot, the one that leaves the model as
    trained (also the passkey positive control); after the fine-tune, the rule the others are
    published against (``extension_baseline``: position interpolation). None where no such
    scaling is among ``scalings``."""
    as_trained = [s for s in scalings if not ROPE_SCALINGS.get(s).extends_context]
    baselines = [s for s in scalings if ROPE_SCALINGS.get(s).extension_baseline]
    return {"zero_shot": as_trained[0] if as_trained else None,
            "fine_tuned": baselines[0] if baselines else None}


def rope_for(scaling: str, train_len: int) -> Rope:
    """RoPE with the scaling rule ``scaling`` extending ``train_len`` by FACTOR, as it applies
    when decoding (dynamic NTK: the base grows with each token's position)."""
    rule = ROPE_SCALINGS.get(scaling).extending(float(FACTOR), train_len)
    return Rope(scaling=rule.as_decoded())


def _scored_curve(model, params, tokens, L: int) -> tuple[dict, list[float]]:
    """Held-out loss at each multiple of ``L`` and, at the target length FACTOR * L, its
    per-chunk means (chunks of that length: they pair seeds and scalings). One pass each."""
    curve, chunks = {}, []
    for m in MULTIPLES:
        curve[m], blocks = scored_chunks(model, params, tokens, m * L, m * L)
        if m == FACTOR:
            chunks = blocks
    return curve, chunks


def run(scale: str, seeds: int, data: str | None, scalings=tuple(SCALINGS),
        split_seed: int = 0, shuffle_rows: int | None = None) -> dict:
    model_fields, train_fields, tune_steps, n_eval, per_cell = SCALES[scale]
    L = train_fields["seq_len"]
    results: dict = {}
    baseline_1x = []
    split, tokens, base = heldout_split(data, n_eval, split_seed)
    # the training text carries key/query pairs (experiments.passkey): retrieval can be learnt
    train_data, passkey_meta = mixed_training_data(split, L, FACTOR)
    heldout_text = b"\n".join(split.heldout)
    lengths = [m * L for m in MULTIPLES]
    for seed in range(seeds):
        base_cfg = ModelConfig(position="rope", **model_fields)
        train_cfg = TrainConfig(seed=seed, data=train_data, val_fraction=0.01,
                                shuffle_rows=shuffle_rows,
                                eval_every=train_fields["steps"],
                                log_every=max(train_fields["steps"] // 4, 1), **train_fields)
        _, params, tokenizer, _ = trained("rope_extension", base_cfg, train_cfg)
        base_dir = trained_dir("rope_extension", base_cfg, train_cfg)
        base_model = build_model(base_cfg.replace(vocab_size=tokenizer.vocab_size))
        baseline_1x.append(eval_loss(base_model, params, tokens, L))
        for scaling in scalings:
            cfg = base_cfg.replace(position=rope_for(scaling, L), vocab_size=tokenizer.vocab_size)
            zs_model = build_model(cfg)
            zs_curve, zs_blocks = _scored_curve(zs_model, params, tokens, L)
            zero_shot = zs_curve[FACTOR]
            zs_keys = accuracy_grid(zs_model, params, heldout_text, tokenizer, lengths, per_cell)
            tune = train_cfg.replace(steps=tune_steps, seq_len=FACTOR * L,
                                     batch_size=max(train_fields["batch_size"] // FACTOR, 1),
                                     init_from=base_dir, warmup_steps=0,
                                     learning_rate=train_cfg.learning_rate / 4,
                                     eval_every=tune_steps)
            model, tuned, _, _ = trained("rope_extension", cfg, tune)
            ft_curve, ft_blocks = _scored_curve(model, tuned, tokens, L)
            tuned_loss = ft_curve[FACTOR]
            ft_keys = accuracy_grid(model, tuned, heldout_text, tokenizer, lengths, per_cell)
            results.setdefault(scaling, []).append({
                "zero_shot": zero_shot, "fine_tuned": tuned_loss,
                "zero_shot_blocks": zs_blocks, "fine_tuned_blocks": ft_blocks,
                "zero_shot_by_length": zs_curve, "fine_tuned_by_length": ft_curve,
                "zero_shot_passkey": zs_keys, "fine_tuned_passkey": ft_keys})
            print(f"seed {seed} {scaling}: zero-shot {zero_shot:.3f}, fine-tuned "
                  f"{tuned_loss:.3f}; passkey by length zero-shot "
                  + " ".join(f"{passkey_accuracy(zs_keys, n):.2f}" for n in lengths)
                  + ", fine-tuned "
                  + " ".join(f"{passkey_accuracy(ft_keys, n):.2f}" for n in lengths), flush=True)
    # the positive control: the model as trained retrieves at its training length
    refs = references(scalings)
    control = ([control_passed(r["zero_shot_passkey"], L) for r in results[refs["zero_shot"]]]
               if refs["zero_shot"] else None)  # None: not run (--scalings without it)
    return {"scale": scale, "seeds": seeds, "train_len": L, "eval_len": FACTOR * L,
            "factor": FACTOR, "multiples": list(MULTIPLES), "fine_tune_steps": tune_steps,
            "loss_at_train_len": baseline_1x,
            "shuffle_rows": common.resolved_shuffle_rows(shuffle_rows),
            "passkey": {**passkey_meta, "windows_per_cell": per_cell,
                        "control_passed_by_seed": control},
            "data": split.meta(), "heldout_tokens": int(tokens.size), "baselines": base,
            "references": refs, "results": results,
            "comparisons": comparisons(results, refs, lengths)}


def passkey_accuracy(grid: dict, length: int) -> float:
    """Share of windows of ``length`` tokens whose key was retrieved, over every depth."""
    return float(np.mean([np.mean(hits) for hits in grid[str(length)].values()]))


def _passkey_hits(run: dict, when: str, length: int) -> np.ndarray:
    """One seed's hits at ``length``, every depth's windows in one row (pairs the runs)."""
    return np.concatenate([np.asarray(h) for h in run[f"{when}_passkey"][str(length)].values()])


def comparisons(results: dict, refs: dict, lengths=()) -> dict:
    """Paired 95% intervals (``experiments.stats``) of each scaling against each phase's
    reference (``references``: no scaling zero-shot, PI after the fine-tune), seed i paired
    with seed i: held-out loss at the target length (chunks paired) and passkey accuracy at
    each length (windows paired)."""
    out = {}
    for when, reference in refs.items():
        if reference not in results:
            continue
        ref = np.array([r[f"{when}_blocks"] for r in results[reference]])
        for scaling, runs in results.items():
            if scaling != reference:
                diff = np.array([r[f"{when}_blocks"] for r in runs]) - ref
                out[f"{when}: {scaling} - {reference}"] = paired_interval(diff).as_dict()
                for n in lengths:
                    if f"{when}_passkey" not in runs[0]:
                        continue
                    diff = np.array([_passkey_hits(r, when, n) for r in runs]) - np.array(
                        [_passkey_hits(r, when, n) for r in results[reference]])
                    out[f"passkey {when} @ {n}: {scaling} - {reference}"] = paired_interval(
                        diff).as_dict()
    return out


def report(out: dict, rebuilt: bool = False) -> None:
    rows, means = [], {}
    for scaling, runs in out["results"].items():
        zs = mean_std([r["zero_shot"] for r in runs])
        ft = mean_std([r["fine_tuned"] for r in runs])
        means[scaling] = (zs[0], ft[0])
        rows.append([scaling, f"{zs[0]:.3f} ± {zs[1]:.3f}", f"{ft[0]:.3f} ± {ft[1]:.3f}"])
    base = mean_std(out["loss_at_train_len"])
    table = (f"Held-out loss (nats/token) at {out['eval_len']} tokens of a RoPE model trained at "
             f"{out['train_len']} (its loss at {out['train_len']}: {base[0]:.3f}); fine-tune: "
             f"{out['fine_tune_steps']} steps at {out['eval_len']}; "
             f"{common.rows_line(out.get('shuffle_rows', 0))}; mean ± std over "
             f"{out['seeds']} seeds.\n\n"
             + markdown_table(["scaling", "zero-shot", "after fine-tune"], rows))
    if out.get("baselines"):
        table += "\n\n" + baselines_line(out["baselines"])
    loss_cmp = {k: v for k, v in out.get("comparisons", {}).items()
                if not k.startswith("passkey")}
    if loss_cmp:
        table += ("\n\nPaired differences in nats/token (mean over seeds and held-out chunks, "
                  "[95% interval], negative: the first is better):\n\n" + markdown_table(
                      ["comparison", "difference"],
                      [[k, f"{v['mean']:+.3f} [{v['low']:+.3f}, {v['high']:+.3f}]"]
                       for k, v in loss_cmp.items()]))
    table += passkey_table(out)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    multiples = out.get("multiples") or [out["factor"]]
    has_keys = "zero_shot_passkey" in next(iter(out["results"].values()))[0]
    fig, grid = plt.subplots(2 if has_keys else 1, 2, figsize=(11, 8 if has_keys else 4),
                             squeeze=False)
    axes = grid[0]
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
    if has_keys:
        lengths = [m * out["train_len"] for m in multiples]
        for ax, when in zip(grid[1], ("zero_shot", "fine_tuned"), strict=True):
            for name, runs in out["results"].items():
                ys = [[passkey_accuracy(r[f"{when}_passkey"], n) for n in lengths]
                      for r in runs]
                plot_seeds(ax, lengths, ys, name)
            ax.set_xscale("log", base=2)
            ax.set_ylim(-0.03, 1.03)
            ax.axvline(out["eval_len"], color="grey", linewidth=0.8, linestyle=":")
            ax.set_xlabel("window length (tokens)")
        grid[1][0].set_ylabel("passkey retrieved (share over depths)")
    write_results(f"rope_extension_{out['scale']}", out, table, fig, rebuilt=rebuilt)


def passkey_table(out: dict) -> str:
    """Passkey accuracy by scaling and length (mean over depths and seeds), the control, and
    the paired intervals against the reference scaling."""
    if "passkey" not in out:
        return ""
    info, L = out["passkey"], out["train_len"]
    lengths = [m * L for m in out["multiples"]]
    rows = []
    for name, runs in out["results"].items():
        cells = []
        for when in ("zero_shot", "fine_tuned"):
            cells += [f"{np.mean([passkey_accuracy(r[f'{when}_passkey'], n) for r in runs]):.2f}"
                      for n in lengths]
        rows.append([name, *cells])
    header = ["scaling", *[f"zero-shot {n}" for n in lengths],
              *[f"tuned {n}" for n in lengths]]
    control = info["control_passed_by_seed"]
    verdict = ("not run (--scalings without none)" if control is None else
               "passed in every seed" if control and all(control) else
               f"FAILED in {len(control) - sum(control)} of {len(control)} seeds: retrieval "
               "beyond L says nothing about the scalings where the model cannot retrieve at L")
    text = (f"\n\nPasskey retrieval (experiments.passkey): share of windows whose 5-digit key "
            f"the model's greedy continuation gets right, mean over {len(DEPTHS)} depths x "
            f"{info['windows_per_cell']} windows and the seeds. The training text carries a "
            f"key/query pair about every {info['pairs_every_bytes']} bytes "
            f"({100 * info['pair_bytes_share']:.0f}% of its bytes; gaps below "
            f"{info['short_gap_below']} or {info['long_gap_below']}). Positive control "
            f"(no scaling, at L={L}, >= 80%): {verdict}.\n\n" + markdown_table(header, rows))
    keyed = {k: v for k, v in out.get("comparisons", {}).items() if k.startswith("passkey")}
    if keyed and control is not None and not any(control):
        return text + ("\n\nPaired differences in passkey accuracy: not shown, the control "
                       "failed in every seed (they compare models that do not retrieve).")
    if keyed:
        rows = []
        for when, ref in out["references"].items():
            for name in out["results"]:
                ivs = [keyed.get(f"passkey {when} @ {n}: {name} - {ref}") for n in lengths]
                if any(ivs):
                    rows.append([f"{when.replace('_', '-')}: {name} - {ref}", *[
                        "-" if v is None else
                        f"{v['mean']:+.2f} [{v['low']:+.2f}, {v['high']:+.2f}]" for v in ivs]])
        text += ("\n\nPaired differences in passkey accuracy by window length (over seeds and "
                 "windows, [95% interval], positive: the first retrieves more):\n\n"
                 + markdown_table(["comparison", *[str(n) for n in lengths]], rows))
    return text


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=sorted(SCALES), default="default")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--data", default=None, help="a file/folder/glob, lines:PATH or "
                        "tfds:NAME (default: the embedded corpus)")
    parser.add_argument("--split-seed", type=int, default=0, help="seed of the held-out draw")
    parser.add_argument("--scalings", default=",".join(SCALINGS))
    common.add_shuffle_rows_option(parser)
    common.add_replot_option(parser)
    args = parser.parse_args(argv)
    if common.replotted(args, parser, f"rope_extension_{args.scale}", report):
        return
    report(run(args.scale, args.seeds, args.data, args.scalings.split(","), args.split_seed,
               shuffle_rows=args.shuffle_rows))


if __name__ == "__main__":
    prepare_host()  # e.g. XLA:CPU's buffers on huge pages: see backends/cpu_malloc.py
    main()
