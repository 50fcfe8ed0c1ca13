"""lm-eval's command line with the ``tjax`` model registered: lm-eval 0.4.13 finds third-party
models only among imported modules (no entry points), so this imports ours first.

    python -m transformers_jax.harness --model tjax --model_args run=runs/gpt \
        --tasks lambada_openai --include_path my_tasks/
"""

import sys

from transformers_jax.harness.tasks import require_lm_eval

if __name__ == "__main__":
    require_lm_eval()
    from lm_eval.__main__ import cli_evaluate

    import transformers_jax.harness.model  # noqa: F401  (registers "tjax")

    sys.exit(cli_evaluate())
