"""One process of a multi-process data-parallel run on this machine's CPU (see
``test_parallel_multihost.py``). Prints one JSON line: this process's losses and the final
parameters' per-leaf checksums; process 0 alone writes ``metrics.jsonl`` and ``params.npz``.

    python tests/multihost_worker.py --coordinator 127.0.0.1:PORT --num-processes 2 \\
        --process-id 0 --local-devices 2 --mesh data=2,fsdp=2 --out DIR

    python tests/multihost_worker.py tjax-train ARGS...

runs ``tjax train ARGS`` (``python -m transformers_jax.cli train``) with the CPU's peak FLOP/s
given instead of measured (a timed 2048^3 matmul in every process of every launch, for MFU
figures no multi-host test reads).

Only numpy at import time: the JAX device count must be set before JAX is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

VOCAB, B, T, STEPS = 64, 16, 16, 3


def make_batches(steps: int = STEPS, seed: int = 0) -> list[dict]:
    """The global batches, a pure function of the seed; the first half of the rows keeps only
    its last four targets, so the processes' token counts differ."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        tokens = rng.integers(0, VOCAB, (B, T + 1)).astype(np.int32)
        weights = np.ones((B, T), np.float32)
        weights[: B // 2, : T - 4] = 0.0
        out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights})
    return out


def model_and_optimizer():
    from transformers_jax import ModelConfig, TrainConfig, build_model
    from transformers_jax.learning.optim import make_optimizer

    cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=4, max_len=32)
    optimizer = make_optimizer(TrainConfig(steps=10, warmup_steps=2, learning_rate=1e-3))
    return build_model(cfg), optimizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", default=None)
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--local-devices", type=int, default=1)
    parser.add_argument("--strategy", default="jit")
    parser.add_argument("--mesh", default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_num_cpu_devices", args.local_devices)
    jax.config.update("jax_default_matmul_precision", "highest")
    from transformers_jax.parallel import initialize, is_main_process, make_trainer
    from transformers_jax.parallel.multihost import fetch

    if args.num_processes > 1:
        initialize(args.coordinator, args.num_processes, args.process_id)
    assert jax.process_count() == args.num_processes
    assert jax.device_count() == args.num_processes * args.local_devices

    model, optimizer = model_and_optimizer()
    batches = make_batches()
    trainer = make_trainer(args.strategy, model, optimizer, batches[0], mesh=args.mesh)
    rows = trainer.local_rows(B)
    state = trainer.init_state(0)
    losses = []
    log = None
    if is_main_process():
        os.makedirs(args.out, exist_ok=True)
        log = open(os.path.join(args.out, "metrics.jsonl"), "w")  # noqa: SIM115
    for step, batch in enumerate(batches):
        # Each process builds (here: slices) only its own rows of the global batch.
        local = {k: v[rows] for k, v in batch.items()}
        state, metrics = trainer.step(state, trainer.place_batch(local, local=True))
        losses.append(float(metrics["loss"]))
        if log is not None:
            log.write(json.dumps({"step": step + 1, "loss": losses[-1]}) + "\n")
    params = fetch(trainer.unreplicate(state).params)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    if log is not None:
        log.close()
        np.savez(os.path.join(args.out, "params.npz"),
                 **{jax.tree_util.keystr(path): np.asarray(x) for path, x in leaves})
    print(json.dumps({
        "process": jax.process_index(),
        "rows": [rows.start, rows.stop],
        "losses": losses,
        "checksums": [float(np.abs(np.asarray(x)).sum()) for _, x in leaves],
    }), flush=True)


def tjax_train(argv: list[str]) -> int:
    """``tjax train ARGV`` as ``python -m transformers_jax.cli train ARGV`` runs it, the peak
    FLOP/s a fixed figure (MFU is no part of what the tests check)."""
    from transformers_jax.train import lanes

    lanes.device_peak = lambda dtype="float32": (1e12, "a test figure")
    from transformers_jax import cli

    return cli.main(["train", *argv])


if __name__ == "__main__":
    if sys.argv[1:2] == ["tjax-train"]:
        sys.exit(tjax_train(sys.argv[2:]))
    main()
