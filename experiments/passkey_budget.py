"""How many training tokens before a model retrieves passkeys at its training length.

The passkey positive control of the RoPE-extension script (retired for the sweep
``experiments/specs/rope_extension.toml``) failed at the default scale (``experiments.passkey``
says what was tried). This measures where it would pass: one long run of that script's base
model on the same pair-mixed training text, a checkpoint every ``--every`` steps, and at each
checkpoint the retrieval accuracy at the training length (every depth, ``--per-cell`` windows
each) and the held-out loss. The learning rate follows one warmup-cosine schedule over the
whole run, as a run of that length would. ``SCALES`` holds that base model, training length
and batch at each ``--scale``.

    python -m experiments.passkey_budget                    # 20,000 steps (20M tokens)
    taskset -c 1 python -m experiments.passkey_budget --steps 4000 --every 1000

Time on this machine's cores (2026-12-04, pinned to one): 30,000 steps about 50 min, 10,000
about 17, then about 1 min of scoring; a finished run is kept (``--run-dir``), so a second
call only scores it (its JSON's ``wall_seconds`` is then that pass's).

Prints one line per checkpoint and writes ``results/passkey_budget_<scale>[_copies<N>].json``
(the command, the config, accuracy and loss by step).
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from experiments import common
from experiments.common import (
    baselines_line,
    eval_loss,
    heldout_split,
    markdown_table,
    write_results,
)
from experiments.passkey import digit_grid, mixed_training_data, whole_keys
from transformers_jax import ModelConfig, TrainConfig
from transformers_jax.backends import prepare_host
from transformers_jax.loop import train
from transformers_jax.models import build_model
from transformers_jax.runs import load_run

# the retired RoPE-extension script's base model at each scale: (model, training length and
# batch, held-out bytes); kept as they were, so that the committed results are this command's
SCALES = {
    "tiny": (dict(d_model=32, n_layers=1, n_heads=2), dict(batch_size=4, seq_len=32), 2_000),
    "default": (dict(d_model=128, n_layers=4, n_heads=4), dict(batch_size=16, seq_len=64),
                200_000),
    "large": (dict(d_model=512, n_layers=8, n_heads=8), dict(batch_size=64, seq_len=256),
              400_000),
}
FACTOR = 4  # the long gaps of the key/query pairs reach FACTOR x the training length


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", choices=sorted(SCALES), default="default",
                   help="the base model, training length and batch of this scale (SCALES)")
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--every", type=int, default=2_000, help="steps between scored checkpoints")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--pairs-every", type=int, default=32,
                   help="a key/query pair about every N training bytes")
    p.add_argument("--copies", type=int, default=1,
                   help="copies of the training text, each with its own keys")
    p.add_argument("--per-cell", type=int, default=40, help="windows per depth")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default=None,
                   help="where the run's checkpoints go (default: under results/.cache)")
    p.add_argument("--data", default=None)
    args = p.parse_args(argv)
    if args.every <= 0 or args.steps % args.every:
        p.error(f"--every {args.every} must divide --steps {args.steps}")

    model_fields, train_fields, n_eval = SCALES[args.scale]
    L, batch_size = train_fields["seq_len"], train_fields["batch_size"]
    split, tokens, base = heldout_split(args.data, n_eval)
    data, meta = mixed_training_data(split, L, FACTOR, every=args.pairs_every,
                                     copies=args.copies)
    model_cfg = ModelConfig(position="rope", **model_fields)
    train_cfg = TrainConfig(seed=args.seed, data=data, val_fraction=0.01, steps=args.steps,
                            batch_size=batch_size, seq_len=L,
                            learning_rate=args.learning_rate, eval_every=args.steps,
                            checkpoint_every=args.every, keep_checkpoints=10_000,
                            log_every=args.every, progress=False)
    run_dir = args.run_dir or os.path.join(
        common.RESULTS, ".cache", "passkey_budget", common.cache_key(model=model_cfg,
                                                                       train=train_cfg))
    if not os.path.exists(os.path.join(run_dir, "checkpoints", str(args.steps))):
        train(model_cfg, train_cfg.replace(run_dir=run_dir, resume=True), auto_vocab=True)
    heldout_text = b"\n".join(split.heldout)
    rows = []
    for step in range(args.every, args.steps + 1, args.every):
        _, params, tokenizer, _ = load_run(run_dir, step=step)
        model = build_model(model_cfg.replace(vocab_size=tokenizer.vocab_size))
        grid = digit_grid(model, params, heldout_text, tokenizer, [L], args.per_cell)[str(L)]
        by_depth = {d: float(whole_keys(m).mean()) for d, m in grid.items()}
        # per digit: chance is about 0.1, so a rise shows partial retrieval before whole keys
        row = {"step": step, "tokens": step * batch_size * L,
               "accuracy": float(np.mean(list(by_depth.values()))), "by_depth": by_depth,
               "digit_accuracy": float(np.mean([m.mean() for m in grid.values()])),
               "heldout_loss": eval_loss(model, params, tokens, L)}
        rows.append(row)
        print(f"step {step:6d} ({row['tokens'] / 1e6:.1f}M tokens): passkey at L={L} "
              f"{row['accuracy']:.2f} (per digit {row['digit_accuracy']:.2f}), held-out loss "
              f"{row['heldout_loss']:.3f}", flush=True)
    table = markdown_table(
        ["step", "training tokens", f"passkey accuracy at L={L}", "per digit (chance 0.1)",
         "held-out loss"],
        [[r["step"], f"{r['tokens'] / 1e6:.1f}M", r["accuracy"], r["digit_accuracy"],
          r["heldout_loss"]]
         for r in rows]) + "\n\n" + baselines_line(base)
    name = f"passkey_budget_{args.scale}" + (f"_copies{args.copies}" if args.copies > 1 else "")
    write_results(name, {
        "model": model_cfg.to_dict(), "train": {
            "scale": args.scale, "steps": args.steps, "batch_size": batch_size, "seq_len": L,
            "learning_rate": args.learning_rate, "seed": args.seed},
        "passkey_data": meta, "per_cell": args.per_cell, "baselines": base, "by_step": rows},
        table)


if __name__ == "__main__":
    prepare_host()  # e.g. XLA:CPU's buffers on huge pages: see backends/cpu_malloc.py
    main()
