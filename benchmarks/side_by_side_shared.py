"""What the side-by-side driver and its workers share, with nothing but the standard library and
numpy: the shapes, the prepared directory's layout, and the facts each worker reports about its
process (threads, load, environment). The JAX worker never imports torch and the torch workers
never import jax, so nothing here may import either."""

from __future__ import annotations

import functools
import json
import os
import platform
import sys
import time

import numpy as np

# The shapes of issue 9: a (a character-level GPT-2 shape), b (the same shape as a BERT masked
# LM: trained, not decoded) and c (GPT-2 small); tiny, tiny_bert: the same code paths in
# seconds, for tests.
SHAPES = {
    "a": dict(kind="gpt", layers=4, heads=4, width=128, context=256, batch=16, vocab=65,
              train_len=256, decode_batches=(1, 8), prompt=16, new_tokens=240),
    "b": dict(kind="bert", layers=4, heads=4, width=128, context=256, batch=16, vocab=65,
              train_len=256, decode_batches=()),
    "c": dict(kind="gpt", layers=12, heads=12, width=768, context=1024, batch=4, vocab=50257,
              train_len=128, decode_batches=(1,), prompt=16, new_tokens=112),
    "tiny": dict(kind="gpt", layers=1, heads=2, width=32, context=32, batch=2, vocab=65,
                 train_len=32, decode_batches=(1, 2), prompt=4, new_tokens=12),
    "tiny_bert": dict(kind="bert", layers=1, heads=2, width=32, context=32, batch=2, vocab=65,
                      train_len=32, decode_batches=()),
}
# The contenders that can run each kind (the plain PyTorch model is a GPT).
# Ours: name -> arguments of side_by_side_jax.py.
JAX_CONTENDERS = {
    "jax_float32": ["run", "--dtype", "float32"],
    "jax_bfloat16": ["run", "--dtype", "bfloat16"],
    # train.concurrent_groups=2: the batch as two independent row groups (the same update)
    "jax_float32_g2": ["run", "--dtype", "float32", "--groups", "2"],
    "jax_bfloat16_g2": ["run", "--dtype", "bfloat16", "--groups", "2"],
}
# TJAX_HOST_MALLOC=reuse: XLA's freed temporary buffer kept for the next step
JAX_CONTENDERS.update({f"{name}_reuse": [*args, "--host-malloc", "reuse"]
                       for name, args in list(JAX_CONTENDERS.items())})
KIND_CONTENDERS = {"gpt": (*JAX_CONTENDERS, "hf", "torch", "torch_compile"),
                   "bert": (*JAX_CONTENDERS, "hf")}

# Inside the prepared directory (written once by ``side_by_side_jax.py prepare``).
HF_DIR = "hf"  # config.json + model.safetensors: the initial weights, GPT-2 layout
DATA_FILE = "data.npz"  # inputs/targets [steps, B, T], learning_rates [steps], prompts_b{B}
PLAN_FILE = "plan.json"  # the shape and the optimizer's hyper-parameters

# Thread and wait settings the driver removes from the workers' environment, so that each
# library runs with its own defaults (unless the driver is asked for a setting explicitly).
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "OMP_PROC_BIND", "OMP_PLACES",
                    "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOMP_SPINCOUNT",
                    "KMP_BLOCKTIME", "TORCH_NUM_THREADS", "XLA_FLAGS")


@functools.cache
def host_memory():
    """``transformers_jax/backends/cpu_malloc.py`` loaded by file path: a torch worker may not
    import the package (its ``__init__`` imports jax), yet reports and, with ``--tjax-malloc``,
    takes the same malloc setting as ours. Loaded once per process."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "transformers_jax", "backends", "cpu_malloc.py")
    spec = importlib.util.spec_from_file_location("tjax_host_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# glibc malloc settings, removed likewise: those of tjax's host_memory and glibc's own
MALLOC_VARIABLES = (*host_memory().VARIABLES, "MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_",
                    "MALLOC_TRIM_THRESHOLD_")


def read_plan(directory: str) -> tuple[dict, dict]:
    """(plan, data arrays) of a prepared directory."""
    with open(os.path.join(directory, PLAN_FILE)) as f:
        plan = json.load(f)
    with np.load(os.path.join(directory, DATA_FILE)) as data:
        arrays = {k: data[k] for k in data.files}
    return plan, arrays


def process_facts() -> dict:
    """What a worker records about its own process: the CPUs it may use, the load, and the
    thread-related environment it was started with (empty: every library's default)."""
    return {
        "pid": os.getpid(),
        "cpu_count": os.cpu_count(),
        "cpus_allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average": list(os.getloadavg()),
        "thread_environment": {k: os.environ[k] for k in THREAD_VARIABLES if k in os.environ},
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


# the instruction sets that decide the matmul engines' speed on x86 (AVX-512 float32; bf16 dot
# products natively only with AVX512_BF16 or AMX, else emulated)
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def machine_facts() -> dict:
    """The CPU the figures belong to: its model name and which of ``CPU_FLAGS`` it has
    (Linux ``/proc/cpuinfo``; what ``platform`` knows elsewhere). Ratios move with it."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    return {"cpu_model": model, "cpu_flags": {flag: flag in flags for flag in CPU_FLAGS}}


def describe_machine(facts: dict) -> str:
    """One line for a table's caption: the model and the flags it has and lacks."""
    flags = facts.get("cpu_flags", {})
    has = [f for f, on in flags.items() if on]
    lacks = [f for f, on in flags.items() if not on]
    return (f"{facts.get('cpu_model', 'unknown CPU')}" + (f", {', '.join(has)}" if has else "")
            + (f" (no {', '.join(lacks)})" if lacks else ""))


def forbidden_imports(library: str) -> bool:
    """Whether ``library`` (jax or torch) was imported into this process."""
    return library in sys.modules


def emit(result: dict, path: str | None) -> None:
    text = json.dumps(result, indent=1, default=float)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    print(text)


def median(values: list[float]) -> float:
    return float(np.median(values))


def time_decoding(run, to_list, tokens_per_call: int, repeats: int, timed: bool) -> dict:
    """One decoding entry: the tokens of a first (warm-up) call, and with ``timed`` its time,
    ``repeats`` timed calls and tokens/s from their median."""
    start = time.perf_counter()
    entry = {"tokens": to_list(run())}  # the first call builds state and compiles
    if timed:
        entry["first_call_s"] = time.perf_counter() - start
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - start)
        entry.update(tokens_per_s=tokens_per_call / median(seconds), run_s=seconds)
    return entry


def add_run_options(parser) -> None:
    """The options every worker takes for one run (argparse)."""
    parser.add_argument("--warmup", type=int, default=3, help="untimed training steps first")
    parser.add_argument("--decode-repeats", type=int, default=3)
    parser.add_argument("--no-train", action="store_true")
    parser.add_argument("--no-decode", action="store_true")
    parser.add_argument("--check", action="store_true", help="losses and tokens only, no timing")
    parser.add_argument("--out")
