"""Experiment 5: attention variants, MHA vs GQA vs MQA (loss and KV-cache decoding speed).

Multi-head (MHA) vs grouped-query (GQA) vs multi-query (MQA) attention: held-out loss after the
same training, and KV-cache decoding speed (tokens/s, batch 1 and a larger batch, long cache)
with the cache bytes per token. Published (Ainslie et al. 2023, T5-XXL): GQA-8 keeps MHA's
quality (47.1 vs 47.2 average score) at close to MQA's speed (0.28 s vs 0.24 s per sample, MHA
1.51 s); MQA loses a little quality (46.6).

The sweep ``experiments/specs/attention_variants.toml`` compares their loss at matched
parameters on the research corpus; decoding speed and cache bytes are no sweep metric, so this
script keeps them. Its other parts are sweeps only, reported under
``experiments/results/sweeps/``: sliding windows (``attention_variants.toml``), prefix-LM vs
causal LM (``attention_prefix.toml``), QK-norm and soft-capping under a learning-rate sweep
(``attention_stability.toml``).

Writes ``results/attention_variants_heads_<scale>.{json,md,png}`` (the name it had as the
``heads`` part, which the committed results keep).

    python -m experiments.attention_variants    # default: 3 seeds, 9 runs of ~65 s on 2 cores
    python -m experiments.attention_variants --scale large
    python -m experiments.attention_variants --replot   # table and plot again from the JSON
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
    scored_chunks,
    trained,
    write_results,
)
from experiments.stats import paired_interval
from transformers_jax import ModelConfig, TrainConfig
from transformers_jax.backends import prepare_host

NAME = "attention_variants_heads"  # results/NAME_<scale>.*
CHUNK_WINDOWS = 16  # held-out chunks of 16 evaluation windows pair the runs (experiments.stats)

SCALES = {
    "tiny": dict(
        model=dict(d_model=32, n_layers=1, n_heads=4),
        train=dict(steps=12, batch_size=4, seq_len=16), n_eval=2_000, seeds=1,
        kv_heads=(4, 2, 1), decode=dict(prompt_len=8, new_tokens=24, batches=(2,)),
    ),
    "default": dict(
        model=dict(d_model=128, n_layers=2, n_heads=8),
        # 2.0M tokens per run: a 2-layer GPT at L=64 reaches 1.50 nats held-out, past the
        # 3-gram (1.86) from about 1M tokens (python -m experiments.budget --layers 2 --heads 8
        # --tokens-per-step 2048 --steps 1000); 9 runs of about 65 s on 2 quiet cores
        train=dict(steps=1000, batch_size=32, seq_len=64), n_eval=200_000, seeds=3,
        kv_heads=(8, 2, 1), decode=dict(prompt_len=16, new_tokens=1008, batches=(1, 16)),
    ),
    "large": dict(
        model=dict(d_model=512, n_layers=8, n_heads=8),
        train=dict(steps=5000, batch_size=64, seq_len=256), n_eval=400_000, seeds=3,
        kv_heads=(8, 2, 1), decode=dict(prompt_len=128, new_tokens=1920, batches=(1, 32)),
    ),
}


class _Text:
    """The seed-drawn split of the corpus (``transformers_jax.study.splits``), its held-out
    tokens and baselines (unigram, Kneser-Ney n-grams), made once per process."""

    def __init__(self, n_eval: int, data: str | None = None, shuffle_rows: int | None = None):
        self.split, self.tokens, self.baselines = heldout_split(data, n_eval)
        self.shuffle_rows = shuffle_rows  # TrainConfig.shuffle_rows (None: the library's)

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


def _train_text(cfg: dict, seed: int, model_extra: dict, text: _Text):
    """Train a GPT on the split's training text; return (model, params, tokenizer, final)."""
    steps = cfg["train"]["steps"]
    model_cfg = ModelConfig(**{**cfg["model"], **model_extra})
    train_cfg = TrainConfig(seed=seed, eval_every=steps, log_every=max(steps // 10, 1),
                            data=text.split.train_data, val_fraction=0.01,
                            shuffle_rows=text.shuffle_rows, **cfg["train"])
    return trained("attention_variants", model_cfg, train_cfg)


def run_heads(cfg: dict, seeds: int, text: _Text) -> dict:
    from transformers_jax.bench import bench_decoding

    n_heads = cfg["model"]["n_heads"]
    results = {}
    for kv in cfg["kv_heads"]:
        name = "MHA" if kv == n_heads else "MQA" if kv == 1 else f"GQA-{kv}"
        runs = []
        # MHA is the default config (no n_kv_heads): its cached runs keep their key
        extra = {} if kv == n_heads else {"n_kv_heads": kv}
        for seed in range(seeds):
            model, params, _, final = _train_text(cfg, seed, extra, text)
            runs.append({**_scored(model, params, text.tokens, cfg["train"]["seq_len"]),
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


def run(scale: str, seeds: int | None = None, data: str | None = None,
        shuffle_rows: int | None = None) -> dict:
    cfg = SCALES[scale]
    seeds = cfg["seeds"] if seeds is None else seeds
    text = _Text(cfg["n_eval"], data, shuffle_rows)
    start = time.perf_counter()
    out = run_heads(cfg, seeds, text)
    out.update(decode=dict(cfg["decode"]), decode_batches=list(cfg["decode"]["batches"]),
               scale=scale, seeds=seeds, model=cfg["model"], train=cfg["train"],
               wall_s=time.perf_counter() - start, **text.meta())
    report(out)
    return out


def report(out: dict, rebuilt: bool = False) -> None:
    table, fig = report_heads(out)
    table += (f"\n\nModel: {out['model']}; text training: {out['train']}, "
              f"{common.rows_line(out.get('shuffle_rows', 0))}; wall time "
              f"{out['wall_s'] / 60:.1f} min.")
    if out.get("baselines"):
        table += "\n\n" + baselines_line(out["baselines"])
    write_results(f"{NAME}_{out['scale']}", out, table, fig, rebuilt=rebuilt)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=sorted(SCALES), default="default")
    parser.add_argument("--seeds", type=int, default=None, help="default: the scale's")
    parser.add_argument("--data", default=None, help="training and held-out text: a file/"
                        "folder/glob, lines:PATH or tfds:NAME (default: the embedded corpus)")
    # the committed results were made with --part heads, when the script had four parts:
    # their command still runs (the same runs); the other parts say where they went
    parser.add_argument("--part", default="heads", help=argparse.SUPPRESS)
    common.add_shuffle_rows_option(parser)
    common.add_replot_option(parser)
    args = parser.parse_args(argv)
    if args.part != "heads":
        parser.error(f"--part {args.part}: only the heads part (MHA/GQA/MQA) is left here; "
                     "windows, prefix and stability are tjax sweeps now: experiments/specs/"
                     "attention_variants.toml, attention_prefix.toml, attention_stability.toml "
                     "(docs/experiments.md)")
    if common.replotted(args, parser, f"{NAME}_{args.scale}", report):
        return
    run(args.scale, args.seeds, args.data, shuffle_rows=args.shuffle_rows)


if __name__ == "__main__":
    prepare_host()  # e.g. XLA:CPU's buffers on huge pages: see backends/cpu_malloc.py
    main()
