"""Offline at once, not after a minute of retries: where the Hugging Face hub cannot be reached,
this process is put in the Hugging Face libraries' offline mode before it asks for anything.

Without it a dataset that is not cached (``--data hf:NAME``, an lm-eval task such as
``hellaswag``) is fetched with retried requests for about a minute before the connection
error comes. In offline mode a dataset in the local cache still loads, and one that is not
fails at once; the callers turn that failure into one line naming the fix.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
from urllib.parse import urlparse

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
TRUE = ("1", "ON", "YES", "TRUE")


def offline_by_setting() -> bool:
    """The user (or an earlier call) put the Hugging Face libraries offline."""
    return any(os.environ.get(name, "").upper() in TRUE for name in OFFLINE_VARIABLES)


@functools.cache
def hub_reachable(timeout: float = 3.0) -> bool:
    """A TCP connection to the hub's endpoint (``HF_ENDPOINT``, default huggingface.co) opens
    within ``timeout`` seconds: the one question, asked once a process (each stream and split
    listing would ask it again), that retries would ask for a minute."""
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def offline_unless_reachable(timeout: float = 3.0) -> bool:
    """Put this process offline (``HF_HUB_OFFLINE``, also in the libraries already imported)
    when the hub cannot be reached; returns whether it is offline."""
    if offline_by_setting():
        return True
    if hub_reachable(timeout):
        return False
    for name in OFFLINE_VARIABLES:
        os.environ[name] = "1"
    if "huggingface_hub.constants" in sys.modules:  # they read their setting at import
        sys.modules["huggingface_hub.constants"].HF_HUB_OFFLINE = True
    if "datasets.config" in sys.modules:
        config = sys.modules["datasets.config"]
        config.HF_HUB_OFFLINE = config.HF_DATASETS_OFFLINE = True
    return True
