"""What ``tjax plan`` compiles for: the devices of a TPU topology (libtpu) or of compile-only
GPUs (the CUDA plugin), and each chip's datasheet figures."""

from __future__ import annotations

import dataclasses
import math
import os
import re

from transformers_jax.config import ConfigError

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """Datasheet figures of one chip (bf16 peak, HBM, bidirectional ICI per chip)."""

    name: str
    peak_flops: float
    hbm_bytes: float
    hbm_bytes_per_s: float
    ici_bytes_per_s: float
    source: str
    # figures for the per-operation roofline (plan/ops.py); not all on the datasheets above
    ici_links: int = 4  # links the ICI figure is spread over; a ring over one axis gets
    # ici_bytes_per_s / ici_links (half each way over its two links), k axes k times that
    vector_flops: float = 0.0  # elementwise FLOP/s; 0: peak_flops / 32 (see vector_peak)
    int8_factor: float = 2.0  # 8-bit matmuls against bf16 (v5e, v5p, v6e datasheets: 2x)
    dcn_bytes_per_s: float = 6.25e9  # per chip across slices: 200 Gb/s a host of 4 (assumed)

    @property
    def vector_peak(self) -> float:
        """Elementwise FLOP/s. TPU: not published; the vector unit's 8 x 128 lanes against
        the MXUs' 128 x 128 multiply-adds give about 1/32 of the bf16 peak (an assumption)."""
        return self.vector_flops or self.peak_flops / 32


# Google Cloud TPU documentation, system architecture pages (retrieved 2026-11).
CHIPS: dict[str, Chip] = {
    "v3": Chip("TPU v3", 123e12, 32 * GIB, 900e9, 328e9,
               "https://cloud.google.com/tpu/docs/v3 (123 TFLOP/s bf16, 32 GiB HBM at 900 GB/s, "
               "two TensorCores a chip); ICI: 4 links x 656 Gb/s from Norrie et al., IEEE Micro "
               "2021, not on that page: unverified"),
    "v4": Chip("TPU v4", 275e12, 32 * GIB, 1200e9, 300e9,
               "https://cloud.google.com/tpu/docs/v4 (275 TFLOP/s bf16, 32 GiB HBM2 at "
               "1200 GB/s); ICI: 6 links x 50 GB/s from the TPU v4 paper (Jouppi et al., "
               "ISCA 2023), not on that page: unverified", ici_links=6),
    "v5e": Chip("TPU v5e", 197e12, 16 * GIB, 819e9, 400e9,
                "https://cloud.google.com/tpu/docs/v5e (197 TFLOP/s bf16, 16 GiB HBM at "
                "819 GB/s, 400 GB/s bidirectional ICI per chip)"),
    "v5p": Chip("TPU v5p", 459e12, 95 * GIB, 2765e9, 1200e9,
                "https://cloud.google.com/tpu/docs/v5p (459 TFLOP/s bf16, 95 GiB HBM at "
                "2765 GB/s, 1200 GB/s bidirectional ICI per chip)", ici_links=6),
    "v6e": Chip("TPU v6e", 918e12, 32 * GIB, 1638e9, 800e9,
                "https://cloud.google.com/tpu/docs/v6e (918 TFLOP/s bf16, 32 GB HBM at "
                "1638 GB/s, 800 GB/s bidirectional ICI per chip)"),
}

# NVIDIA datasheets; bf16 dense is half the with-sparsity figure printed there.
CHIPS["h100"] = Chip("NVIDIA H100 SXM", 989e12, 80e9, 3.35e12, 900e9,
                     "https://www.nvidia.com/en-us/data-center/h100/ (bf16 1979 TFLOP/s with "
                     "sparsity, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s; fp32 67 TFLOP/s)",
                     ici_links=2, vector_flops=67e12, dcn_bytes_per_s=50e9)
CHIPS["h200"] = Chip("NVIDIA H200 SXM", 989e12, 141e9, 4.8e12, 900e9,
                     "https://www.nvidia.com/en-us/data-center/h200/ (bf16 1979 TFLOP/s with "
                     "sparsity, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; fp32 67 TFLOP/s)",
                     ici_links=2, vector_flops=67e12, dcn_bytes_per_s=50e9)
# What XLA's GPU compiler reads of a device (Hopper, compute capability 9.0: 132 SMs); the
# memory size and bandwidth come from CHIPS.
GPU_SPECS = {"h100": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200"}
_HOPPER = {"threads_per_block_limit": 1024, "threads_per_warp": 32,
           "shared_memory_per_block": 49152, "shared_memory_per_core": 233472,
           "shared_memory_per_block_optin": 232448, "threads_per_core_limit": 2048,
           "core_count": 132, "fpus_per_core": 128, "block_dim_limit_x": 2**31 - 1,
           "block_dim_limit_y": 65535, "block_dim_limit_z": 65535, "l2_cache_size": 50 * 2**20,
           "clock_rate_ghz": 1.98, "registers_per_core_limit": 65536,
           "registers_per_block_limit": 65536}



@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # e.g. v5e:2x4
    chip: Chip
    devices: tuple  # jax devices of the topology (all slices)
    chips: int
    slices: int
    hosts: int

    @property
    def devices_per_chip(self) -> int:  # v4 shows each of a chip's two TensorCores
        return max(1, len(self.devices) // self.chips)


def gpu_target_config(generation: str) -> str:
    """A ``GpuTargetConfigProto`` (text format) for a GPU of ``CHIPS``/``GPU_SPECS``."""
    chip = CHIPS[generation]
    fields = {**_HOPPER, "memory_bandwidth": int(chip.hbm_bytes_per_s),
              "device_memory_size": int(chip.hbm_bytes)}
    body = "\n".join(f"  {k}: {v}" for k, v in fields.items())
    return (f"gpu_device_info {{\n{body}\n  cuda_compute_capability {{ major: 9 }}\n}}\n"
            f'platform_name: "CUDA"\ndnn_version_info {{ major: 9 }}\n'
            f'device_description_str: "{GPU_SPECS[generation]}"\n')


def gpu_target(name: str) -> Target:
    """``h100:8`` (8 GPUs on one host) or ``h200:2x8`` (2 hosts of 8): compile-only devices
    from the CUDA plugin (the ``gpu-plan`` extra); the error says what is missing."""
    generation, _, shape = name.partition(":")
    if not re.fullmatch(r"\d+(x\d+)?", shape):
        raise ConfigError(f"--target {name!r}: expected {generation}:GPUS or "
                          f"{generation}:HOSTSxGPUS, e.g. {generation}:8")
    hosts, _, per_host = shape.rpartition("x")
    hosts, per_host = int(hosts or 1), int(per_host)
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no CUDA libraries needed
    try:
        from jax.experimental import topologies

        topology = topologies.get_topology_desc(
            topology_name=name, platform="cuda", target_config=gpu_target_config(generation),
            topology=f"1x{hosts}x{per_host}")
    except Exception as err:
        raise ConfigError(
            f"--target {name!r}: cannot describe these GPUs ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200]}); install the CUDA plugin with pip install -e "
            "'.[gpu-plan]'") from None
    devices = tuple(topology.devices)
    return Target(name, CHIPS[generation], devices, len(devices), 1, hosts)


def make_target(name: str, slices: int = 1) -> Target:
    """A TPU topology (``v5e:2x4``) or a set of GPUs (``h100:8``)."""
    if name.partition(":")[0] in GPU_SPECS:
        if slices != 1:
            raise ConfigError("--slices is for TPU targets; give GPUs as HOSTSxGPUS")
        return gpu_target(name)
    return tpu_target(name, slices)


def tpu_target(name: str, slices: int = 1) -> Target:
    """The devices of TPU topology ``name`` (``v5e:2x4``, ``v5p:4x4x4``), ``slices`` times.
    Needs ``libtpu`` (the ``tpu`` extra); the error says so."""
    generation, _, shape = name.partition(":")
    tpu = generation in CHIPS and generation not in GPU_SPECS
    if not tpu or not re.fullmatch(r"\d+(x\d+){1,2}", shape):
        raise ConfigError(f"--target {name!r}: expected GENERATION:SHAPE with GENERATION one of "
                          f"{', '.join(c for c in CHIPS if c not in GPU_SPECS)} and SHAPE like "
                          "2x4 or 2x2x1 (chips per axis), or h100:8 / h200:2x8 (GPUs)")
    if slices < 1:
        raise ConfigError(f"--slices {slices}: must be a positive integer")
    # libtpu takes a host-wide lock file unless told that several processes may load it;
    # compiling for a topology touches no TPU, so concurrent plans (and tests) are safe
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        from jax.experimental import topologies

        topology = topologies.get_topology_desc(topology_name=name, platform="tpu",
                                                num_slices=slices)
    except Exception as err:  # no libtpu, or a shape it does not know
        raise ConfigError(
            f"--target {name!r}: cannot describe this TPU topology ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200]}); install libtpu with pip install -e "
            "'.[tpu]' and use a shape Cloud TPU offers (e.g. v5e:2x2, v5e:2x4, v5p:2x2x1)"
        ) from None
    devices = tuple(topology.devices)
    chips = math.prod(int(d) for d in shape.split("x")) * slices
    hosts = len({(getattr(d, "slice_index", 0), d.process_index) for d in devices})
    return Target(name, CHIPS[generation], devices, chips, slices, hosts)
