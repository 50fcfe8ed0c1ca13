"""``tjax`` that crashes mid-run, for the tests of resuming: ``python tests/crash_train.py
STEP train ARGS...`` runs ``tjax train ARGS...`` and SIGKILLs itself once step ``STEP`` is done
(after its checkpoint, when one is due, has been started), as a power cut or the kernel's OOM
killer would. The fault enters through the training loop's ``on_step`` hook
(``train.loop.train``), which this script sets before handing the command line to the CLI."""

import functools
import os
import signal
import sys

from transformers_jax import cli
from transformers_jax.train import loop


def crash_after(last: int):
    """An ``on_step`` hook that kills the process without any clean-up after step ``last``."""

    def on_step(step: int) -> None:
        if step == last:
            os.kill(os.getpid(), signal.SIGKILL)

    return on_step


def main(argv: list[str]) -> int:
    step, *command = argv
    loop.train = functools.partial(loop.train, on_step=crash_after(int(step)))
    return cli.main(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
