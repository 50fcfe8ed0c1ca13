"""Plans of named model shapes on TPU targets: the rows of the README's "what fits where" table.

    python benchmarks/plan_presets.py                      # every config x target below
    python benchmarks/plan_presets.py --only gpt2-small --targets v5e:2x4 --out plans.jsonl

For each config and target it runs ``tjax plan --search`` (every mesh, and remat policies until
one fits) and prints one JSON line per row: fits?, best mesh and remat, per-chip memory,
predicted step time and MFU, and the command that reproduces it. These are compiler figures
(XLA memory and cost analysis of the TPU program) and a datasheet roofline, not measured runs.
Large models take minutes per compile on a CPU host; run it alone.

The configs are written out as ``--model.*`` overrides below. Once ``--preset NAME`` exists
(``ModelConfig.preset``), replace each override list by ``["--preset", NAME]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from transformers_jax.cli import build_configs
from transformers_jax.plan import DEFAULT_REMATS, plan, tpu_target

GPT = ["--model.position=learned", "--model.dtype=bfloat16", "--model.dropout=0.0",
       "--model.vocab_size=50304", "--model.max_len=1024"]
BERT = ["--family", "bert", "--model.dtype=bfloat16", "--model.dropout=0.0",
        "--model.vocab_size=30528", "--model.max_len=512"]
LLAMA = ["--model.position=rope", "--model.norm=rmsnorm", "--model.mlp=swiglu",
         "--model.dtype=bfloat16", "--model.dropout=0.0", "--model.vocab_size=128256",
         "--model.max_len=8192", "--model.scan_layers=true"]


def shape(layers: int, width: int, heads: int, **more: int) -> list[str]:
    extra = [f"--model.{k}={v}" for k, v in more.items()]
    return [f"--model.n_layers={layers}", f"--model.d_model={width}",
            f"--model.n_heads={heads}", *extra]


# name -> (overrides, global batch, sequence length); standard published shapes
CONFIGS: dict[str, tuple[list[str], int, int]] = {
    "gpt2-small": (GPT + shape(12, 768, 12), 32, 1024),
    "gpt2-medium": (GPT + shape(24, 1024, 16), 32, 1024),
    "gpt2-large": (GPT + shape(36, 1280, 20), 32, 1024),
    "gpt2-xl": (GPT + shape(48, 1600, 25), 32, 1024),
    "bert-base": (BERT + shape(12, 768, 12), 64, 512),
    "bert-large": (BERT + shape(24, 1024, 16), 64, 512),
    "t5-base": (["--family", "encdec", "--model.dtype=bfloat16", "--model.dropout=0.0",
                 "--model.vocab_size=32128", "--model.position=t5"]
                + shape(12, 768, 12, d_ff=3072), 64, 512),
    "llama3-1b": (LLAMA + shape(16, 2048, 32, n_kv_heads=8, d_ff=8192), 32, 2048),
    "llama3-8b": (LLAMA + shape(32, 4096, 32, n_kv_heads=8, d_ff=14336), 32, 2048),
}
TARGETS = ("v5e:2x4", "v5p:2x2x1", "v5p:4x4x4")  # v5e-8, v5p-8, v5p-64 (16 hosts)


def row(name: str, target_name: str, attention: str) -> dict:
    overrides, batch, seq_len = CONFIGS[name]
    argv = [*overrides, f"--model.attention={attention}", "--train.strategy=jit",
            f"--train.batch_size={batch}", f"--train.seq_len={seq_len}"]
    model_cfg, cfg = build_configs(argv)
    target = tpu_target(target_name)
    wall = time.perf_counter()
    result = plan(model_cfg, cfg, target, do_search=True, remats=DEFAULT_REMATS, decode=False,
                  log=lambda text: print(f"  {name} {target_name}: {text}", file=sys.stderr))
    best = result["train"]
    command = " ".join(["tjax plan --target", target_name, "--search --no-decode", *argv])
    out = {"config": name, "target": target_name, "batch": batch, "seq_len": seq_len,
           "attention": attention, "fits": best is not None, "command": command,
           "plan_s": time.perf_counter() - wall}
    if best is not None:
        out.update(mesh=best["mesh"], remat=best["remat"], params=best["params"],
                   bytes_per_chip=best["memory"]["total_bytes"] * target.devices_per_chip,
                   step_s=best["roofline"]["step_s"], mfu=best["roofline"]["mfu"],
                   bound=best["roofline"]["bound"])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated config names")
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--attention", default="chunked", help="xla, chunked or pallas")
    parser.add_argument("--out", default=None, help="also append the JSON lines here")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(CONFIGS)
    for name in names:
        for target in args.targets.split(","):
            text = json.dumps(row(name, target, args.attention))
            print(text, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
