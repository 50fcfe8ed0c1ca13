"""Experiment 5: attention variants, in four parts (``--part``, default all).

- ``heads``: multi-head (MHA) vs grouped-query (GQA) vs multi-query (MQA) attention: held-out
  loss after the same training, and KV-cache decoding speed (tokens/s, batch 1 and a larger
  batch, long cache) with the cache bytes per token. Published (Ainslie et al. 2023, T5-XXL):
  GQA-8 keeps MHA's quality (47.1 vs 47.2 average score) at close to MQA's speed (0.28 s vs
  0.24 s per sample, MHA 1.51 s); MQA loses a little quality (46.6).
- ``window``: sliding-window attention, held-out loss against the window size (the full causal
  mask is the last point). Expected: loss falls as the window grows, with diminishing returns
  once the window covers most of the useful context (Mistral and Longformer use windows for
  their cost, not their quality).
- ``prefix``: prefix-LM vs causal LM on a conditional task (reverse) with the same data and
  budget, and an encoder-decoder for reference. Published (Raffel et al. 2020, T5 Table 2, same
  objective family): encoder-decoder 83.28 > prefix LM 81.82 > causal LM 74.70 (GLUE).
- ``stability``: QK-norm and attention logit soft-capping under a learning-rate sweep (1x, 10x
  and 100x the default rate): final and held-out loss, divergence. Published (Wortsman et al.
  2023, small-scale proxies for training instabilities; Dehghani et al. 2023): QK-layernorm
  removes the attention-logit growth that makes high learning rates diverge, so loss is far less
  sensitive to the learning rate; Gemma 2 caps attention logits at 50 for the same reason.

Each part writes ``results/attention_variants_<part>_<scale>.{json,md,png}``.

    python -m experiments.attention_variants              # default: 3 seeds, ~60 min on 2 cores
    python -m experiments.attention_variants --part heads,window
    python -m experiments.attention_variants --scale large
    python -m experiments.attention_variants --replot   # tables and plots again from the JSON
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import numpy as np

from experiments import common
from experiments.common import (
    baselines_line,
    fit_ylim,
    heldout_split,
    markdown_table,
    mean_std,
    plot_seeds,
    reference_lines,
    scored_chunks,
    trained,
    write_results,
)
from experiments.stats import paired_interval
from transformers_jax import ModelConfig, TrainConfig
from transformers_jax.backends import prepare_host

PARTS = ["heads", "window", "prefix", "stability"]
CHUNK_WINDOWS = 16  # held-out chunks of 16 evaluation windows pair the runs (experiments.stats)

SCALES = {
    "tiny": dict(
        model=dict(d_model=32, n_layers=1, n_heads=4),
        train=dict(steps=12, batch_size=4, seq_len=16), n_eval=2_000, seeds=1,
        kv_heads=(4, 2, 1), decode=dict(prompt_len=8, new_tokens=24, batches=(2,)),
        windows=(4,), lrs=(2e-2,), softcap=50.0, variants=("baseline", "qk_norm", "softcap"),
        task=dict(name="reverse", train_max=4, steps=20, batch_size=16, learning_rate=3e-3,
                  weight_decay=0.01, per_length=8),
    ),
    "default": dict(
        model=dict(d_model=128, n_layers=2, n_heads=8),
        # 2.0M tokens per run: a 2-layer GPT at L=64 reaches 1.50 nats held-out, past the
        # 3-gram (1.86) from about 1M tokens (python -m experiments.budget --layers 2 --heads 8
        # --tokens-per-step 2048 --steps 1000); 45 runs of about 65 s on 2 quiet cores
        train=dict(steps=1000, batch_size=32, seq_len=64), n_eval=200_000, seeds=3,
        kv_heads=(8, 2, 1), decode=dict(prompt_len=16, new_tokens=1008, batches=(1, 16)),
        windows=(4, 8, 16), lrs=(2e-3, 2e-2, 2e-1), softcap=50.0,
        variants=("baseline", "qk_norm", "softcap"),
        task=dict(name="reverse", train_max=12, steps=600, batch_size=32, learning_rate=1e-3,
                  weight_decay=0.01, per_length=32),
    ),
    "large": dict(
        model=dict(d_model=512, n_layers=8, n_heads=8),
        train=dict(steps=5000, batch_size=64, seq_len=256), n_eval=400_000, seeds=3,
        kv_heads=(8, 2, 1), decode=dict(prompt_len=128, new_tokens=1920, batches=(1, 32)),
        windows=(16, 32, 64, 128), lrs=(1e-3, 1e-2, 1e-1, 3e-1), softcap=50.0,
        variants=("baseline", "qk_norm", "softcap", "qk_norm+softcap"),
        task=dict(name="reverse", train_max=20, steps=5000, batch_size=64, learning_rate=5e-4,
                  weight_decay=0.01, per_length=100),
    ),
}


class _Text:
    """The seed-drawn split of the corpus (``transformers_jax.sweep.splits``), its held-out
    tokens and baselines (unigram, Kneser-Ney n-grams), made once per process."""

    def __init__(self, n_eval: int, data: str | None = None, shuffle_rows: int | None = None):
        self.split, self.tokens, self.baselines = heldout_split(data, n_eval)
        self.shuffle_rows = shuffle_rows  # TrainConfig.shuffle_rows (None: the library's)
        self.unigram = self.baselines["unigram"]

    def get(self, tokenizer) -> tuple[np.ndarray, float]:
        return self.tokens, self.unigram

    def meta(self) -> dict:
        return {"data": self.split.meta(), "baselines": self.baselines,
                "heldout_tokens": int(self.tokens.size),
                "shuffle_rows": common.resolved_shuffle_rows(self.shuffle_rows)}


def _scored(model, params, tokens: np.ndarray, seq_len: int) -> dict:
    """Held-out loss and its per-chunk means (the same chunks for every run: paired)."""
    loss, chunks = scored_chunks(model, params, tokens, seq_len, CHUNK_WINDOWS * seq_len)
    return {"eval_loss": loss, "chunks": chunks}


def paired(runs, base_runs) -> dict:
    """The paired 95% interval of ``runs`` minus ``base_runs`` (same seeds, same chunks)."""
    d_SC = np.array([r["chunks"] for r in runs]) - np.array([r["chunks"] for r in base_runs])
    return paired_interval(d_SC).as_dict()


def _train_text(cfg: dict, seed: int, model_extra: dict, train_extra: dict | None = None,
                text: _Text | None = None):
    """Train a GPT on the split's training text; return (model, params, tokenizer, final)."""
    steps = cfg["train"]["steps"]
    model_cfg = ModelConfig(**{**cfg["model"], **model_extra})
    data = None if text is None else text.split.train_data
    train_cfg = TrainConfig(seed=seed, eval_every=steps, log_every=max(steps // 10, 1),
                            data=data, val_fraction=0.01,
                            shuffle_rows=None if text is None else text.shuffle_rows,
                            **{**cfg["train"], **(train_extra or {})})
    return trained("attention_variants", model_cfg, train_cfg)


# ---------------------------------------------------------------------------------- parts


def run_heads(cfg: dict, seeds: int, text: _Text) -> dict:
    from transformers_jax.bench import bench_decoding

    n_heads = cfg["model"]["n_heads"]
    results = {}
    for kv in cfg["kv_heads"]:
        name = "MHA" if kv == n_heads else "MQA" if kv == 1 else f"GQA-{kv}"
        runs = []
        # MHA is the default config: the window part's full-attention runs are the same runs
        extra = {} if kv == n_heads else {"n_kv_heads": kv}
        for seed in range(seeds):
            model, params, tokenizer, final = _train_text(cfg, seed, extra, text=text)
            tokens, _ = text.get(tokenizer)
            runs.append({**_scored(model, params, tokens, cfg["train"]["seq_len"]),
                         "params": final["params"],
                         "train_tokens_per_s": final["tokens_per_s"]})
        model_cfg = model.config
        speed = bench_decoding(model_cfg, repeats=2, **cfg["decode"])
        kv_bytes = 2 * model_cfg.n_layers * kv * model_cfg.dims_per_head * 4  # float32 k and v
        results[name] = {"kv_heads": kv, "runs": runs, "decode": speed,
                         "kv_cache_bytes_per_token": kv_bytes}
        batches = cfg["decode"]["batches"]
        print(f"heads {name}: loss {mean_std([r['eval_loss'] for r in runs])[0]:.3f}; decode "
              + ", ".join(f"batch {b} {speed[f'batch_{b}']['decode_tokens_per_s']:,.0f} tok/s"
                          for b in batches), flush=True)
    full = results["MHA"]["runs"] if "MHA" in results else None
    comparisons = {f"{k} - MHA": paired(v["runs"], full) for k, v in results.items()
                   if full is not None and k != "MHA"}
    # on a CPU, decoding speed depends on the cores it had (pinned, or beside another job)
    return {"n_heads": n_heads, "results": results, "comparisons": comparisons,
            "decode_cores": common.core_count() if jax.default_backend() == "cpu" else None}


def run_window(cfg: dict, seeds: int, text: _Text) -> dict:
    seq_len = cfg["train"]["seq_len"]
    results = {}
    for window in [*cfg["windows"], None]:
        extra = {"mask": {"name": "sliding_window", "window": window}} if window else {}
        runs = []
        for seed in range(seeds):
            model, params, tokenizer, final = _train_text(cfg, seed, extra, text=text)
            tokens, unigram = text.get(tokenizer)
            runs.append({**_scored(model, params, tokens, seq_len),
                         "train_loss": final["train_loss"]})
        key = str(window or seq_len)
        results[key] = {"window": window or seq_len, "full": window is None, "runs": runs}
        print(f"window {key}: loss {mean_std([r['eval_loss'] for r in runs])[0]:.3f}",
              flush=True)
    full = results[str(seq_len)]["runs"]
    comparisons = {f"{k} - full": paired(v["runs"], full) for k, v in results.items()
                   if not v["full"]}
    return {"seq_len": seq_len, "unigram_loss": unigram, "results": results,
            "comparisons": comparisons}


def run_prefix(cfg: dict, seeds: int) -> dict:
    from experiments.synthetic_generalisation import accuracy_of, eval_batches, sequence_lengths

    task = cfg["task"]
    L = task["train_max"]
    results = {}
    variants = {"causal LM": ("gpt", "causal"), "prefix LM": ("gpt", "prefix"),
                "encoder-decoder": ("encdec", "causal")}
    for name, (family, mask) in variants.items():
        seq_len = sequence_lengths(task["name"], family, L)
        runs = []
        for seed in range(seeds):
            model_cfg = ModelConfig(family=family, mask=mask, position="rope", **cfg["model"])
            train_cfg = TrainConfig(task=task["name"], train_lengths=(1, L),
                                    test_lengths=(1, L), seq_len=seq_len, seed=seed,
                                    steps=task["steps"], batch_size=task["batch_size"],
                                    learning_rate=task["learning_rate"],
                                    weight_decay=task["weight_decay"],
                                    eval_every=task["steps"],
                                    log_every=max(task["steps"] // 10, 1))
            model, params, tokenizer, final = trained("attention_variants", model_cfg,
                                                       train_cfg)
            batch = eval_batches(task["name"], family, tokenizer, range(1, L + 1), seq_len,
                                 task["per_length"], model_cfg.mask.needs_prefix_len)
            exact, token_acc = accuracy_of(model, params, batch, family)
            runs.append({"eval_loss": final["eval_loss"],
                         "token_accuracy": float(np.mean(list(token_acc.values()))),
                         "exact_match": float(np.mean(list(exact.values()))),
                         "exact_by_length": exact,
                         "loss_curve": [(h["step"], h["loss"]) for h in final["history"]]})
        results[name] = {"family": family, "mask": mask, "runs": runs}
        r = runs[-1]
        print(f"prefix part {name}: held-out loss {r['eval_loss']:.3f}, token accuracy "
              f"{r['token_accuracy']:.3f}, exact match {r['exact_match']:.3f}", flush=True)
    return {"task": task, "results": results}


def run_stability(cfg: dict, seeds: int, text: _Text) -> dict:
    cap = cfg["softcap"]
    switches = {"baseline": {}, "qk_norm": {"qk_norm": True},
                "softcap": {"attn_logit_softcap": cap},
                "qk_norm+softcap": {"qk_norm": True, "attn_logit_softcap": cap}}
    variants = {name: switches[name] for name in cfg["variants"]}
    seq_len = cfg["train"]["seq_len"]
    results: dict = {}
    for name, extra in variants.items():
        for lr in cfg["lrs"]:
            runs = []
            for seed in range(seeds):
                # soft-capping needs an implementation that exposes the logits: the same
                # (reference) kernel for every variant keeps the comparison fair
                model, params, tokenizer, final = _train_text(
                    cfg, seed, {"attention": "reference", **extra}, {"learning_rate": lr},
                    text)
                tokens, unigram = text.get(tokenizer)
                scored = _scored(model, params, tokens, seq_len)
                loss = scored["eval_loss"]
                curve = [(h["step"], h["loss"]) for h in final["history"]]
                runs.append({**scored, "train_loss": final["train_loss"],
                             "loss_curve": curve,
                             "diverged": bool(not math.isfinite(loss) or loss > unigram)})
            results.setdefault(name, {})[str(lr)] = runs
            print(f"stability {name} lr {lr:g}: held-out {runs[-1]['eval_loss']:.3f}",
                  flush=True)
    # a diverged run (NaN loss) makes its comparison NaN (reported "n/a"); divergence is
    # reported apart
    comparisons = {f"{name} - baseline @ {lr}": paired(by_lr[lr], results["baseline"][lr])
                   for name, by_lr in results.items() if name != "baseline"
                   and "baseline" in results for lr in by_lr}
    return {"lrs": list(cfg["lrs"]), "unigram_loss": unigram, "softcap": cfg["softcap"],
            "results": results, "comparisons": comparisons}


# ---------------------------------------------------------------------------------- reports


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _iv(comparisons: dict, key: str) -> str:
    """A paired difference and its 95% interval, as the tables print it."""
    iv = comparisons.get(key)
    if iv is None:
        return "-"
    if math.isnan(iv["mean"]):
        return "n/a"
    return f"{iv['mean']:+.3f} [{iv['low']:+.3f}, {iv['high']:+.3f}]"


def _ms(values) -> str:
    mean, std = mean_std(values)
    return "n/a" if math.isnan(mean) else f"{mean:.3f} ± {std:.3f}"


def report_heads(out: dict) -> tuple[str, object]:
    batches = out["decode_batches"]
    rows = []
    for name, r in out["results"].items():
        speeds = [r["decode"][f"batch_{b}"]["decode_tokens_per_s"] for b in batches]
        rows.append([name, r["kv_heads"], r["runs"][0]["params"],
                     _ms([x["eval_loss"] for x in r["runs"]]),
                     _iv(out.get("comparisons", {}), f"{name} - MHA"),
                     r["kv_cache_bytes_per_token"],
                     *[f"{s:,.0f}" for s in speeds]])
    header = ["attention", "k/v heads", "params", "held-out loss (nats/token)",
              "minus MHA, paired [95%]", "KV cache bytes/token",
              *[f"decode tok/s, batch {b}" for b in batches]]
    d = out["decode"]
    table = (f"{out['n_heads']} query heads; decoding: greedy with the KV cache, prompt "
             f"{d['prompt_len']} + {d['new_tokens']} new tokens, best of 2 wall-clock runs"
             + (f" on {out['decode_cores']} CPU core(s)" if out.get("decode_cores") else "") + " "
             "(on a shared machine other jobs can slow any run); loss: mean ± "
             f"std over {out['seeds']} seed(s); differences: paired over seeds and held-out "
             "chunks, bootstrap/t 95% interval (experiments.stats)\n\n"
             + markdown_table(header, rows))
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = list(out["results"])
    losses = [[x["eval_loss"] for x in out["results"][n]["runs"]] for n in names]
    for i, seeds in enumerate(losses):  # every seed as a dot, the mean as a bar across them
        a1.plot([i] * len(seeds), seeds, "o", color="C0", alpha=0.5, markersize=4)
        a1.plot([i - 0.25, i + 0.25], [np.mean(seeds)] * 2, color="black", linewidth=1.5)
    a1.set_xticks(range(len(names)), names)
    a1.set_xlim(-0.6, len(names) - 0.4)
    a1.set_ylabel("held-out loss (nats/token)\n(dots: seeds; line: mean)")
    fit_ylim(a1, losses)
    for b in batches:
        a2.plot(names, [out["results"][n]["decode"][f"batch_{b}"]["decode_tokens_per_s"]
                        for n in names], marker="o", label=f"batch {b}")
    a2.set_ylabel("decode tokens/s")
    a2.legend()
    fig.suptitle("MHA vs GQA vs MQA")
    fig.tight_layout()
    return table, fig


def report_window(out: dict) -> tuple[str, object]:
    rows = [[("full (causal)" if r["full"] else str(r["window"])),
             _ms([x["eval_loss"] for x in r["runs"]]),
             _iv(out.get("comparisons", {}), f"{key} - full")]
            for key, r in out["results"].items()]
    table = (f"Held-out loss (nats/token) at {out['seq_len']} tokens against the attention "
             f"window (unigram baseline {out['unigram_loss']:.3f}); mean ± std over "
             f"{out['seeds']} seed(s); differences paired over seeds and held-out chunks, 95% "
             "interval\n\n"
             + markdown_table(["window (keys per query)", "held-out loss",
                               "minus full, paired [95%]"], rows))
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    xs = [r["window"] for r in out["results"].values()]
    ys_SX = np.asarray([[x["eval_loss"] for x in r["runs"]]
                        for r in out["results"].values()]).T
    plot_seeds(ax, xs, ys_SX, "held-out loss")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("window (last point: full causal)")
    ax.set_ylabel("held-out loss (nats/token)\nmean, band: range over seeds")
    fit_ylim(ax, ys_SX)
    reference_lines(ax, {"unigram": out.get("unigram_loss")})
    return table, fig


def report_prefix(out: dict) -> tuple[str, object]:
    task = out["task"]
    rows = [[name, r["family"], r["mask"], _ms([x["eval_loss"] for x in r["runs"]]),
             _ms([x["token_accuracy"] for x in r["runs"]]),
             _ms([x["exact_match"] for x in r["runs"]])] for name, r in out["results"].items()]
    table = (f"Task {task['name']} at lengths 1-{task['train_max']}, {task['steps']} steps of "
             f"batch {task['batch_size']}, RoPE; held-out metrics on the answer (exact match: "
             f"{task['per_length']} examples per length); mean ± std over {out['seeds']} "
             "seed(s)\n\n"
             + markdown_table(["model", "family", "mask", "held-out loss", "token accuracy",
                               "exact match"], rows))
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, r in out["results"].items():
        steps = [step for step, _ in r["runs"][0]["loss_curve"]]
        curves_SX = [[loss for _, loss in run["loss_curve"]] for run in r["runs"]]
        plot_seeds(ax, steps, curves_SX, name)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (answer tokens)\nmean, band: range over seeds")
    ax.legend()
    return table, fig


def report_stability(out: dict) -> tuple[str, object]:
    lrs = out["lrs"]
    rows = []
    for name, by_lr in out["results"].items():
        cells = []
        for lr in lrs:
            runs = by_lr[str(lr)]
            mark = " (diverged)" if any(r["diverged"] for r in runs) else ""
            cells.append(_ms([r["eval_loss"] for r in runs]) + mark)
        rows.append([name, *cells])
    table = (f"Held-out loss (nats/token) after training at each peak learning rate "
             f"(softcap: attention logits capped at {out['softcap']:g} by cap * tanh(x / cap); "
             f"attention=reference for all; unigram baseline {out['unigram_loss']:.3f}: "
             "a run ending above it counts as diverged); mean ± std over "
             f"{out['seeds']} seed(s)\n\n"
             + markdown_table(["variant", *[f"lr {lr:g}" for lr in lrs]], rows))
    comparisons = out.get("comparisons", {})
    if comparisons:
        diffs = [[name, *[_iv(comparisons, f"{name} - baseline @ {lr}") for lr in lrs]]
                 for name in out["results"] if name != "baseline"]
        table += ("\n\nMinus the baseline at the same learning rate, paired over seeds and "
                  "held-out chunks, 95% interval (negative: the variant is better)\n\n"
                  + markdown_table(["variant", *[f"lr {lr:g}" for lr in lrs]], diffs))
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    values = []
    for name, by_lr in out["results"].items():
        ys_SX = np.asarray([[r["eval_loss"] for r in by_lr[str(lr)]] for lr in lrs]).T
        plot_seeds(ax, lrs, ys_SX, name)
        values.append(ys_SX)
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("held-out loss (nats/token)\nmean, band: range over seeds")
    fit_ylim(ax, values)
    reference_lines(ax, {"unigram": out["unigram_loss"]})
    ax.legend(fontsize=8)
    return table, fig


REPORTS = {"heads": report_heads, "window": report_window, "prefix": report_prefix,
           "stability": report_stability}


def run(scale: str, parts=tuple(PARTS), seeds: int | None = None,
        data: str | None = None, shuffle_rows: int | None = None) -> dict:
    cfg = SCALES[scale]
    seeds = cfg["seeds"] if seeds is None else seeds
    text = _Text(cfg["n_eval"], data, shuffle_rows) if set(parts) - {"prefix"} else None
    outs = {}
    for part in parts:
        start = time.perf_counter()
        if part == "heads":
            out = run_heads(cfg, seeds, text)
            out["decode"], out["decode_batches"] = dict(cfg["decode"]), list(
                cfg["decode"]["batches"])
        elif part == "window":
            out = run_window(cfg, seeds, text)
        elif part == "prefix":
            out = run_prefix(cfg, seeds)
        elif part == "stability":
            out = run_stability(cfg, seeds, text)
        else:
            raise ValueError(f"unknown part {part!r}; valid: {', '.join(PARTS)}")
        out.update(scale=scale, seeds=seeds, part=part, model=cfg["model"], train=cfg["train"],
                   wall_s=time.perf_counter() - start)
        if part != "prefix":
            out.update(text.meta())
        outs[part] = out
        report(out)
    return outs


def report(out: dict, rebuilt: bool = False) -> None:
    table, fig = REPORTS[out["part"]](out)
    training = (f"task training: {out['task']}" if out["part"] == "prefix"
                else f"text training: {out['train']}, "
                     f"{common.rows_line(out.get('shuffle_rows', 0))}")
    table += f"\n\nModel: {out['model']}; {training}; wall time {out['wall_s'] / 60:.1f} min."
    if out.get("baselines"):
        table += "\n\n" + baselines_line(out["baselines"])
    write_results(f"attention_variants_{out['part']}_{out['scale']}", out, table, fig,
                  rebuilt=rebuilt)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=sorted(SCALES), default="default")
    parser.add_argument("--part", default=",".join(PARTS),
                        help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--seeds", type=int, default=None, help="default: the scale's")
    parser.add_argument("--data", default=None, help="text for the text parts: a file/folder/"
                        "glob, lines:PATH or tfds:NAME (default: the embedded corpus)")
    common.add_shuffle_rows_option(parser)
    common.add_replot_option(parser)
    args = parser.parse_args(argv)
    parts = args.part.split(",")
    for part in parts:
        if part not in PARTS:
            parser.error(f"--part {part!r}: valid choices: {', '.join(PARTS)}")
    if args.replot:  # each part from its JSON: numbers, command and timings of its run
        for part in parts:
            report(common.read_results(f"attention_variants_{part}_{args.scale}",
                                       parser.error), rebuilt=True)
        return
    run(args.scale, parts, args.seeds, args.data, shuffle_rows=args.shuffle_rows)


if __name__ == "__main__":
    prepare_host()  # e.g. XLA:CPU's buffers on huge pages: see backends/cpu_malloc.py
    main()
