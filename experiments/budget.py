"""Size an experiment's training budget: train one model once, score its checkpoints on the
seed-drawn held-out split, and print held-out loss by step beside the n-gram baselines (how
many steps/tokens it takes to beat the 3-gram and the 4-gram). One run, not a result.

    python -m experiments.budget --position alibi --seq-len 64 --steps 1500 --every 250
    python -m experiments.budget --run-dir /tmp/b --eval-only   # score what an interrupted
                                                                 # run left (its checkpoints)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from experiments.common import add_shuffle_rows_option, eval_loss, heldout_split
from transformers_jax import ModelConfig, TrainConfig
from transformers_jax.backends import prepare_host
from transformers_jax.loop import train
from transformers_jax.runs import load_run


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--position", default="alibi")
    p.add_argument("--data", default=None)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--tokens-per-step", type=int, default=2048)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--every", type=int, default=250)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=None)
    add_shuffle_rows_option(p)
    p.add_argument("--heldout", type=int, default=200_000)
    p.add_argument("--run-dir", default=None, help="keep the run (and its checkpoints) here")
    p.add_argument("--eval-only", action="store_true", help="score --run-dir's checkpoints")
    args = p.parse_args(argv)
    split, eval_tokens, base = heldout_split(args.data, args.heldout)
    print(json.dumps({"data": split.meta(), "baselines": base}), flush=True)
    model_cfg = ModelConfig(position=args.position, max_len=args.seq_len, d_model=args.d_model,
                            n_layers=args.layers, n_heads=args.heads)
    extra = {} if args.lr is None else {"learning_rate": args.lr}
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run_dir or os.path.join(tmp, "run")
        cfg = TrainConfig(data=split.train_data, seq_len=args.seq_len, steps=args.steps,
                          batch_size=max(args.tokens_per_step // args.seq_len, 1),
                          eval_every=args.steps, log_every=args.every, val_fraction=0.01,
                          checkpoint_every=args.every, keep_checkpoints=args.steps // args.every
                          + 1, run_dir=run_dir, progress=False,
                          shuffle_rows=args.shuffle_rows, **extra)
        if not args.eval_only:
            start = time.perf_counter()
            train(model_cfg, cfg, auto_vocab=True)
            seconds = time.perf_counter() - start
            print(json.dumps({"train_seconds": round(seconds, 1),
                              "seconds_per_step": round(seconds / args.steps, 3)}), flush=True)
        steps = sorted(int(d) for d in os.listdir(os.path.join(run_dir, "checkpoints"))
                       if d.isdigit())
        for step in steps:
            model, params, _, _ = load_run(run_dir, step=step)
            loss = eval_loss(model, params, eval_tokens, args.seq_len)
            print(json.dumps({"step": step, "tokens": step * cfg.batch_size * args.seq_len,
                              "heldout_loss": round(loss, 4),
                              "beats": [k for k in ("3-gram", "4-gram", "5-gram")
                                        if loss < base[k]]}), flush=True)


if __name__ == "__main__":
    prepare_host()  # e.g. XLA:CPU's buffers on huge pages: see backends/cpu_malloc.py
    main()
