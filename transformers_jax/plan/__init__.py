"""``tjax plan``: compile the real training and decoding steps of a config for an accelerator
this host does not have, and say what fits and how fast it should run.

    tjax plan --target v5e:2x4 --mesh data=2,fsdp=4 --model.n_layers=12 ...   # one plan
    tjax plan --target v5p:4x4x4 --search ...            # the fastest mesh and remat that fit
    tjax plan --target v5e:2x2 --slices 2 ...            # two slices (multi-slice)

With ``libtpu`` installed (``pip install -e ".[tpu]"``), ``jax.experimental.topologies`` gives
the devices of a TPU topology; the step is lowered for a mesh of them exactly as ``tjax
train`` would run it (``parallel.make_trainer``), compiled by the TPU compiler, and the
compiled program is read: XLA's memory analysis (per device), its cost analysis (FLOPs and
bytes per device per step) and the collectives it contains. The step time is a roofline per
operation (``plan.ops``): each top-level instruction or fusion costs the largest of its matmul
FLOPs at the MXU peak, its other arithmetic at the vector peak and its HBM bytes at HBM
bandwidth; collectives their ring bytes over the links they cross, an asynchronous one hidden
behind the compute between its start and done; the step is the sum in program order, split into
matmul, other compute, memory-bound and exposed collective time, with the operations that cost
most. The whole-program roofline of before stays under ``roofline.whole_program``. These are
compiler figures and estimates, not measurements; their error against published runs is in
docs/performance.md.

Loops: XLA's cost analysis counts a loop body once (``--model.scan_layers``, gradient
accumulation). ``plan.hlo`` reads the call graph of the compiled module and counts each loop's
collectives, matmul FLOPs and operations as often as it runs (trip counts from XLA or the loop
condition; the JSON lists the loops, and any whose count it could not read); HBM bytes come
from a per-instruction byte model, an estimate (within 12% of the unrolled program's XLA count
for GPT-2 small on TPU; ``xla_*`` keep XLA's loop-once figures). Pallas kernels are custom
calls XLA does not cost: ``plan.ops`` costs the flash-attention kernels from their shapes.

Context parallelism (``--mesh data=2,context=4``): the plan also compiles the other ways of
attending across sequence shards the kernel allows (all-gather of keys/values, ring) and says
under ``context`` which is cheaper; ``--search`` tries meshes with a context axis when the
sequence splits into shards of at least ``MIN_CONTEXT_SHARD`` tokens, each way in turn.

GPUs (``--target h100:8``, ``h200:2x8``: GPUs per host, hosts): with the CUDA plugin installed
(``pip install -e ".[gpu-plan]"``: ``jax-cuda12-plugin`` without the CUDA libraries, ~180 MB),
JAX's compile-only GPU topology takes a target description (``GpuTargetConfigProto``), written
here from the datasheet (``GPU_SPECS``), and XLA compiles for it with no GPU present. XLA
gives memory figures for such a compile but no cost analysis; the per-operation roofline reads
the program text, so it costs GPU programs too (not checked against a measured GPU run); the
interconnect is NVLink.
"""

from transformers_jax.plan.command import lora_memory, main, plan, plan_parser
from transformers_jax.plan.compiled import collectives, cost, memory, roofline
from transformers_jax.plan.hlo import Module, hbm_bytes, matmul_flops
from transformers_jax.plan.ops import op_roofline
from transformers_jax.plan.steps import (
    DEFAULT_REMATS,
    candidate_meshes,
    compare_context_methods,
    compile_decode,
    compile_train,
    example_batch,
    search,
)
from transformers_jax.plan.targets import (
    CHIPS,
    GPU_SPECS,
    Chip,
    Target,
    gpu_target,
    gpu_target_config,
    make_target,
    tpu_target,
)

__all__ = [
    "CHIPS", "DEFAULT_REMATS", "GPU_SPECS", "Chip", "Module", "Target", "candidate_meshes",
    "compare_context_methods", "collectives", "compile_decode", "compile_train", "cost",
    "example_batch", "gpu_target", "gpu_target_config", "hbm_bytes", "lora_memory", "main",
    "make_target", "matmul_flops", "memory", "op_roofline", "plan", "roofline", "search",
    "plan_parser", "tpu_target",
]
