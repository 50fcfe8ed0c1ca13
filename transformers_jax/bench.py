"""``tjax bench``: one JSON object of training and decoding speed for a model config.

Training: tokens/s (median over timed steps after warm-up), model FLOPs per token, MFU against
the peak of a large matmul measured in each dtype the model computes in (and against the
datasheet bf16 peak on known GPUs/TPUs), compile time of the first step (wall and CPU seconds),
and memory (XLA's compiled buffer sizes, the process's peak RSS, the accelerator's peak bytes
where it reports them). Decoding (causal families): tokens/s with the KV cache at batch 1 and 8
(one compiled loop), and time to first token (prefill). Also the versions, the device and the
load average. Speed is never asserted in tests: it is measured here and recorded with its
command in BENCHMARKS.md.

    tjax bench                                   # the default: 4x4x128, context 256, batch 16
    tjax bench --model.dtype=bfloat16 --steps 20
    tjax bench --family bert                     # masked LM (no decoding)
    tjax bench --model.n_layers=12 --model.n_heads=12 --model.d_model=768 \\
               --model.vocab_size=50257 --model.max_len=1024 --train.batch_size=4
    tjax bench --compile-cache /tmp/jax_cache    # persistent compilation cache (2nd run: hit)
    tjax bench --tiny                            # seconds: a toy model, for smoke tests
    tjax bench --packed                          # rows of several documents, as tjax train's
    tjax bench --preset gpt2 --train.batch_size=4  # a named model (tjax presets)
    tjax bench --profile 4:2                      # trace steps 4 and 5 (jax.profiler)

Options besides ``--model.*``/``--train.*`` (``--steps`` = ``--train.steps``): ``--warmup N``
(untimed steps, 3), ``--decode-batches 1,8``, ``--decode-prompt 16``, ``--decode-tokens 240``,
``--no-decode``, ``--packed`` (documents packed into each row: segment ids and restarting
positions), ``--compile-cache DIR``, ``--tiny``, ``--out FILE`` (also write the JSON),
``--preset NAME`` (a named model instead of the default; ``--model.*`` applies on top),
``--profile START:STEPS`` (= ``--train.profile``: a ``jax.profiler`` trace of those steps,
counted from 0 over every step run, the untimed first and warm-up ones included, into
``--run-dir``/profile or a temporary folder, printed on stderr).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import resource
import statistics
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformers_jax import __version__
from transformers_jax.backends import cpu_malloc
from transformers_jax.compile_cache import use_compile_cache
from transformers_jax.config import (
    ConfigError,
    ModelConfig,
    TrainConfig,
    apply_overrides,
    from_dict,
)
from transformers_jax.learning.flops import KNOWN_PEAKS, flops_per_token, measure_matmul_peak
from transformers_jax.learning.optim import learning_rate_schedule, make_optimizer
from transformers_jax.learning.step import init_state, make_train_step
from transformers_jax.models import build_model, family_of
from transformers_jax.nn.layers import count_params
from transformers_jax.overrides import (
    CommandParser,
    Once,
    int_list,
    print_json,
    read_config_file,
)
from transformers_jax.registry import FAMILIES
from transformers_jax.train.profile import StepProfiler

# The default benchmark model: a character-level GPT-2 shape. Attention is the chunked kernel
# with 64-wide tiles, the fastest of the kernels for training on a CPU.
DEFAULT_MODEL = ModelConfig(vocab_size=65, d_model=128, n_layers=4, n_heads=4, max_len=256,
                            position="learned", dropout=0.0,
                            attention={"name": "chunked", "chunk_size": 64})
DEFAULT_TRAIN = TrainConfig(batch_size=16, seq_len=256, steps=30, warmup_steps=0)
# --tiny: the same code paths in seconds.
TINY_MODEL = {"d_model": "32", "n_layers": "1", "n_heads": "2", "max_len": "64"}
TINY_TRAIN = {"batch_size": "2", "seq_len": "32", "steps": "3"}


def _timed(fn, *args):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start


def datasheet_peak() -> tuple[float | None, str | None]:
    """The bf16 datasheet peak of a known accelerator (None on CPU and unknown devices)."""
    kind = jax.devices()[0].device_kind
    for name, peak in KNOWN_PEAKS.items():
        if name.lower() in kind.lower():
            return peak, kind
    return None, None


def compute_dtypes(model_cfg: ModelConfig) -> list[str]:
    """The dtypes the model's matmuls run in: its compute dtype, and float32 for what stays
    float32 whatever the compute dtype (the logits' softmax, attention's softmax)."""
    dtypes = [model_cfg.dtype]
    if model_cfg.dtype != "float32":
        dtypes.append("float32")
    return dtypes


def slower_dtype_note(compute_dtype: str, peaks: dict[str, float]) -> str | None:
    """A warning when the model's compute dtype multiplies slower than float32 here (a CPU
    without bf16 dot-product instructions emulates them: then float32 trains faster)."""
    low, f32 = peaks.get(compute_dtype), peaks.get("float32")
    if compute_dtype == "float32" or low is None or f32 is None or low >= f32:
        return None
    return (f"{compute_dtype} matmuls ran slower than float32 on this machine ({low / 1e9:,.0f} "
            f"against {f32 / 1e9:,.0f} GFLOP/s): its CPU lacks native {compute_dtype} dot "
            f"products (x86: AVX512_BF16 or AMX), so XLA emulates them; train in float32 here")


def packed_documents(batch_size: int, seq_len: int, rng) -> dict:
    """``segment_ids`` (from 1) and ``positions`` (restarting at 0) ``[B, T]`` of rows filled
    end to end with documents of ``T/8`` to ``3T/4`` tokens, as ``tjax train`` packs them."""
    segments = np.zeros((batch_size, seq_len), np.int32)
    positions = np.zeros((batch_size, seq_len), np.int32)
    low, high = max(seq_len // 8, 1), max(3 * seq_len // 4, 1)
    for row in range(batch_size):
        start, segment = 0, 1
        while start < seq_len:
            n = min(int(rng.integers(low, high + 1)), seq_len - start)
            segments[row, start : start + n] = segment
            positions[row, start : start + n] = np.arange(n)
            start, segment = start + n, segment + 1
    return {"segment_ids": segments, "positions": positions}


def training_batch(model_cfg: ModelConfig, cfg: TrainConfig, seed: int = 0,
                   packed: bool = False) -> dict:
    """A random batch for the family's objective: next-token LM, or masked LM for bert;
    ``packed``: each row holds several documents (``packed_documents``)."""
    rng = np.random.default_rng(seed)
    shape = (cfg.batch_size, cfg.seq_len)
    inputs = rng.integers(0, model_cfg.vocab_size, shape, dtype=np.int32)
    extra = packed_documents(*shape, rng) if packed else {}
    if family_of(model_cfg).masked_lm:
        return {"inputs": inputs, "targets": inputs.copy(),
                "weights": (rng.random(shape) < 0.15).astype(np.float32), **extra}
    return {"inputs": inputs, "targets": np.roll(inputs, -1, axis=1), **extra}


def training_setup(model_cfg: ModelConfig, cfg: TrainConfig, packed: bool = False,
                   batch: dict | None = None):
    """``(jitted train step donating its state, initial state, a random batch)``: what
    ``bench_training`` times (and ``benchmarks/profile_step.py`` traces). ``batch``: a
    batch of the caller's instead (a task's rows, for a family that trains on them)."""
    from transformers_jax.learning.objectives import objective_for

    if cfg.grad_accum != 1:  # make_train_step has no accumulation: refuse, not ignore
        raise ConfigError(f"train.grad_accum={cfg.grad_accum}: tjax bench times one step over "
                          "the whole batch; drop --train.grad_accum (--train.concurrent_groups "
                          "splits the batch without scanning over it)")
    if batch is None and family_of(model_cfg).needs_task:
        raise ConfigError(f"tjax bench times families that train on text (next-token or "
                          f"masked LM), not {model_cfg.family!r}, which trains on task pairs")
    model = build_model(model_cfg)
    objective = objective_for(model_cfg.family)
    optimizer = make_optimizer(cfg)
    batch = training_batch(model_cfg, cfg, packed=packed) if batch is None else batch
    state = init_state(model, optimizer, 0, batch, objective)
    step_fn = jax.jit(make_train_step(model, optimizer, learning_rate_schedule(cfg), objective,
                                      groups=cfg.concurrent_groups),
                      donate_argnums=0)
    return step_fn, state, batch


def _say(step: int, text: str, values: dict) -> None:
    print(f"tjax bench: {text}", file=sys.stderr)


def bench_training(model_cfg: ModelConfig, cfg: TrainConfig, steps: int, warmup: int = 3,
                   packed: bool = False):
    """Time the training step. With ``cfg.profile`` (``START:STEPS``) the steps START.. of
    every step run here (0: the first, untimed; then ``warmup``, then the timed ones) are
    traced (``train/profile.py``) into ``cfg.run_dir``/profile or a temporary folder; the
    timed steps inside the window carry the tracer's overhead."""
    step_fn, state, batch = training_setup(model_cfg, cfg, packed)
    wall, cpu = time.perf_counter(), time.process_time()
    compiled = step_fn.lower(state, batch).compile()
    compile_s, compile_cpu_s = time.perf_counter() - wall, time.process_time() - cpu
    memory = compiled.memory_analysis()
    profiler = StepProfiler(cfg.profile, cfg.run_dir, _say)
    count = iter(range(1 + warmup + steps))

    def run(state):  # one step, in the profile window's numbering
        step = next(count)
        with profiler.step(step):
            out = _timed(compiled, state, batch)
        profiler.after(step, out[0])
        return out

    try:
        state, first_s = run(state)
        state = state[0]
        for _ in range(warmup):
            state, _ = run(state)[0]
        times, faults = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(steps):
            (state, _), seconds = run(state)
            times.append(seconds)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    finally:
        profiler.close()
    median = statistics.median(times)
    tokens = cfg.batch_size * cfg.seq_len
    flops = flops_per_token(model_cfg, cfg.seq_len)
    flops_causal = flops_per_token(model_cfg, cfg.seq_len, causal_half=True)
    achieved = flops * tokens / median
    achieved_causal = flops_causal * tokens / median
    peaks = {dtype: measure_matmul_peak(dtype) for dtype in compute_dtypes(model_cfg)}
    out = {
        "params": count_params(state.params),
        "tokens_per_s": tokens / median,
        "step_ms_median": 1e3 * median,
        "step_ms_min": 1e3 * min(times),
        "timed_steps": steps,
        # pages the kernel handed out per step: about the temp buffer each step unless malloc
        # uses huge pages (backends/cpu_malloc.py)
        "minor_page_faults_per_step": faults / steps,
        "warmup_steps": warmup + 1,
        "flops_per_token": flops,
        "achieved_flops_per_s": achieved,
        "peak_flops": peaks,
        "peak_source": "measured 2048^3 matmul per dtype, float32 accumulation",
        "mfu": {dtype: achieved / peak for dtype, peak in peaks.items()},
        # causal attention counted at half its full-context FLOPs (MaxText's convention)
        "flops_per_token_causal_half": flops_causal,
        "mfu_causal_half": {dtype: achieved_causal / peak for dtype, peak in peaks.items()},
        "compile_s": compile_s,
        "compile_cpu_s": compile_cpu_s,
        "first_step_s": first_s,
        "compiled_temp_bytes": getattr(memory, "temp_size_in_bytes", None),
        "compiled_argument_bytes": getattr(memory, "argument_size_in_bytes", None),
        "compiled_output_bytes": getattr(memory, "output_size_in_bytes", None),
    }
    note = slower_dtype_note(model_cfg.dtype, peaks)
    if note:
        out["dtype_note"] = note
    sheet, kind = datasheet_peak()
    if sheet is not None:
        out["datasheet_bf16_peak"] = sheet
        out["mfu_vs_datasheet_bf16"] = achieved / sheet
        out["mfu_causal_half_vs_datasheet_bf16"] = achieved_causal / sheet
    return out


def bench_decoding(model_cfg: ModelConfig, prompt_len: int = 16, new_tokens: int = 240,
                   batches=(1, 8), repeats: int = 3) -> dict:
    from transformers_jax.sample import SamplingConfig, generate_tokens, prefill

    model = build_model(model_cfg)
    params = nn.meta.unbox(
        model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    )
    greedy = SamplingConfig(max_new_tokens=new_tokens, temperature=0.0)
    out = {}
    for batch in batches:
        prompts = jnp.ones((batch, prompt_len), jnp.int32)
        lengths = jnp.full((batch,), prompt_len, jnp.int32)
        first = jax.jit(lambda p, t, n: prefill(model, p, t, n, new_tokens))

        def generate(p=prompts, n=lengths):
            return generate_tokens(model, params, p, n, jax.random.key(0), cfg=greedy)

        _timed(first, params, prompts, lengths)  # compile
        ttft = statistics.median(_timed(first, params, prompts, lengths)[1] for _ in range(5))
        _, compile_s = _timed(generate)  # compile (and one run)
        runs = [_timed(generate)[1] for _ in range(repeats)]
        run_s = statistics.median(runs)
        out[f"batch_{batch}"] = {
            "decode_tokens_per_s": batch * new_tokens / run_s,
            "ms_per_step": 1e3 * run_s / new_tokens,
            "time_to_first_token_ms": 1e3 * ttft,
            "first_call_s": compile_s,
            "repeats": repeats,
        }
    out["prompt_len"], out["new_tokens"] = prompt_len, new_tokens
    out["note"] = ("greedy, one compiled loop (prefill included); tokens/s = batch x "
                   "new_tokens / median time; time to first token = the prefill alone")
    return out


def device_memory() -> dict | None:
    """Peak bytes on the accelerator, where the backend reports them (GPU, TPU)."""
    stats = jax.devices()[0].memory_stats() if hasattr(jax.devices()[0], "memory_stats") else None
    if not stats:
        return None
    return {k: stats[k] for k in ("peak_bytes_in_use", "bytes_limit") if k in stats}


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def emit_json(result: dict, path: str | None) -> None:
    """Print ``result`` as indented JSON and, given a path, write the same text there."""
    print_json(result, path, indent=1)


def environment() -> dict:
    import flax
    import jaxlib
    import optax

    cpu = cpu_model()
    return {
        "device": jax.devices()[0].device_kind,
        "device_count": jax.device_count(),
        "platform": jax.default_backend(),
        "cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "host_malloc": cpu_malloc.status(),  # tjax re-executes itself with it
        "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
            "optax": optax.__version__, "numpy": np.__version__,
            "transformers_jax": __version__, "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def bench_parser() -> CommandParser:
    """``tjax bench``'s own options; every other argument is a config override."""
    parser = CommandParser(
        "tjax bench", "Times the training step (tokens/s, MFU against the measured matmul peak) "
        "and KV-cache decoding of one config and prints one JSON object. Default model: a "
        "character-level GPT-2 shape, chunked attention with 64-wide tiles; every "
        "--model./--train. option of `tjax train --help` applies.", overrides=True)
    parser.add_argument("--preset", metavar="NAME", action=Once,
                        help="start from a named model ('tjax presets' lists them); "
                        "--model.* applies on top")
    parser.add_argument("--tiny", action="store_true",
                        help="the same code paths at a tiny size, in seconds (with --preset: "
                        "the preset's model, a tiny batch and step count)")
    parser.add_argument("--no-decode", action="store_true", help="skip the decoding benchmark")
    parser.add_argument("--packed", action="store_true",
                        help="train on rows packed with several documents (segment ids, "
                        "positions restarting per document), as tjax train's batches; "
                        "default: one sequence per row")
    parser.add_argument("--warmup", type=int, default=3, metavar="N",
                        help="untimed steps before timing")
    parser.add_argument("--decode-batches", type=int_list, default="1,8", metavar="B,B",
                        help="comma-separated decoding batch sizes")
    parser.add_argument("--decode-prompt", type=int, default=None, metavar="N",
                        help="prompt tokens (default 16; 4 with --tiny)")
    parser.add_argument("--decode-tokens", type=int, default=None, metavar="N",
                        help="new tokens (default 240; 12 with --tiny)")
    parser.add_argument("--compile-cache", metavar="DIR",
                        help="JAX's persistent compilation cache")
    parser.add_argument("--out", metavar="FILE", help="also write the JSON there")
    return parser


def bench_configs(argv: list[str]) -> tuple[ModelConfig, TrainConfig, Any, str | None]:
    """``(model config, train config, this command's options, preset name)`` from ``argv``:
    the default model (or ``--preset NAME``), then ``--tiny``, then the ``--model.*``/``--train.*``
    overrides."""
    args, overrides, config_file = bench_parser().parse(argv)
    preset = args.preset
    given = read_config_file(config_file) if config_file else {"model": {}, "train": {}}
    if preset is not None and given["model"]:
        raise ConfigError(f"--preset {preset} and a model section in {config_file}: "
                          "give the model one way (drop one of them)")
    model_over = {k[6:]: v for k, v in overrides.items() if k.startswith("model.")}
    train_over = {k[6:]: v for k, v in overrides.items() if k.startswith("train.")}
    if args.tiny:  # with a preset: its model as it is, a tiny run
        model_over = model_over if preset is not None else {**TINY_MODEL, **model_over}
        train_over = {**TINY_TRAIN, **train_over}
    if "family" in model_over and "mask" not in model_over:  # e.g. bert: bidirectional
        model_over["mask"] = FAMILIES.get(model_over["family"]).default_mask
    base = DEFAULT_MODEL if preset is None else ModelConfig.preset(preset)
    base = from_dict(ModelConfig, {**base.to_dict(), **given["model"]}) if given["model"] else base
    train_base = (from_dict(TrainConfig, {**dataclasses.asdict(DEFAULT_TRAIN), **given["train"]})
                  if given["train"] else DEFAULT_TRAIN)
    model_cfg = apply_overrides(base, model_over, "model.")
    cfg = apply_overrides(train_base, train_over, "train.")
    return model_cfg, cfg, args, preset


def main(argv: list[str]) -> int:
    model_cfg, cfg, args, preset = bench_configs(argv)
    if args.compile_cache:  # else none of tjax's: bench times cold compiles
        use_compile_cache(args.compile_cache, every_compile=True)
    env = environment()
    result = {
        "preset": preset,
        "model": model_cfg.to_dict(),
        "batch_size": cfg.batch_size,
        "seq_len": cfg.seq_len,
        "concurrent_groups": cfg.concurrent_groups,
        # the persistent cache in use (also one set through JAX's own JAX_COMPILATION_CACHE_DIR:
        # then compile_s may be a cache hit)
        "compile_cache": jax.config.jax_compilation_cache_dir,
        # packed: rows of several documents (segment ids, restarting positions), as tjax
        # train's batches; else one random sequence per row, as the side-by-side's
        "packed": args.packed,
        "training": bench_training(model_cfg, cfg, steps=cfg.steps,
                                   warmup=args.warmup, packed=args.packed),
    }
    if "dtype_note" in result["training"]:
        print(f"tjax bench: warning: {result['training']['dtype_note']}", file=sys.stderr)
    # the same rule as sample.generate: a family that continues its own tokens, a mask that
    # decodes (a prefix-LM takes the prompt as its prefix)
    decodes = family_of(model_cfg).generates == "self" and model_cfg.mask.decodes
    if args.no_decode or not decodes:
        result["decoding"] = None
        result["decoding_note"] = ("skipped: --no-decode" if args.no_decode else
                                   f"family {model_cfg.family!r} with mask "
                                   f"{model_cfg.mask.name!r} does not decode left to right")
    else:
        tiny = args.tiny
        prompt = args.decode_prompt or (4 if tiny else 16)
        new = args.decode_tokens or (12 if tiny else 240)
        limit = model_cfg.position.max_length(model_cfg)
        if limit is not None and prompt + new > limit:
            new = limit - prompt
        batches = tuple(args.decode_batches)
        result["decoding"] = bench_decoding(model_cfg, prompt, new, batches)
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result["device_memory"] = device_memory()
    result.update(env)
    result["load_average_end"] = list(os.getloadavg())
    emit_json(result, args.out)
    return 0
