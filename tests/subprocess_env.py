"""The environment a test gives a subprocess (``tjax``, a multi-host worker)."""

import os


def single_device_env() -> dict:
    """This environment with conftest's XLA flags minus its 8 fake devices (one CPU device, as
    a user has; the cheap compiles kept)."""
    return {**os.environ, "XLA_FLAGS": os.environ.get("TJAX_TEST_CHILD_XLA_FLAGS", "")}


# The suite's cheap-compile flags (tests/conftest.py) that change which kernels XLA:CPU makes;
# a test that reads the program users get compiles without them.
CHEAP_KERNEL_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)
# per compile, the same undone (``Lowered.compile(USER_KERNELS)``)
USER_KERNELS = {"xla_cpu_use_fusion_emitters": True}


def user_compile_env() -> dict:
    """``single_device_env`` without the flags that change XLA:CPU's kernels, for a process
    whose compile a test reads as users would get it."""
    env = single_device_env()
    env["XLA_FLAGS"] = " ".join(f for f in env["XLA_FLAGS"].split()
                                if f not in CHEAP_KERNEL_FLAGS)
    return env
