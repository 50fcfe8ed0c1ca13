"""Named models: published architectures (and a few CPU-sized ones) as ``ModelConfig`` fields.

    ModelConfig.preset("gpt2")                        # GPT-2 small
    ModelConfig.preset("gpt2", position="alibi")      # ... with any switch changed
    tjax train --preset gpt2 --model.position=alibi   # the same on the command line
    tjax presets                                      # the table below, with parameter counts

Each preset is data: the ``ModelConfig`` fields of the network (in the canonical form the
Hugging Face converter produces, so ``convert.hf_config_for`` and back gives the same config),
its exact parameter count, the Hugging Face class it matches, and the published rounded count
with where it was published. ``tests/test_presets.py`` checks the count three ways: this number,
``jax.eval_shape`` of our model's init, and the Hugging Face model built on the ``meta`` device
from the config our converter writes.

What a count includes: our models hold what the matching Hugging Face class holds. BERT
presets are ``BertForMaskedLM`` (MLM head, no pooler); BERT's published figures count
``BertModel`` (pooler, no MLM head), a difference of the head's LayerNorm and output bias.
Tied embeddings count once.

A preset fixes the vocabulary size of the published model (``tjax train`` then keeps it: the
byte tokenizer's 262 ids fit in every one of them); the CPU presets use the byte tokenizer's
262 ids, so their vocabulary follows the tokenizer as the default model's does.

This module is data plus lookup: it imports nothing above the registry (``config`` imports it).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from transformers_jax.registry import ConfigError
from transformers_jax.text_table import aligned


@dataclass(frozen=True)
class Preset:
    """One named model."""

    name: str
    model: dict[str, Any]  # ModelConfig fields (switches as JSON dicts)
    params: int  # exact parameter count (tests: eval_shape and the Hugging Face meta model)
    hf_class: str  # the matching Hugging Face class, e.g. GPT2LMHeadModel
    hf_model_type: str  # its model_type: the architecture convert.hf_config_for exports to
    published: str | None  # the published rounded count ("124M"); None where none is published
    source: str  # where the figure (or the architecture) was published
    notes: str = ""
    # CPU-sized: the default model's size (4 layers of width 128), whose 8.8k tokens/s on an
    # idle 2-core CPU (README) make 300 steps of 16x128 tokens about 70 s; slower under load
    cpu: bool = False

    @property
    def family(self) -> str:
        return self.model.get("family", "gpt")

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "family": self.family, "params": self.params,
                "published": self.published, "hf_class": self.hf_class, "source": self.source,
                "notes": self.notes, "cpu": self.cpu, "model": dict(self.model)}


# Layouts: the fields an architecture fixes, whatever its size ---------------------------------

def _gpt2(d: int, layers: int, heads: int, vocab: int = 50257, max_len: int = 1024) -> dict:
    """GPT-2: learned positions, pre-LayerNorm with biases, tanh GELU, tied embeddings."""
    return dict(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, d_ff=4 * d,
                max_len=max_len, position={"name": "learned"})


def _bert(d: int, layers: int, heads: int, vocab: int = 30522, max_len: int = 512) -> dict:
    """BERT: post-LayerNorm (eps 1e-12), exact-erf GELU, learned positions, token types."""
    return dict(family="bert", vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads,
                d_ff=4 * d, max_len=max_len, mask={"name": "bidirectional"},
                position={"name": "learned"}, norm={"name": "layernorm", "eps": 1e-12},
                norm_position="post", mlp="gelu_exact")


def _t5(d: int, layers: int, heads: int, d_ff: int, *, v1_1: bool, vocab: int = 32128,
        head_dim: int = 64) -> dict:
    """T5: bucketed relative bias, pre-RMSNorm, no biases, unscaled attention logits.
    v1.0: ReLU MLP, tied head; v1.1: GELU-gated MLP, separate head."""
    return dict(family="encdec", vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads,
                head_dim=head_dim, d_ff=d_ff, n_decoder_layers=layers,
                position={"name": "t5", "num_buckets": 32, "max_distance": 128},
                norm={"name": "rmsnorm", "eps": 1e-6}, mlp="geglu" if v1_1 else "relu",
                use_bias=False, tie_embeddings=not v1_1, attention_scale=1.0)


def _llama(d: int, layers: int, heads: int, kv_heads: int, d_ff: int, *, vocab: int,
           max_len: int, rope: dict, tied: bool, head_dim: int | None = None) -> dict:
    """Llama: RoPE (rotate-half), pre-RMSNorm, SwiGLU, GQA, no biases."""
    return dict(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads,
                n_kv_heads=kv_heads, head_dim=head_dim or d // heads, d_ff=d_ff,
                max_len=max_len, position={"name": "rope", "pairing": "rotate_half", **rope},
                norm="rmsnorm", mlp="swiglu", use_bias=False, tie_embeddings=tied)


def _llama3_rope(factor: float) -> dict:
    return {"base": 500000.0, "scaling": {"name": "llama3", "factor": factor,
                                          "original_max_len": 8192, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0}}


_GPT2_CARD = "Hugging Face model card openai-community/{}"
_COMPACT_BERT = ("Turc et al. 2019, 'Well-Read Students Learn Better' (arXiv:1908.08962), "
                 "google/bert_uncased_L-{}_H-{}_A-{}; the paper gives no parameter counts")
_T5_V1_1 = ("google/t5-v1_1-{} (T5 repository, released_checkpoints.md); no parameter count "
            "is published")

_ALL = [
    # GPT-2 (Radford et al. 2019). The paper's table says 117M/345M/762M/1542M, counted
    # differently; the model cards' figures match the released weights.
    Preset("gpt2", _gpt2(768, 12, 12), 124_439_808, "GPT2LMHeadModel", "gpt2", "124M",
           _GPT2_CARD.format("gpt2"), "GPT-2 small"),
    Preset("gpt2-medium", _gpt2(1024, 24, 16), 354_823_168, "GPT2LMHeadModel", "gpt2", "355M",
           _GPT2_CARD.format("gpt2-medium")),
    Preset("gpt2-large", _gpt2(1280, 36, 20), 774_030_080, "GPT2LMHeadModel", "gpt2", "774M",
           _GPT2_CARD.format("gpt2-large")),
    Preset("gpt2-xl", _gpt2(1600, 48, 25), 1_557_611_200, "GPT2LMHeadModel", "gpt2", "1.5B",
           _GPT2_CARD.format("gpt2-xl")),
    # BERT, uncased WordPiece vocabulary (30522). Originals: Devlin et al. 2019, section 3.
    Preset("bert-tiny", _bert(128, 2, 2), 4_416_698, "BertForMaskedLM", "bert", None,
           _COMPACT_BERT.format(2, 128, 2), "compact BERT, L=2 H=128"),
    Preset("bert-mini", _bert(256, 4, 4), 11_201_594, "BertForMaskedLM", "bert", None,
           _COMPACT_BERT.format(4, 256, 4), "compact BERT, L=4 H=256"),
    Preset("bert-small", _bert(512, 4, 8), 28_795_194, "BertForMaskedLM", "bert", None,
           _COMPACT_BERT.format(4, 512, 8), "compact BERT, L=4 H=512"),
    Preset("bert-medium", _bert(512, 8, 8), 41_404_730, "BertForMaskedLM", "bert", None,
           _COMPACT_BERT.format(8, 512, 8), "compact BERT, L=8 H=512"),
    Preset("bert-base", _bert(768, 12, 12), 109_514_298, "BertForMaskedLM", "bert", "110M",
           "Devlin et al. 2019, BERT (arXiv:1810.04805), section 3", "bert-base-uncased"),
    Preset("bert-large", _bert(1024, 24, 16), 335_174_458, "BertForMaskedLM", "bert", "340M",
           "Devlin et al. 2019, BERT (arXiv:1810.04805), section 3", "bert-large-uncased"),
    # T5 (Raffel et al. 2020) and T5 v1.1 (GELU-gated MLP, untied head, no dropout in
    # pre-training; shapes from the released configs).
    Preset("t5-small", _t5(512, 6, 8, 2048, v1_1=False), 60_506_624,
           "T5ForConditionalGeneration", "t5", "60M",
           "Raffel et al. 2020, T5 (arXiv:1910.10683), section 3.7", "T5 v1.0"),
    Preset("t5-base", _t5(768, 12, 12, 3072, v1_1=False), 222_903_552,
           "T5ForConditionalGeneration", "t5", "220M",
           "Raffel et al. 2020, T5 (arXiv:1910.10683), section 3.7", "T5 v1.0"),
    Preset("t5-v1_1-small", _t5(512, 8, 6, 1024, v1_1=True), 76_961_152,
           "T5ForConditionalGeneration", "t5", None, _T5_V1_1.format("small"), "T5 v1.1"),
    Preset("t5-v1_1-base", _t5(768, 12, 12, 2048, v1_1=True), 247_577_856,
           "T5ForConditionalGeneration", "t5", None, _T5_V1_1.format("base"), "T5 v1.1"),
    # Llama 3 (RoPE base 500000 with Llama 3.1's frequency scaling to 128K positions).
    Preset("llama-3.2-1b",
           _llama(2048, 16, 32, 8, 8192, vocab=128256, max_len=131072, rope=_llama3_rope(32.0),
                  tied=True), 1_235_814_400, "LlamaForCausalLM", "llama", "1.23B",
           "Meta model card meta-llama/Llama-3.2-1B", "Llama 3.2 1B, tied embeddings"),
    Preset("llama-3.1-8b",
           _llama(4096, 32, 32, 8, 14336, vocab=128256, max_len=131072, rope=_llama3_rope(8.0),
                  tied=False), 8_030_261_248, "LlamaForCausalLM", "llama", "8B",
           "Meta model card meta-llama/Llama-3.1-8B", "Llama 3.1 8B"),
    # Mistral 7B v0.1: Llama's layout with a 4096-token sliding window.
    Preset("mistral-7b",
           {**_llama(4096, 32, 32, 8, 14336, vocab=32000, max_len=32768,
                     rope={"base": 10000.0}, tied=False),
            "mask": {"name": "sliding_window", "window": 4096}},
           7_241_732_096, "MistralForCausalLM", "mistral", "7.3B",
           "Mistral AI, 'Mistral 7B' announcement (2023-09-27) and arXiv:2310.06825",
           "Mistral-7B-v0.1"),
    # CPU-sized: the published layouts at a size that trains here in about a minute, on the
    # byte tokenizer's 262 ids. Each still converts to its Hugging Face class.
    Preset("gpt2-cpu", _gpt2(128, 4, 4, vocab=262, max_len=256), 859_648, "GPT2LMHeadModel",
           "gpt2", None, "this project", "GPT-2 layout, 4 layers of width 128", cpu=True),
    Preset("llama-cpu",
           _llama(128, 4, 4, 2, 352, vocab=262, max_len=2048, rope={"base": 10000.0},
                  tied=False), 805_504, "LlamaForCausalLM", "llama", None, "this project",
           "Llama layout (GQA 4:2, SwiGLU, untied head), 4 layers of width 128", cpu=True),
    Preset("bert-cpu", _bert(128, 4, 4, vocab=262, max_len=256), 876_934, "BertForMaskedLM",
           "bert", None, "this project", "BERT layout, 4 layers of width 128", cpu=True),
    Preset("t5-cpu", _t5(128, 2, 4, 256, v1_1=False, vocab=262, head_dim=32), 690_688,
           "T5ForConditionalGeneration", "t5", None, "this project",
           "T5 v1.0 layout, 2+2 layers of width 128; trains on a task (--task reverse)",
           cpu=True),
]
PRESETS: dict[str, Preset] = {p.name: p for p in _ALL}
ALIASES = {"gpt2-small": "gpt2", "mistral-7b-v0.1": "mistral-7b",  # other name -> preset
           "bert-base-uncased": "bert-base", "bert-large-uncased": "bert-large"}


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str) -> Preset:
    """The preset called ``name`` (or one of its aliases); an unknown name is a
    ``ConfigError`` suggesting the closest ones."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key in PRESETS:
        return PRESETS[key]
    close = difflib.get_close_matches(key, [*PRESETS, *ALIASES], n=3, cutoff=0.5)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    raise ConfigError(f"unknown preset {name!r}; {hint}'tjax presets' lists them all: "
                      f"{', '.join(PRESETS)}")


def human_count(n: int) -> str:
    """``124439808`` -> ``124.4M``."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.{2 if n < 10 * div else 1}f}{unit}"
    return str(n)


def presets_table(presets: list[Preset] | None = None) -> str:
    """``tjax presets``: one row per preset, then where each published figure comes from."""
    presets = list(PRESETS.values()) if presets is None else presets
    header = ("name", "family", "params", "exact", "published", "Hugging Face class", "notes")
    rows = [(p.name, p.family, human_count(p.params), f"{p.params:,}", p.published or "-",
             p.hf_class, p.notes) for p in presets]
    lines = [*aligned(header, rows), "", "sources:"] + [f"  {p.name}: {p.source}" for p in presets]
    lines += ["", "use: tjax train --preset NAME [--model.FIELD=VALUE ...]; tjax bench --preset "
              "NAME; ModelConfig.preset(NAME, **fields). CPU-sized: "
              + ", ".join(p.name for p in presets if p.cpu)]
    return "\n".join(lines)
