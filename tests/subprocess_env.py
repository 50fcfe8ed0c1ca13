"""The environment a test gives a subprocess (``tjax``, a multi-host worker)."""

import os


def single_device_env() -> dict:
    """This environment with conftest's XLA flags minus its 8 fake devices (one CPU device, as
    a user has; the cheap compiles kept)."""
    return {**os.environ, "XLA_FLAGS": os.environ.get("TJAX_TEST_CHILD_XLA_FLAGS", "")}
