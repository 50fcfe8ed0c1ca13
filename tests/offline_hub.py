"""``tjax`` with the Hugging Face Hub answered from local jsonl files, for the tests of hub
streams through the CLI without network: ``python tests/offline_hub.py [STEP] train ARGS...``
with ``TJAX_TEST_HUB=SPLIT=FILE.jsonl,SPLIT=FILE.jsonl`` streams each listed split of any
``hf:NAME`` from its file (the one seam, ``data.hub.load_dataset``, replaced); a leading
``STEP`` also SIGKILLs the run after that step (``crash_train.py``)."""

import os
import sys

import datasets
from crash_train import main as crash_main

from transformers_jax import cli
from transformers_jax.data import hub


def main(argv: list[str]) -> int:
    files = dict(item.split("=", 1) for item in os.environ["TJAX_TEST_HUB"].split(","))

    def load_dataset(**kwargs):
        return datasets.load_dataset(
            "json",
            data_files=[files[kwargs["split"]]],
            split="train",
            streaming=kwargs["streaming"],
        )

    hub.load_dataset = load_dataset
    hub.split_names = lambda spec: list(files)
    return crash_main(argv) if argv[0].isdigit() else cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
