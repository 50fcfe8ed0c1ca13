"""Experiment 4: how much context a transformer and an LSTM language model use.

After Khandelwal et al. 2018 ("Sharp Nearby, Fuzzy Far Away"): train both models on the same
text, then score the last ``target`` tokens of held-out windows while perturbing only the
context farther than ``b`` tokens from the first target token: truncate it, shuffle it, shuffle
within 20-token spans, replace it with random tokens, or replace it with a span of the same
length from elsewhere in the held-out text (the in-distribution control: fluent text that is
not this document's). The relative increase in loss against ``b`` shows how far back each
model still uses the context, and from where it only uses a bag of tokens (shuffling hurts
little) rather than their order. Each effect is a mean over thousands of scored targets, with
a paired 95% interval over seeds x windows (``experiments.stats``); "uses" and "order is used"
are said only where the interval excludes zero. Published: the LSTM's loss stops
changing beyond ~150-250 tokens and word order matters only within ~20-50 tokens; a
transformer should keep using context, and its order, much further back.

    python -m experiments.context_usage                 # default: 3 seeds, byte units
    python -m experiments.context_usage --scale large   # sentencepiece units (needs --data)
    python -m experiments.context_usage --units sentencepiece --data PATH

Units. The paper's tokens are words; SentencePiece pieces (2,048, trained on the training
split) are the nearest here, and ``--scale large`` uses them. The default corpus is too small
for them: its 350 KB are 98k pieces, and the default GPT trained on 6.1M piece tokens (62
epochs) memorised them (training loss 0.97) and scored 6.22 nats held out, worse than the
unigram (5.88; Kneser-Ney 3-gram 3.71). So the default scale counts bytes (512 bytes: about
90 words of context), where the same text supports models past the n-grams; give
``--units sentencepiece`` a corpus of millions of words.
"""

from __future__ import annotations

import argparse

import numpy as np

from experiments import common
from experiments.common import (
    baselines_line,
    heldout_split,
    markdown_table,
    mean_std,
    ngram_baselines,
    plot_seeds,
    stream,
    trained,
    window_losses,
    write_results,
)
from experiments.stats import paired_interval
from transformers_jax import ModelConfig, TrainConfig
from transformers_jax.backends import prepare_host
from transformers_jax.registry import TOKENIZERS

SPAN = 20

SCALES = {
    "tiny": (dict(d_model=32, n_layers=1, n_heads=2), dict(steps=16, batch_size=4, seq_len=48),
             16, (4, 16), 4_000, 8),
    # 512 bytes of context, 256 windows x 16 targets = 4,096 scored targets per seed; 3.1M
    # tokens (9 epochs of the default corpus), the budget that takes a GPT past the 3-gram
    "default": (dict(d_model=128, n_layers=3, n_heads=4), dict(steps=750, batch_size=8,
                seq_len=512), 16, (5, 10, 20, 50, 100, 200, 400), 200_000, 256),
    "large": (dict(d_model=512, n_layers=8, n_heads=8), dict(steps=5000, batch_size=32,
              seq_len=1024), 32, (5, 10, 20, 50, 100, 200, 500, 900), 400_000, 256),
}


def _shuffled_spans(far: np.ndarray, rng) -> np.ndarray:
    """Order kept across SPAN-token spans, lost within each."""
    for start in range(0, len(far), SPAN):
        rng.shuffle(far[start : start + SPAN])
    return far


def _corpus_span(far: np.ndarray, rng, vocab: int, corpus: np.ndarray | None) -> np.ndarray:
    if corpus is None or len(corpus) <= len(far):
        raise ValueError("corpus_span needs a corpus longer than the replaced context")
    start = int(rng.integers(0, len(corpus) - len(far)))
    return corpus[start : start + len(far)].astype(far.dtype)


# kind -> (far context (a copy), rng, vocab, corpus) -> what replaces it
PERTURB = {
    "truncate": lambda far, rng, vocab, corpus: far[:0],
    "shuffle": lambda far, rng, vocab, corpus: rng.permutation(far),
    "shuffle_spans": lambda far, rng, vocab, corpus: _shuffled_spans(far, rng),
    "random": lambda far, rng, vocab, corpus: rng.integers(0, vocab, len(far)).astype(far.dtype),
    "corpus_span": _corpus_span,  # the in-distribution control: real text, not this one's
}
PERTURBATIONS = list(PERTURB)


def perturb(window: np.ndarray, cut: int, kind: str, rng, vocab: int,
            corpus: np.ndarray | None = None) -> np.ndarray:
    """Perturb ``window[:cut]`` (the context beyond the boundary); keep the rest as is.
    ``corpus_span`` takes the replacement from ``corpus`` at a random place."""
    if kind not in PERTURB:
        raise ValueError(f"unknown perturbation {kind!r}; valid: {', '.join(PERTURB)}")
    far = PERTURB[kind](window[:cut].copy(), rng, vocab, corpus)
    return np.concatenate([far, window[cut:]])


def target_loss(losses_fn, params, windows: list[np.ndarray], target: int) -> np.ndarray:
    """Each window's mean loss of its last ``target`` tokens ``[windows]``, windows grouped by
    length (one compile each)."""
    by_len: dict[int, list[int]] = {}
    for i, w in enumerate(windows):
        by_len.setdefault(len(w), []).append(i)
    out = np.zeros(len(windows), np.float64)
    for rows in by_len.values():
        arr = np.stack([windows[i] for i in rows])
        loss = np.asarray(losses_fn(params, arr[:, :-1], arr[:, 1:]))[:, -target:]
        out[rows] = loss.mean(axis=1)
    return out


def measure(model, params, tokens, seq_len, target, boundaries, n_windows, vocab, seed):
    losses_fn = window_losses(model)
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=n_windows)
    windows = [tokens[s : s + seq_len + 1] for s in starts]
    base_W = target_loss(losses_fn, params, windows, target)
    base = float(base_W.mean())
    out = {"base": base, "targets": int(len(windows) * target)}
    first_target = seq_len + 1 - target  # index (in the window) of the first scored input
    for kind in PERTURBATIONS:
        for b in boundaries:
            cut = first_target - b
            if cut <= 0:
                continue
            perturbed = [perturb(w, cut, kind, rng, vocab, tokens) for w in windows]
            # each window's change, relative to the mean unperturbed loss: pairs by window
            rel_W = (target_loss(losses_fn, params, perturbed, target) - base_W) / base
            out[f"{kind}/{b}"] = float(rel_W.mean())
            out[f"{kind}/{b}/windows"] = rel_W.tolist()
    return out


def comparisons(results: dict, boundaries) -> dict:
    """Per family, perturbation and boundary: the relative loss increase with its paired 95%
    interval over seeds x windows (``experiments.stats``)."""
    out = {}
    for family, runs in results.items():
        for kind in PERTURBATIONS:
            for b in boundaries:
                key = f"{kind}/{b}/windows"
                if not all(key in r for r in runs):
                    continue
                out[f"{family}/{kind}/{b}"] = paired_interval(
                    np.array([r[key] for r in runs])).as_dict()
    return out


UNITS = {"bytes": ("byte", None), "sentencepiece": ("sentencepiece", 2048)}
# each scale's units (see the module docstring: the default corpus is too small for pieces)
SCALE_UNITS = {"tiny": "sentencepiece", "default": "bytes", "large": "sentencepiece"}


def run(scale: str, seeds: int, data: str | None, split_seed: int = 0,
        units: str | None = None, shuffle_rows: int | None = None) -> dict:
    """Both families on the same units: ``sentencepiece`` (a unigram model of 2,048 pieces
    trained on the training split, about word-sized: what the paper's "tokens" mean) or raw
    ``bytes``; the held-out stream and the n-gram baselines are in those units."""
    model_fields, train_fields, target, boundaries, n_eval, n_windows = SCALES[scale]
    if units is None:
        units = SCALE_UNITS[scale]
        if units == "sentencepiece" and data is None and scale != "tiny":
            print("context_usage: no --data, so bytes (the default corpus is too small for "
                  "sentencepiece units)", flush=True)
            units = "bytes"
    if units == "sentencepiece" and data is None and scale != "tiny":
        raise ValueError("sentencepiece units on the default 350 KB corpus memorise it (see "
                         "the module docstring): give --data a corpus of millions of words, or "
                         "use --units bytes")
    seq_len = train_fields["seq_len"]
    results: dict = {}
    split, tokens, base = heldout_split(data, n_eval, split_seed)
    kind, vocab = UNITS[units]
    if scale == "tiny" and vocab:
        vocab = 512  # what a tiny corpus supports
    unit_tokens, pieces = None, None
    for family, extra in (("gpt", {"position": "rope"}), ("lstm", {})):
        for seed in range(seeds):
            model_cfg = ModelConfig(family=family, **model_fields, **extra)
            train_cfg = TrainConfig(seed=seed, data=split.train_data, pack="none",
                                    shuffle_rows=shuffle_rows,
                                    val_fraction=0.01, tokenizer=kind, tokenizer_vocab=vocab,
                                    eval_every=train_fields["steps"],
                                    # tenths: the last two logged means are whole tenths
                                    log_every=max(train_fields["steps"] // 10, 1),
                                    **train_fields)
            model, params, tokenizer, final = trained("context_usage", model_cfg, train_cfg)
            if TOKENIZERS.get(kind).needs_text:  # a trained vocabulary: its own units
                probe = list(tokenizer.encode("the context of a word"))
                if pieces is None:  # the first run's tokenizer: held-out text in its units
                    pieces = probe
                    unit_tokens = stream(tokenizer, split.heldout)
                    base = ngram_baselines(split, tokenizer, unit_tokens)
                elif probe != pieces:
                    raise RuntimeError("the runs trained different tokenizers on the same "
                                       "text: the families would not share units")
                tokens = unit_tokens
            row = measure(model, params, tokens, seq_len, target, boundaries, n_windows,
                          tokenizer.vocab_size, seed)
            # the logged training loss: flat over the last quarter = trained to convergence
            row["train_curve"] = [(h["step"], h["loss"]) for h in final.get("history", [])]
            row["eval_loss"] = final.get("eval_loss")
            results.setdefault(family, []).append(row)
            print(f"{family} seed {seed}: base {row['base']:.3f}; " + ", ".join(
                f"{k}={v:+.3f}" for k, v in row.items()
                if isinstance(v, float) and k not in ("base", "eval_loss")
                and "/windows" not in k), flush=True)
    return {"scale": scale, "seeds": seeds, "units": units, "tokenizer_vocab": vocab,
            "seq_len": seq_len, "target": target,
            "boundaries": list(boundaries), "data": split.meta(),
            "heldout_tokens": int(tokens.size), "baselines": base, "results": results,
            "train": train_fields, "comparisons": comparisons(results, boundaries),
            "shuffle_rows": common.resolved_shuffle_rows(shuffle_rows)}


def convergence(runs: list[dict]) -> str:
    """"; training loss A -> B over the last quarter" (mean over seeds): a flat end says the
    model was trained to convergence at this budget."""
    curves = [r.get("train_curve") or [] for r in runs]
    if not all(len(c) >= 2 for c in curves):
        return ""
    before = float(np.mean([c[-2][1] for c in curves]))
    after = float(np.mean([c[-1][1] for c in curves]))
    return (f"; training loss {before:.3f} -> {after:.3f} ({100 * (after / before - 1):+.1f}%) "
            f"from step {curves[0][-2][0]} to {curves[0][-1][0]}")


def report(out: dict, rebuilt: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bounds = out["boundaries"]
    # each panel its own y-limits: the effects differ in size by an order of magnitude
    fig, axes = plt.subplots(1, len(PERTURBATIONS), figsize=(18, 3.6))
    tables = []
    for family, runs in out["results"].items():
        rows = []
        for kind in PERTURBATIONS:
            cells = [mean_std([r.get(f"{kind}/{b}", float("nan")) for r in runs])[0]
                     for b in bounds]
            rows.append([kind, *[f"{100 * c:+.1f}%" for c in cells]])
        base = mean_std([r["base"] for r in runs])
        unit = {"sentencepiece": "sentencepiece pieces", "bytes": "bytes"}.get(
            out.get("units", "bytes"), "tokens")
        tables.append(f"**{family}** (tokens are {unit}; unperturbed loss of the last "
                      f"{out['target']} tokens "
                      f"{base[0]:.3f} nats{convergence(runs)}; "
                      f"{common.rows_line(out.get('shuffle_rows', 0))}): relative loss "
                      "increase when "
                      f"the context beyond b tokens is perturbed\n\n"
                      + markdown_table(["perturbation", *[f"b={b}" for b in bounds]], rows))
    for ax, kind in zip(axes, PERTURBATIONS, strict=True):
        for family, runs in out["results"].items():
            ys = [[100 * r.get(f"{kind}/{b}", float("nan")) for b in bounds] for r in runs]
            plot_seeds(ax, bounds, ys, family)
        ax.axhline(0, color="black", linewidth=0.6)
        ax.set_title(kind)
        ax.set_xscale("log")
        ax.set_xlabel("boundary b (tokens before the targets)")
    axes[0].set_ylabel("loss increase (%): mean, band = range over seeds")
    axes[-1].legend()
    if out.get("baselines"):
        tables.append(baselines_line(out["baselines"]) + " The unperturbed losses above score "
                      "only the last tokens of each window, so compare them loosely.")
    write_results(f"context_usage_{out['scale']}", out, "\n\n".join(tables), fig,
                  rebuilt=rebuilt)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=sorted(SCALES), default="default")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--data", default=None, help="a file/folder/glob, lines:PATH or "
                        "tfds:NAME (default: the embedded corpus)")
    parser.add_argument("--split-seed", type=int, default=0, help="seed of the held-out draw")
    parser.add_argument("--units", choices=sorted(UNITS), default=None,
                        help="what a token is: sentencepiece pieces (about words, as the "
                        "paper; needs a corpus of millions of words) or bytes (default: "
                        + ", ".join(f"{k} at {s}" for s, k in SCALE_UNITS.items()) + ")")
    common.add_shuffle_rows_option(parser)
    common.add_replot_option(parser)
    args = parser.parse_args(argv)
    if common.replotted(args, parser, f"context_usage_{args.scale}", report):
        return
    report(run(args.scale, args.seeds, args.data, args.split_seed, args.units,
               shuffle_rows=args.shuffle_rows))


if __name__ == "__main__":
    prepare_host()  # e.g. XLA:CPU's buffers on huge pages: see backends/cpu_malloc.py
    main()
