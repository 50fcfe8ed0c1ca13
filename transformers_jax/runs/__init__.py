"""The run directory: everything a training run keeps, and loading it back.

- ``layout.py``: the name of every file and folder of ``RUN_DIR`` (no JAX);
- ``checkpoint.py``: orbax checkpoints with manifests (``Checkpointer``), damage checks;
- ``meta.py``: the metadata of each checkpoint, and how a resume compares it;
- ``tokenizer.py``, ``labels.py``: the tokenizer and a classifier's class names;
- ``lock.py``: one writer per run directory; ``readme.py``: ``RUN_DIR/README.md``;
- ``load.py``: ``load_run``/``open_run``, any run back as a model and params (for sampling,
  evaluation, export and fine-tuning); ``write.py``: parameters from elsewhere as a run;
- ``data.py``: the data a run reads (tokenizer, resumable training batches, eval batches).

The training loop (``train/loop.py``) writes runs through these modules; ``tjax sample``,
``tjax eval``, ``tjax fill-mask`` and ``tjax convert`` read them through ``load.py``.

    from transformers_jax.runs import load_run
    model, params, tokenizer, config = load_run("runs/gpt")

The names below load on first use, so that ``runs.layout`` or ``runs.lock`` cost no JAX.
"""

from __future__ import annotations

from transformers_jax.lazy import lazy_exports

_EXPORTS = {
    "Run": "transformers_jax.runs.load",
    "load_run": "transformers_jax.runs.load",
    "open_run": "transformers_jax.runs.load",
    "run_tokenizer": "transformers_jax.runs.tokenizer",
    "read_run_meta": "transformers_jax.runs.meta",
    "write_run": "transformers_jax.runs.write",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports("transformers_jax.runs", _EXPORTS, globals())

