"""The lm-evaluation-harness adapter: any run directory scored on lm-eval tasks.

- ``scoring.py``: the token-level work (scores of continuations, generation through the KV
  cache), batched and length-bucketed; no lm-eval import;
- ``model.py``: ``TjaxLM``, the ``lm_eval`` model, registered as ``tjax`` on import;
- ``tasks.py``: ``evaluate_tasks``, what ``tjax eval --lm-eval TASKS`` runs;
- ``__main__.py``: lm-eval's own command line with ``tjax`` registered
  (``python -m transformers_jax.harness --model tjax --model_args run=RUN_DIR --tasks ...``).

lm-eval is an optional dependency (``pip install 'transformers-jax[lm-eval]'``): nothing here
imports it until ``model.py`` or ``tasks.py`` is used.
"""
