"""``tjax plan``'s options, the JSON object it prints, and its entry point."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import jax

from transformers_jax.config import ConfigError, ModelConfig, TrainConfig
from transformers_jax.learning import lora
from transformers_jax.models import build_model, family_of
from transformers_jax.nn.stack import REMAT_POLICIES
from transformers_jax.overrides import CommandParser, Once, print_json, write_json
from transformers_jax.parallel.mesh import parse_mesh
from transformers_jax.plan.steps import (
    DEFAULT_REMATS,
    MESH_SETS,
    MIN_CONTEXT_SHARD,
    compare_context_methods,
    compile_decode,
    compile_train,
    search,
)
from transformers_jax.plan.summary import summary
from transformers_jax.plan.targets import Target, make_target

# short forms of config fields, as in the issue: --mesh, --batch, --seq-len, --remat
PLAN_ALIASES = {"mesh": "train.mesh", "batch": "train.batch_size", "seq_len": "train.seq_len",
                "remat": "model.remat", "strategy": "train.strategy"}


def plan_parser() -> CommandParser:
    parser = CommandParser(
        "tjax plan", "Compiles the real training step (and a KV-cache decoding step) of a config "
        "for a TPU topology without the hardware (needs libtpu: pip install -e '.[tpu]') and "
        "prints one JSON object: per-device memory and whether it fits in HBM, FLOPs and bytes "
        "per step, the collectives and the bytes they move, and a datasheet roofline of step "
        "time and MFU (estimates, not runs). Every --model./--train. option of `tjax train "
        "--help` applies; the strategy defaults to jit.", overrides=True)
    parser.add_argument("--target", required=True, metavar="GEN:SHAPE",
                        help="v3, v4, v5e, v5p or v6e and chips per axis, e.g. v5e:2x4, v5p:4x4x4; "
                        "or h100/h200 and GPUs (per host), e.g. h100:8, h200:2x8 (gpu-plan "
                        "extra)")
    parser.add_argument("--slices", type=int, default=1, metavar="N",
                        help="that many slices (multi-slice)")
    parser.add_argument("--preset", metavar="NAME", action=Once,
                        help="start from a named model ('tjax presets' lists them)")
    parser.add_argument("--mesh", metavar="data=..,fsdp=..,tensor=..", help="--train.mesh")
    parser.add_argument("--batch", type=int, metavar="B", help="--train.batch_size")
    parser.add_argument("--seq-len", type=int, metavar="T", help="--train.seq_len")
    parser.add_argument("--remat", metavar="POLICY", help="--model.remat")
    parser.add_argument("--strategy", metavar="jit|shard_map|single",
                        help="--train.strategy (default jit)")
    parser.add_argument("--seeds", type=int, default=1, metavar="S",
                        help="the step of S seeds trained together (train.seeds), each "
                        "on one device, spread over as many of the target's as divide S "
                        "(needs --strategy single)")
    parser.add_argument("--search", action="store_true", help="try every mesh (and remat "
                        "policy until one fits); report the fastest fit")
    parser.add_argument("--search-meshes", default="all", choices=MESH_SETS,
                        help="the meshes --search tries: all (every data x fsdp x context x "
                        "tensor split) or fsdp (pure data parallel, and FSDP x context x tensor "
                        "within a host); sequences split only into shards of at least "
                        f"{MIN_CONTEXT_SHARD} tokens, each way of attending across them tried")
    parser.add_argument("--remats", default=",".join(DEFAULT_REMATS), metavar="A,B",
                        help="remat policies --search tries, cheapest first")
    parser.add_argument("--no-decode", action="store_true", help="skip the decoding step")
    parser.add_argument("--decode-batch", type=int, metavar="B",
                        help="decoding batch (default: the training batch)")
    parser.add_argument("--json", action="store_true",
                        help="print every figure as one JSON object (default: a summary)")
    parser.add_argument("--out", metavar="FILE", help="write the JSON there too")
    return parser


def plan(model_cfg: ModelConfig, cfg: TrainConfig, target: Target, *, do_search: bool = False,
         remats: tuple[str, ...] = DEFAULT_REMATS, decode: bool = True,
         decode_batch: int | None = None, log: Callable[[str], None] = lambda _: None,
         meshes: str = "all", seeds: int = 1) -> dict[str, Any]:
    """The JSON object of ``tjax plan`` (see the module docstring); ``seeds``: plan the step
    of that many seeds trained together, each on one device (strategy single)."""
    if cfg.strategy == "pmap":
        raise ConfigError("train.strategy='pmap' runs on this host's devices only; plan "
                          "strategy jit, shard_map or single")
    unknown = [r for r in remats if r not in REMAT_POLICIES]
    if unknown:
        raise ConfigError(f"--remats: unknown policies {unknown}; valid: "
                          f"{', '.join(REMAT_POLICIES)}")
    if cfg.mesh is not None:
        parse_mesh(cfg.mesh, len(target.devices))  # a clear error before any compile
    if seeds < 1:
        raise ConfigError(f"--seeds {seeds}: must be a positive number of seeds")
    if seeds > 1 and (cfg.strategy != "single" or do_search):
        raise ConfigError(f"--seeds {seeds}: each seed trains on one device; add "
                          "--strategy single (and drop --search, which tries meshes)")
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
        "concurrent_groups": cfg.concurrent_groups,
        "jax": jax.__version__,
        "note": "compiler figures (XLA memory and cost analysis of the program compiled for "
                "the target) and a datasheet roofline: estimates, not measured runs",
    }
    if cfg.lora.enabled:
        result["lora"] = lora_memory(model_cfg, cfg)
    if do_search:
        found = search(model_cfg, cfg, target, remats, log, meshes)
        result["search"] = found["tried"]
        result["train"] = found["best"]
        if found["best"] is None:
            result["train_note"] = "no mesh and remat policy tried fits in HBM"
    else:
        log(f"compiling the training step for {target.name} (the TPU compiler takes seconds "
            "to minutes)")
        result["train"] = compile_train(model_cfg, cfg, target, seeds)
        if "context_attention" in result["train"]:  # the mesh splits sequences: which way?
            result["context"] = compare_context_methods(model_cfg, cfg, target, result["train"])
    decodes = family_of(model_cfg).generates == "self" and model_cfg.mask.decodes
    if decode and decodes and result["train"] is not None and result["train"]["roofline"]:
        log(f"compiling the decoding step for {target.name} (--no-decode skips it)")
        result["decode"] = compile_decode(
            dataclasses.replace(model_cfg, remat="none"), cfg, target,
            decode_batch or cfg.batch_size, cfg.seq_len, result["train"]["mesh"])
    else:
        result["decode"] = None
    return result


def lora_memory(model_cfg: ModelConfig, cfg: TrainConfig) -> dict[str, Any]:
    """``--train.lora.rank``: what the adapters train and keep, counted from the shapes
    (``lora.memory_count``), beside the same figures for a full fine-tune. Bytes in the
    parameter dtype, for the whole model (not per device); the compiled step's ``memory``
    is XLA's per-device figure of the LoRA step."""
    counted = lora.memory_count(build_model(model_cfg), cfg.lora)
    return {
        "rank": cfg.lora.rank, "alpha": cfg.lora.scale * cfg.lora.rank,  # alpha / rank = scale
        "targets": list(cfg.lora.targets),
        "trainable_params": counted["adapter_params"],
        "frozen_params": counted["params"],
        "trainable_fraction": counted["adapter_params"] / counted["params"],
        "adapter_bytes": counted["adapter_bytes"],
        "optimizer_state_bytes": counted["adapter_optimizer_bytes"],
        "full_finetune_optimizer_state_bytes": 2 * counted["weights_bytes"],
        "kept_between_steps_bytes": counted["lora_bytes"],
        "full_finetune_kept_between_steps_bytes": counted["full_finetune_bytes"],
        "step_extra_bytes_at_most": counted["lora_step_extra_bytes"],
    }


def main(argv: list[str], build_configs: Callable[[list[str]], tuple[ModelConfig, TrainConfig]]
         ) -> int:
    """``tjax plan``; ``build_configs`` is ``tjax train``'s reader of ``--preset``,
    ``--model.*``, ``--train.*`` and ``--config``, passed in by ``cli.py`` so that both read a
    config the same way."""
    parser = plan_parser()
    args, overrides, config_file = parser.parse(argv)
    overrides = {"train.strategy": "jit", **overrides}  # plans are for meshes: jit unless told
    for option, field in PLAN_ALIASES.items():
        if getattr(args, option) is not None:
            overrides[field] = str(getattr(args, option))
    rest = [f"--{key}={value}" for key, value in overrides.items()]
    rest += ["--preset", args.preset] if args.preset else []
    rest += ["--config", config_file] if config_file else []
    model_cfg, cfg = build_configs(rest)
    target = make_target(args.target, args.slices)
    remats = tuple(r for r in args.remats.split(",") if r)
    result = plan(model_cfg, cfg, target, do_search=args.search, remats=remats,
                  decode=not args.no_decode, decode_batch=args.decode_batch,
                  log=lambda text: print(text, file=sys.stderr), meshes=args.search_meshes,
                  seeds=args.seeds)
    if args.json:
        print_json(result, args.out)
    else:
        print(summary(result))
        if args.out:
            write_json(result, args.out)
    return 0
