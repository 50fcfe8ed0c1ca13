"""The maths of one training step, below the parallel strategies that run it.

- ``losses.py``: losses and metrics on logits; ``objectives.py``: the registered objectives
  (a loss, how it builds and starts its model);
- ``step.py``: ``TrainState``, ``init_state`` and the jit-able train and eval steps;
- ``lora.py``: low-rank adapters; ``optim.py``: the optimiser (clipped AdamW, schedules);
- ``flops.py``: the model FLOPs per token and the device peak MFU is measured against.

Nothing here reads a run directory, a mesh or a device count: ``parallel/`` places these
functions on devices and ``train/`` runs them.
"""
