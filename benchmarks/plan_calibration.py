"""``tjax plan``'s per-operation roofline against published training runs (its calibration).

    python benchmarks/plan_calibration.py --out benchmarks/results/plan_calibration.json
    python benchmarks/plan_calibration.py --only llama3.1-8b-v6e-8 --hlo-dir /tmp/hlo
    python benchmarks/plan_calibration.py --table benchmarks/results/plan_calibration.json

Each row is a published run (MaxText's TPU recipes: model, chips, batch per device, sequence
length, measured TFLOP/s per device; NVIDIA's MaxText run on one host of 8 H100s, which needs
the gpu-plan extra) planned here on the same model shape, batch per device,
sequence and FSDP layout, on the largest slice of the same chip that compiles on a small host
(``target``, with ``layers`` of the model's layers where the whole stack is too large: the
per-chip work of a layer and its FSDP gathers do not depend on the slice size, the share of
embedding and output head grows). MFU counts the model's FLOPs as the published figure does
(``CONVENTION``: causal attention at full cost, ``mfu``, or at half, ``mfu_causal_half``).
Runs whose recipe was also measured under other compiler flags (``what_if``: collective matmul
off) are planned a second time in a process of their own. Compiles take minutes on 2 cores:
run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from transformers_jax.cli import build_configs
from transformers_jax.learning.flops import flops_per_token
from transformers_jax.plan import CHIPS, GPU_SPECS, compile_train, make_target
from transformers_jax.plan.hlo import Module
from transformers_jax.plan.ops import op_roofline
from transformers_jax.study.provenance import code_state, describe

COMMON = ["--model.dtype=bfloat16", "--model.dropout=0.0", "--model.scan_layers=true",
          "--train.strategy=jit"]
LLAMA2_7B = ["--preset", "llama-3.1-8b", "--model.d_model=4096", "--model.n_heads=32",
             "--model.n_kv_heads=32", "--model.head_dim=128", "--model.d_ff=11008",
             "--model.vocab_size=32000"]
# NVIDIA's recommended XLA flags for MaxText on H100 (JAX-Toolbox's MaxText page): the
# latency-hiding scheduler, pipelined and combined collectives, no rematerialization pass
H100_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true "
              "--xla_gpu_all_reduce_combine_threshold_bytes=1073741824 "
              "--xla_gpu_all_gather_combine_threshold_bytes=1073741824 "
              "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728 "
              "--xla_gpu_enable_pipelined_all_gather=true "
              "--xla_gpu_enable_pipelined_reduce_scatter=true "
              "--xla_gpu_enable_pipelined_all_reduce=true "
              "--xla_gpu_enable_while_loop_double_buffering=true "
              "--xla_gpu_enable_all_gather_combine_by_dim=false "
              "--xla_gpu_enable_reduce_scatter_combine_by_dim=false "
              "--xla_disable_hlo_passes=rematerialization")
LLAMA2_70B = ["--preset", "llama-3.1-8b", "--model.d_model=8192", "--model.n_heads=64",
              "--model.n_kv_heads=8", "--model.head_dim=128", "--model.d_ff=28672",
              "--model.vocab_size=32000"]
LLAMA31_70B = [*LLAMA2_70B, "--model.vocab_size=128256"]
# MaxText's synthetic models by global_parameter_scale (base.yml: width 2048, 16 heads of 128,
# MLP 7168, 16 layers, vocabulary 32000; a scale of 2^k doubles heads and MLP, width, layers in
# turn): SwiGLU, RMSNorm, RoPE, no biases, as Llama with full multi-head attention
def maxtext_scale(width: int, heads: int, mlp: int) -> list[str]:
    return ["--preset", "llama-3.1-8b", f"--model.d_model={width}", f"--model.n_heads={heads}",
            f"--model.n_kv_heads={heads}", "--model.head_dim=128", f"--model.d_ff={mlp}",
            "--model.vocab_size=32000"]  # RoPE's scaling (Llama 3.1's here) costs nothing


RECIPES = "https://github.com/AI-Hypercomputer/tpu-recipes/blob/main/training/"
V5E_TABLE = ("https://github.com/AI-Hypercomputer/maxtext/blob/main/MaxText/configs/v5e/"
             "README.md")
TIERING = "https://maxtext.readthedocs.io/en/latest/reference/models/tiering.html"
LEVANTER = ("https://github.com/stanford-crfm/levanter/blob/main/docs/"
            "Levanter-1.0-Release.md")
JAX_TOOLBOX = ("https://github.com/NVIDIA/JAX-Toolbox/blob/main/docs/frameworks/maxtext/"
               "README.md")

# MaxText's DISABLE_COLLECTIVE_MATMUL: XLA keeps the FSDP matmuls whole instead of looping
# over weight shards (which, on a stand-in slice, costs more than on the published one)
COLLECTIVE_MATMUL_OFF = "--xla_jf_spmd_threshold_for_windowed_einsum_mib=1000000"

# name -> the published run and our plan of it; ``what_if``: (variable, flags) under which the
# run is planned a second time, in a process of its own
RUNS: dict[str, dict] = {
    "llama3.1-8b-v6e-8": dict(
        published_mfu=413.433 / 918, published_tokens_per_s=7138.89,
        source=RECIPES + "trillium/Llama3.1-8B-MaxText/v6e-8/README.md",
        published="Llama 3.1 8B, v6e-8, 3 x 8192 per device, FSDP 8, remat custom (layer "
                  "input and q/k/v/out projections offloaded to host), flash attention with "
                  "2048 blocks: 413.4 TFLOP/s per device",
        target="v6e:2x4", per_device=3, seq_len=8192, mesh="data=1,fsdp=8,tensor=1",
        remat="full", argv=["--preset", "llama-3.1-8b"], layers=None,
        # the recipe's DISABLE_COLLECTIVE_MATMUL (its other flags tune what we do not model)
        libtpu_args=COLLECTIVE_MATMUL_OFF,
        differs="remat full (recomputes the forward) where MaxText offloads activations; "
                "Pallas blocks of 128 (MaxText 2048)"),
    "llama3.1-70b-v6e-256": dict(
        published_mfu=456.442 / 918, published_tokens_per_s=948.086,
        source=RECIPES + "trillium/Llama3.1-70B-MaxText/README.md",
        published="Llama 3.1 70B, v6e-256, 5 x 8192 per device, FSDP 256: 456.4 TFLOP/s "
                  "per device",
        target="v6e:2x4", per_device=5, seq_len=8192, mesh="data=1,fsdp=8,tensor=1",
        remat="full", argv=LLAMA31_70B, layers=8,
        what_if=(("LIBTPU_INIT_ARGS", COLLECTIVE_MATMUL_OFF),),
        differs="8 of 80 layers on v6e-8 (FSDP 8, not 256); remat full"),
    "llama2-70b-v5p-512": dict(
        published_mfu=0.654, published_tokens_per_s=692,
        source=TIERING,
        published="Llama 2 70B, v5p-512 (512 chips), SL 4096: 65.4% MFU, 692 tokens/s per "
                  "device (batch per device not on the page: 4 assumed)",
        target="v5p:2x2x1", per_device=4, seq_len=4096, mesh="data=1,fsdp=4,tensor=1",
        remat="full", argv=LLAMA2_70B, layers=8,
        differs="8 of 80 layers on v5p-8 (4 chips, FSDP 4, not 512); batch per device "
                "assumed; remat full"),
    "maxtext-16b-v5e-256": dict(
        published_mfu=0.611, published_tokens_per_s=None, source=V5E_TABLE,
        published="MaxText 16B (global_parameter_scale 16), 1x v5e-256, 6 x 2048 per device "
                  "(configs/v5e/16b.sh), remat full, flash: 120 TFLOP/s per chip, 61.1%",
        target="v5e:2x4", per_device=6, seq_len=2048, mesh="data=1,fsdp=8,tensor=1",
        remat="full", argv=maxtext_scale(4096, 64, 28672), layers=4,
        what_if=(("LIBTPU_INIT_ARGS", COLLECTIVE_MATMUL_OFF),),
        differs="4 of 32 layers on v5e-8 (FSDP 8, not 256)"),
    "maxtext-32b-v5e-256": dict(
        published_mfu=0.6686, published_tokens_per_s=None, source=V5E_TABLE,
        published="MaxText 32B (global_parameter_scale 32), 1x v5e-256, 4 x 2048 per device "
                  "(configs/v5e/32b.sh), remat full, flash: 132 TFLOP/s per chip, 66.9%",
        target="v5e:2x4", per_device=4, seq_len=2048, mesh="data=1,fsdp=8,tensor=1",
        remat="full", argv=maxtext_scale(8192, 64, 28672), layers=4,
        differs="4 of 32 layers on v5e-8 (FSDP 8, not 256)"),
    # Levanter's GPT-2 runs on v3-256 (128 chips, 256 TensorCores), FSDP, per-layer remat,
    # no flash kernel (2023); shapes from its config/gpt2_*.yaml
    **{f"levanter-gpt2-{size}-v3-256": dict(
        published_mfu=mfu, published_tokens_per_s=None, source=LEVANTER,
        published=f"Levanter GPT-2 {size} ({width} wide, {layers} layers, {heads} heads), "
                  f"TPU v3-256, 1024 tokens, FSDP, gradient checkpointing: {100 * mfu:.1f}% MFU",
        target="v3:2x2", per_device=2, seq_len=1024, mesh="data=1,fsdp=8,tensor=1",
        remat="full", attention="xla", layers=None,
        argv=["--preset", "gpt2-xl", f"--model.d_model={width}", f"--model.n_heads={heads}",
              f"--model.n_layers={layers}"],
        differs="v3-8 (4 chips) for v3-256; batch per device assumed 2 (Levanter's default "
                "512 sequences over 256 cores; not in the post)")
      for size, width, layers, heads, mfu in (("345M", 1024, 24, 16, 0.351),
                                               ("750M", 1280, 36, 20, 0.389),
                                               ("1.4B", 1536, 48, 24, 0.417))},
    # step time only: the MFU is our FLOP count of the model over it (published_mfu None)
    "llama2-7b-h100-8": dict(
        published_mfu=None, published_tokens_per_s=22.19 * 4096 / 8, source=JAX_TOOLBOX,
        published="Llama 2 7B, 8 x H100 80G SXM (one DGX), 2 x 4096 per GPU, FSDP 8, bf16, "
                  "cuDNN flash attention (Transformer Engine), remat minimal_flash, no scan: "
                  "0.721 s a step, 22.19 sequences/s",
        target="h100:8", per_device=2, seq_len=4096, mesh="data=1,fsdp=8,tensor=1",
        remat="dots_with_no_batch_dims_saveable", argv=LLAMA2_7B, layers=None,
        attention="cudnn", xla_flags=H100_FLAGS,
        differs="remat saves matmul outputs without batch dimensions (MaxText's minimal "
                "keeps the attention output too); layers scanned"),
}
# MaxText's TFLOP/s count causal attention at full cost before its PR #1988 (July 2025) and at
# half after; which one a figure uses shows in TFLOP/s over tokens/s (the 8B and 70B v6e
# recipes: full; the tiering page's Llama 2 70B: half); the v5e table predates the change
CONVENTION = {"llama3.1-8b-v6e-8": "mfu", "llama3.1-70b-v6e-256": "mfu",
              "llama2-70b-v5p-512": "mfu_causal_half", "maxtext-16b-v5e-256": "mfu",
              "maxtext-32b-v5e-256": "mfu", "llama2-7b-h100-8": "mfu",
              **{f"levanter-gpt2-{size}-v3-256": "mfu" for size in ("345M", "750M", "1.4B")}}


def flags_env(run: dict) -> tuple[str, str | None]:
    """The environment variable a run's compiler flags go in, and the flags (or None)."""
    if run.get("xla_flags"):
        return "XLA_FLAGS", run["xla_flags"]
    return "LIBTPU_INIT_ARGS", run.get("libtpu_args")


def published_mfu(name: str, model_cfg) -> float:
    """The published MFU, or (a step time only) the model's FLOPs over it in our count."""
    run = RUNS[name]
    if run["published_mfu"] is not None:
        return run["published_mfu"]
    per_token = flops_per_token(model_cfg, run["seq_len"],
                                causal_half=CONVENTION[name] == "mfu_causal_half")
    chip = CHIPS[run["target"].partition(":")[0]]  # the datasheet, no topology to build
    return per_token * run["published_tokens_per_s"] / chip.peak_flops


def plan_run(name: str, hlo_dir: str | None, most: int | None = None) -> dict:
    """The published batch per device (or ``most``), else the largest smaller one that fits
    here (our loss keeps the whole vocabulary's logits; MaxText's recipes also offload
    activations)."""
    for per_device in range(min(most or 10**9, RUNS[name]["per_device"]), 0, -1):
        out = _plan_run(name, hlo_dir, per_device)
        if out["fits"]:
            break
    return out


def _plan_run(name: str, hlo_dir: str | None, per_device: int) -> dict:
    run = RUNS[name]
    target = make_target(run["target"])
    argv = [*run["argv"], *COMMON, f"--model.attention={run.get('attention', 'pallas')}",
            f"--train.batch_size={per_device * target.chips}",
            f"--train.seq_len={run['seq_len']}", f"--train.mesh={run['mesh']}",
            f"--model.remat={run['remat']}"]
    argv += [f"--model.n_layers={run['layers']}"] if run["layers"] else []
    model_cfg, cfg = build_configs(argv)
    wall = time.perf_counter()
    env_name, _ = flags_env(run)
    flags = os.environ.get(env_name) or None  # the compiler's flags, if any
    hlo = os.path.join(hlo_dir, _hlo_name(name, flags)) if hlo_dir else None
    got = compile_train(model_cfg, cfg, target, hlo_out=hlo)
    out = {"name": name, **{k: v for k, v in run.items() if k not in ("argv", "what_if")},
           "command": " ".join(["tjax plan --target", run["target"], "--no-decode", *argv]),
           "plan_s": time.perf_counter() - wall, "fits": got["memory"]["fits"],
           "planned_per_device": per_device,
           "libtpu_args": flags if env_name == "LIBTPU_INIT_ARGS" else None,
           "xla_flags": flags if env_name == "XLA_FLAGS" else None,
           "published_mfu": published_mfu(name, model_cfg), "memory": got["memory"]}
    if got["roofline"] is not None:
        out.update(_estimate(name, got["roofline"], out["published_mfu"]),
                   whole_program_mfu=got["roofline"]["whole_program"][CONVENTION[name]])
    return out


def _hlo_name(name: str, flags: str | None) -> str:
    return f"{name}-flags.hlo" if flags else f"{name}.hlo"


def _estimate(name: str, line: dict, published: float) -> dict:
    convention = CONVENTION[name]
    return {"convention": convention, "estimate_mfu": line[convention],
            "step_s": line["step_s"], "split": line["split"], "bound": line["bound"],
            "top_ops": line["top_ops"][:5],
            "error_points": 100 * (line[convention] - published)}


def recost(row: dict, hlo_dir: str) -> dict:
    """A planned row costed again from its kept program (``--hlo-dir``) with the current
    roofline, without compiling: for changes to ``plan/ops.py``."""
    run, name = RUNS[row["name"]], row["name"]
    target = make_target(run["target"])
    model_cfg, cfg = build_configs(row["command"].split()[5:])
    flags = row.get("libtpu_args") or row.get("xla_flags")
    with open(os.path.join(hlo_dir, _hlo_name(name, flags))) as f:
        module = Module.parse(f.read())
    tokens = cfg.batch_size * cfg.seq_len / len(target.devices)
    line = op_roofline(module, target, flops_per_token(model_cfg, cfg.seq_len) * tokens,
                       flops_per_token(model_cfg, cfg.seq_len, causal_half=True) * tokens,
                       causal=model_cfg.mask.causal)
    out = {**row, **_estimate(name, line, published_mfu(name, model_cfg))}
    if "convention" not in row and out["convention"] == "mfu":  # planned before CONVENTION
        out["whole_program_mfu"] = row["whole_program_mfu"] * line["mfu"] / line[
            "mfu_causal_half"]  # its step time, the other FLOP count
    return out


def in_process_with(name: str, env_name: str, flags: str, hlo_dir: str | None) -> dict:
    """Plan one run in a process of its own whose compiler reads the recipe's flags
    (``LIBTPU_INIT_ARGS`` and ``XLA_FLAGS`` are read once, when the backend loads)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        command = [sys.executable, __file__, "--only", name, "--out", out]
        subprocess.run(command + (["--hlo-dir", hlo_dir] if hlo_dir else []), check=True,
                       env={**os.environ, env_name: flags}, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)["runs"][0]


def table(rows: list[dict]) -> str:
    out = ["| published run | ours: target, layers, batch per device (published) | "
           "published MFU (attention counted) | estimate | error (points) | bound | "
           "whole-program estimate "
           "(before) |", "|---|---|---|---|---|---|---|"]
    errors = []
    for r in rows:
        if "estimate_mfu" not in r:
            out.append(f"| [{r['name']}]({r['source']}) | `{r['target']}` | "
                       f"{100 * r['published_mfu']:.1f}% | no plan ||||")
            continue
        errors.append(abs(r["error_points"]))
        layers = f", {r['layers']} layers" if r.get("layers") else ""
        layers += f", {r.get('planned_per_device', r['per_device'])} ({r['per_device']})"
        flags = " (collective matmul off)" if "windowed_einsum" in (r.get("libtpu_args")
                                                                  or "") else ""
        count = "causal at half" if r["convention"] == "mfu_causal_half" else "full"
        if RUNS.get(r["name"], {}).get("published_mfu", 0) is None:
            count += "; our FLOPs over its step time"
        out.append(f"| [{r['name']}]({r['source']}){flags} | `{r['target']}`{layers} | "
                   f"{100 * r['published_mfu']:.1f}% ({count}) | "
                   f"{100 * r['estimate_mfu']:.1f}% | "
                   f"{r['error_points']:+.1f} | {r['bound']} | "
                   f"{100 * r['whole_program_mfu']:.1f}% |")
    if errors:
        out.append(f"\nmedian |error| {statistics.median(errors):.1f} points, worst "
                   f"{max(errors):.1f} points over {len(errors)} runs")
        tpu = [abs(r["error_points"]) for r in rows
               if "estimate_mfu" in r and not r["target"].startswith(tuple(GPU_SPECS))]
        if 0 < len(tpu) < len(errors):
            out.append(f"(TPU runs only: median {statistics.median(tpu):.1f}, worst "
                       f"{max(tpu):.1f} over {len(tpu)}; what the preset table quotes)")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated run names")
    parser.add_argument("--out", default=None, help="write the rows (JSON) there")
    parser.add_argument("--hlo-dir", default=None, help="also keep each compiled program")
    parser.add_argument("--per-device", type=int, metavar="B", help="try at most B sequences "
                        "per device (skip the compiles a known limit refuses)")
    parser.add_argument("--table", metavar="JSON", help="print the table of a run's JSON")
    parser.add_argument("--recost", metavar="JSON", help="cost a run's rows again from the "
                        "programs kept in --hlo-dir (no compile); rewrite --out")
    args = parser.parse_args()
    if args.recost:
        with open(args.recost) as f:
            rows = [recost(r, args.hlo_dir) if "step_s" in r else r for r in json.load(f)["runs"]]
        with open(args.out or args.recost, "w") as f:
            json.dump({"runs": rows}, f, indent=1)
        print(table(rows))
        return 0
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f)["runs"]))
        return 0
    rows = []
    commit = describe(code_state())  # recorded in each row: which code planned it

    def add(row: dict) -> None:
        rows.append({**row, "commit": commit})
        print(json.dumps(rows[-1]), flush=True)

    for name in args.only.split(",") if args.only else RUNS:
        env_name, flags = flags_env(RUNS[name])
        if flags and os.environ.get(env_name) != flags:
            add(in_process_with(name, env_name, flags, args.hlo_dir))
            continue
        try:
            add(plan_run(name, args.hlo_dir, args.per_device))
        except Exception as err:  # noqa: BLE001 - one failed run must not lose the others
            add({"name": name, **{k: v for k, v in RUNS[name].items() if k != "argv"},
                 "error": f"{type(err).__name__}: {err}"[:500]})
        for env_name, flags in RUNS[name].get("what_if", ()):
            if not os.environ.get(env_name):  # (not again in the process planning it)
                add(in_process_with(name, env_name, flags, args.hlo_dir))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"runs": rows}, f, indent=1)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
