"""Hugging Face PyTorch checkpoints <-> this project's models, exactly or not at all.

Supported architectures (``config.json`` ``architectures``): GPT-2 (``GPT2LMHeadModel``,
``GPT2Model``), Llama (``LlamaForCausalLM``, ``LlamaModel``), Mistral (``MistralForCausalLM``,
``MistralModel``), BERT (``BertForMaskedLM``, ``BertForPreTraining``) and T5
(``T5ForConditionalGeneration``). A config field this project cannot express (an exact-erf
GELU, per-layer attention scaling, a YaRN attention factor of its own, ...) is a
``ConversionError`` that names the field and value.

- ``load_hf(dir)`` -> ``HFCheckpoint`` (``config``, ``params``, source info);
- ``convert_hf_directory(dir, run_dir)``: a run directory ``runs.load_run`` restores
  (``load_converted_run`` is that function under its former name);
- ``save_hf(dir, config, params)`` / ``export_run(run_dir, dir)``: back to ``config.json`` +
  ``model.safetensors`` that ``transformers`` loads;
- ``main(argv)``: ``tjax convert --from-hf DIR --out RUN_DIR`` and
  ``tjax convert --to-hf DIR --run RUN_DIR``.

Reading and writing safetensors needs neither torch nor the ``safetensors`` package;
``pytorch_model.bin`` and the parity checks need torch and transformers (the ``parity`` extra).
"""

from transformers_jax.convert import (  # noqa: F401  (register the architectures)
    bert,
    gpt2,
    llama,
    t5,
)
from transformers_jax.convert.api import (
    HFCheckpoint,
    compare_with_hf,
    convert_hf_directory,
    export_run,
    hf_config_for,
    hf_logits,
    load_hf,
    main,
    save_hf,
    tokenizer_for,
)
from transformers_jax.convert.common import ARCHITECTURES, supported_classes
from transformers_jax.convert.hf_files import ConversionError
from transformers_jax.convert.tokenizer import HFTokenizer
from transformers_jax.runs.load import load_run as load_converted_run  # one loader for every run
from transformers_jax.runs.write import write_run

__all__ = [
    "ARCHITECTURES",
    "ConversionError",
    "HFCheckpoint",
    "HFTokenizer",
    "compare_with_hf",
    "convert_hf_directory",
    "export_run",
    "hf_config_for",
    "hf_logits",
    "load_converted_run",
    "load_hf",
    "main",
    "save_hf",
    "supported_classes",
    "tokenizer_for",
    "write_run",
]
