"""The environment a test gives a subprocess (``tjax``, a multi-host worker)."""

import os


def single_device_env(**extra: str) -> dict:
    """This environment with conftest's XLA flags minus its 8 fake devices (one CPU device, as
    a user has; the cheap compiles kept), ``extra`` on top."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = os.environ.get("TJAX_TEST_CHILD_XLA_FLAGS", "")
    env.update(extra)
    return env
