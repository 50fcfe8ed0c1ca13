"""``tjax plan``'s options, the JSON object it prints, and its entry point."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from typing import Any

import jax

from transformers_jax.config import ConfigError, ModelConfig, TrainConfig
from transformers_jax.models import family_of
from transformers_jax.nn.stack import REMAT_POLICIES
from transformers_jax.parallel.mesh import parse_mesh
from transformers_jax.plan.steps import DEFAULT_REMATS, compile_decode, compile_train, search
from transformers_jax.plan.targets import Target, make_target

PLAN_OPTIONS = {"--target": str, "--slices": int, "--remats": str, "--decode-batch": int,
                "--out": str}
PLAN_FLAGS = ("--search", "--no-decode")
# short forms of config fields, as in the issue: --mesh, --batch, --seq-len, --remat
PLAN_ALIASES = {"--mesh": "--train.mesh", "--batch": "--train.batch_size",
                "--seq-len": "--train.seq_len", "--remat": "--model.remat",
                "--strategy": "--train.strategy"}

PLAN_HELP = """usage: tjax plan --target v5e:2x4 [--slices N] [--mesh data=..,fsdp=..,tensor=..]
                 [--batch B] [--seq-len T] [--remat POLICY] [--strategy jit|shard_map|single]
                 [--search [--remats none,full]] [--no-decode] [--decode-batch B] [--out FILE]
                 [--model.FIELD=VALUE ...] [--train.FIELD=VALUE ...]

Compiles the real training step (and a KV-cache decoding step) of a config for a TPU topology
without the hardware (needs libtpu: pip install -e '.[tpu]') and prints one JSON object:
per-device memory and whether it fits in HBM, FLOPs and bytes per step, the collectives and
the bytes they move, and a datasheet roofline of step time and MFU (estimates, not runs).
Every --model./--train. option of `tjax train --help` applies; the strategy defaults to jit.

  --target GEN:SHAPE  v4, v5e, v5p or v6e and chips per axis, e.g. v5e:2x4, v5p:4x4x4; or
                      h100/h200 and GPUs (per host), e.g. h100:8, h200:2x8 (gpu-plan extra)
  --slices N          that many slices (multi-slice; default 1)
  --search            try every mesh (and remat policy until one fits); report the fastest fit
  --remats A,B        remat policies --search tries, cheapest first (default
                      none,dots_with_no_batch_dims_saveable,full)
  --no-decode         skip the decoding step
  --decode-batch B    decoding batch (default: the training batch)
  --out FILE          also write the JSON there"""


def split_options(argv: list[str]) -> tuple[dict, list[str]]:
    """This command's own options, and the rest as config overrides (short aliases mapped)."""
    options: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        key, eq, value = argv[i].partition("=")
        if key in PLAN_FLAGS:
            options[key] = True
        elif key in PLAN_OPTIONS or key in PLAN_ALIASES:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"option {key} needs a value")
                i += 1
                value = argv[i]
            if key in PLAN_ALIASES:
                rest.append(f"{PLAN_ALIASES[key]}={value}")
            else:
                try:
                    options[key] = PLAN_OPTIONS[key](value)
                except ValueError:
                    raise ConfigError(f"option {key} {value!r}: expected an integer") from None
        else:
            rest.append(argv[i])
        i += 1
    return options, rest


def plan(model_cfg: ModelConfig, cfg: TrainConfig, target: Target, *, do_search: bool = False,
         remats: tuple[str, ...] = DEFAULT_REMATS, decode: bool = True,
         decode_batch: int | None = None, log: Callable[[str], None] = lambda _: None
         ) -> dict[str, Any]:
    """The JSON object of ``tjax plan`` (see the module docstring)."""
    if cfg.strategy == "pmap":
        raise ConfigError("train.strategy='pmap' runs on this host's devices only; plan "
                          "strategy jit, shard_map or single")
    unknown = [r for r in remats if r not in REMAT_POLICIES]
    if unknown:
        raise ConfigError(f"--remats: unknown policies {unknown}; valid: "
                          f"{', '.join(REMAT_POLICIES)}")
    if cfg.mesh is not None:
        parse_mesh(cfg.mesh, len(target.devices))  # a clear error before any compile
    result: dict[str, Any] = {
        "target": {"name": target.name, "chip": target.chip.name, "chips": target.chips,
                   "devices": len(target.devices), "devices_per_chip": target.devices_per_chip,
                   "slices": target.slices, "hosts": target.hosts,
                   "peak_flops_per_chip": target.chip.peak_flops,
                   "hbm_bytes_per_chip": target.chip.hbm_bytes,
                   "hbm_bytes_per_s_per_chip": target.chip.hbm_bytes_per_s,
                   "ici_bytes_per_s_per_chip": target.chip.ici_bytes_per_s,
                   "datasheet": target.chip.source},
        "model": model_cfg.to_dict(),
        "batch_size": cfg.batch_size,
        "seq_len": cfg.seq_len,
        "grad_accum": cfg.grad_accum,
        "jax": jax.__version__,
        "note": "compiler figures (XLA memory and cost analysis of the program compiled for "
                "the target) and a datasheet roofline: estimates, not measured runs",
    }
    if do_search:
        found = search(model_cfg, cfg, target, remats, log)
        result["search"] = found["tried"]
        result["train"] = found["best"]
        if found["best"] is None:
            result["train_note"] = "no mesh and remat policy tried fits in HBM"
    else:
        result["train"] = compile_train(model_cfg, cfg, target)
    decodes = family_of(model_cfg).generates == "self" and model_cfg.mask.decodes
    if decode and decodes and result["train"] is not None:
        result["decode"] = compile_decode(
            dataclasses.replace(model_cfg, remat="none"), cfg, target,
            decode_batch or cfg.batch_size, cfg.seq_len, result["train"]["mesh"])
    else:
        result["decode"] = None
    return result


def main(argv: list[str], build_configs: Callable[[list[str]], tuple[ModelConfig, TrainConfig]]
         ) -> int:
    """``tjax plan``; ``build_configs`` is ``tjax train``'s parser of ``--model.*`` and
    ``--train.*`` (and ``--config``, and ``--preset`` where it parses that), passed in by
    ``cli.py`` so that both read a config the same way."""
    if any(arg in ("-h", "--help") for arg in argv):
        print(PLAN_HELP)
        return 0
    options, rest = split_options(argv)
    if "--target" not in options:
        raise ConfigError("tjax plan needs --target, e.g. --target v5e:2x4 (tjax plan --help)")
    if not any(a.startswith("--train.strategy") for a in rest):
        rest = ["--train.strategy=jit", *rest]  # plans are for meshes: jit unless told
    model_cfg, cfg = build_configs(rest)
    target = make_target(options["--target"], options.get("--slices", 1))
    remats = tuple(r for r in options.get("--remats", ",".join(DEFAULT_REMATS)).split(",") if r)
    result = plan(model_cfg, cfg, target, do_search=options.get("--search", False),
                  remats=remats, decode=not options.get("--no-decode", False),
                  decode_batch=options.get("--decode-batch"),
                  log=lambda text: print(text, file=sys.stderr))
    text = json.dumps(result)
    if options.get("--out"):
        with open(options["--out"], "w") as f:
            f.write(text + "\n")
    print(text)
    return 0
