"""Hugging Face directory <-> (``ModelConfig``, params) <-> run directory, and ``tjax convert``.

    hf = load_hf("gpt2-dir")                         # HFCheckpoint: config, params, ...
    logits = build_model(hf.config).apply({"params": hf.params}, tokens)
    convert_hf_directory("gpt2-dir", "runs/gpt2")   # then load_run / tjax sample --run runs/gpt2
    export_run("runs/gpt2", "gpt2-again")           # config.json + model.safetensors
    save_hf("out-dir", config, params)               # any expressible config, no run needed
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

import numpy as np

from transformers_jax.config import ConfigError, ModelConfig
from transformers_jax.convert.common import (
    ARCHITECTURES,
    Architecture,
    architecture_for,
    check_against_model,
    flatten,
    hf_to_ours,
    ours_to_hf,
    supported_classes,
    unflatten,
)
from transformers_jax.convert.hf_files import (
    CONFIG_FILE,
    SAFETENSORS_FILE,
    ConversionError,
    read_config,
    read_weights,
    source_dtype,
    write_safetensors,
)
from transformers_jax.convert.tokenizer import HFTokenizer, has_hf_tokenizer, is_tjax_tokenizer_file
from transformers_jax.data.tokenizers import (
    EXTERNAL,
    TOKENIZER_FILE,
    ByteTokenizer,
    Tokenizer,
    load_tokenizer,
)
from transformers_jax.overrides import CommandParser
from transformers_jax.runs.load import open_run
from transformers_jax.runs.write import write_run

TJAX_TOKENIZER_DIR = "tjax_tokenizer"  # our tokenizer inside an exported Hugging Face directory
DTYPE_CHOICES = ("float32", "bfloat16", "float16", "auto")


@dataclasses.dataclass
class HFCheckpoint:
    """A converted Hugging Face model: our config and params plus where they came from."""

    config: ModelConfig
    params: dict  # the unboxed tree build_model(config).init makes (numpy arrays)
    model_type: str  # gpt2, llama, ...
    hf_class: str  # GPT2LMHeadModel, LlamaForCausalLM, ...
    hf_config: dict  # the original config.json
    source_dtype: str  # the checkpoint's dtype (float32, bfloat16, float16)


def load_hf(src: str, *, dtype: str = "float32", attention: str = "xla") -> HFCheckpoint:
    """Convert a Hugging Face model directory (``config.json`` plus ``model.safetensors``,
    sharded safetensors or ``pytorch_model.bin``) into our config and params.

    ``dtype``: parameter and compute dtype (``auto``: the checkpoint's). ``attention``: our
    attention implementation (any; the weights do not depend on it). Raises
    ``ConversionError`` for an unsupported architecture or a config field this project cannot
    express, naming it; nothing is ever converted approximately.
    """
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype={dtype!r}: valid choices: {', '.join(DTYPE_CHOICES)}")
    raw = read_config(src)
    config_path = os.path.join(src, "config.json")
    try:
        arch, hf_class = architecture_for(raw)
        config = arch.config_from_hf(raw)
    except ConversionError:
        raise
    except KeyError as err:
        raise ConversionError(f"{config_path}: field {err} is missing") from None
    except (ConfigError, TypeError, ValueError) as err:  # a field of the wrong type or range
        raise ConversionError(f"{config_path}: {err}") from None
    tensors = read_weights(src)
    if arch.refine is not None:
        config = arch.refine(config, raw, tensors)
    src_dtype = source_dtype(raw, tensors)
    param_dtype = src_dtype if dtype == "auto" else dtype
    config = config.replace(attention=attention, dtype=param_dtype, param_dtype=param_dtype)
    weight_files = sorted(f for f in os.listdir(src) if f.endswith((".safetensors", ".bin")))
    mismatch = (f"the sizes come from {config_path}, the tensors from "
                f"{', '.join(weight_files)} in {src}: one of them is damaged or they belong to "
                "different models")
    try:
        flat = hf_to_ours(arch, config, raw, tensors)
        flat = {k: np.asarray(v).astype(param_dtype) for k, v in flat.items()}
        check_against_model(config, flat)
    except KeyError as err:
        raise ConversionError(f"the weights lack tensor {err}; {mismatch}") from None
    except ValueError as err:  # ConversionError included: shapes that disagree
        raise ConversionError(f"{err}\n({mismatch})") from None
    return HFCheckpoint(config, unflatten(flat), arch.model_type, hf_class, raw, src_dtype)


def tokenizer_for(src: str, config: ModelConfig) -> tuple[Tokenizer | None, str]:
    """The tokenizer a converted run should carry, and a note saying where it came from.

    In order: our own tokenizer saved by ``export_run`` (``src/tjax_tokenizer``); the Hugging
    Face tokenizer files of ``src`` (wrapped by ``HFTokenizer``, needs ``transformers``); the
    byte tokenizer when there are no tokenizer files and the vocabulary is exactly the byte
    tokenizer's 262 ids; otherwise none (token ids only).
    """
    ours = os.path.join(src, TJAX_TOKENIZER_DIR)
    if is_tjax_tokenizer_file(os.path.join(ours, TOKENIZER_FILE)):
        tok = load_tokenizer(ours)
        return tok, f"the {tok.name} tokenizer saved with the exported run"
    if has_hf_tokenizer(src):
        try:
            tok = HFTokenizer(src)
        except ImportError as err:
            return None, f"{src} has Hugging Face tokenizer files, but {err}"
        note = f"Hugging Face tokenizer {type(tok.hf).__name__} copied from {src}"
        if tok.vocab_size > config.vocab_size:
            note += (f"; WARNING: it has {tok.vocab_size} ids, more than the model's "
                     f"{config.vocab_size}")
        return tok, note
    byte = ByteTokenizer()
    if config.vocab_size == byte.vocab_size:
        return byte, (f"{src} has no tokenizer; the vocabulary size {config.vocab_size} is the "
                      "byte tokenizer's, so byte-level ids are assumed")
    return None, (f"{src} has no tokenizer files and its {config.vocab_size}-id vocabulary is "
                  "not the byte tokenizer's: the run works on token ids (generate from ids with "
                  "the Python API); encode text with the model's own tokenizer")


def convert_hf_directory(
    src: str, out_run_dir: str, *, dtype: str = "float32", overwrite: bool = False
) -> dict[str, Any]:
    """Convert a Hugging Face directory into a run directory laid out like a trained run;
    returns a summary (run dir, architecture, params, tokenizer kind and note).

    The run is step 0 with a fresh AdamW state (see ``runs.write.write_run``);
    ``meta["source"]`` keeps the original ``config.json`` so ``export_run`` can write it back.
    ``runs.load_run`` (and ``tjax sample``/``eval --run``) restores it like any run; its
    tokenizer is None when the source's could not be loaded here (token ids only).
    """
    hf = load_hf(src, dtype=dtype)
    tokenizer, note = tokenizer_for(src, hf.config)
    source = {
        "format": "huggingface",
        "path": os.path.abspath(src),
        "architecture": hf.hf_class,
        "model_type": hf.model_type,
        "dtype": hf.source_dtype,
        "config": hf.hf_config,
    }
    checkpoint = write_run(out_run_dir, hf.config, hf.params, tokenizer=tokenizer,
                           tokenizer_note=note, source=source, overwrite=overwrite)
    n_params = int(sum(np.prod(v.shape) for v in flatten(hf.params).values()))
    return {
        "run_dir": out_run_dir,
        "checkpoint": checkpoint,
        "architecture": hf.hf_class,
        "params": n_params,
        "config": hf.config,
        "tokenizer": tokenizer.name if tokenizer is not None else EXTERNAL,
        "tokenizer_note": note,
    }


# Export ----------------------------------------------------------------------------------------


def _canonical(config: ModelConfig) -> ModelConfig:
    """``config`` with everything that does not change the function a model computes reset, so
    that two configs of the same network compare equal."""
    scale = config.attention_scale
    if scale is not None and scale == config.dims_per_head**-0.5:
        scale = None
    return config.replace(
        attention="xla", dtype="float32", param_dtype="float32",
        dropout=0.0, init_std=0.02, d_ff=config.ff_dim, head_dim=config.dims_per_head,
        n_kv_heads=config.kv_heads, attention_scale=scale,
        # the length limit matters only to a scheme that has one (a learned table)
        max_len=config.max_len if config.position.max_length(config) is not None else 256,
    )


def hf_config_for(
    config: ModelConfig, base_config: dict | None = None, architecture: str | None = None
) -> tuple[Architecture, dict]:
    """The Hugging Face architecture and ``config.json`` for our ``config``.

    ``architecture`` (a model_type such as ``gpt2``/``llama``) defaults to the one of
    ``base_config``, else the only one that can express ``config`` (an error lists, for each
    architecture, why it cannot). The result is checked by converting it back.
    """
    if architecture is None and base_config is not None:
        architecture = architecture_for(base_config)[0].model_type
    if architecture is not None:
        arch = ARCHITECTURES.get(architecture)
        hf = arch.config_to_hf(config, base_config)
    else:
        found, reasons = [], []
        for name in ARCHITECTURES:
            candidate = ARCHITECTURES.get(name)
            try:
                found.append((candidate, candidate.config_to_hf(config, None)))
            except ConversionError as err:
                reasons.append(str(err))
        if not found:
            raise ConversionError(
                "no Hugging Face architecture expresses this config:\n  " + "\n  ".join(reasons)
            )
        arch, hf = found[0]
    back = arch.config_from_hf(hf)
    if _canonical(back) != _canonical(config):
        from transformers_jax.runs.checkpoint import config_differences

        diffs = config_differences(dataclasses.asdict(_canonical(back)),
                                   dataclasses.asdict(_canonical(config)))
        raise ConversionError(
            f"the exported {arch.model_type} config would not give back this model:\n  "
            + "\n  ".join(diffs)
        )
    return arch, hf


def export_class(config: ModelConfig) -> str | None:
    """The Hugging Face class ``tjax convert --to-hf`` writes for a run of ``config`` trained
    here (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ...), or None when no architecture
    expresses it exactly: what a run's README may suggest."""
    try:
        arch, _ = hf_config_for(config)
    except (ConversionError, ConfigError):
        return None
    return arch.hf_classes[0]


def save_hf(
    dst: str,
    config: ModelConfig,
    params: Any,
    *,
    base_config: dict | None = None,
    architecture: str | None = None,
    dtype: str | None = None,
    tokenizer: Tokenizer | None = None,
) -> str:
    """Write ``config.json`` and ``model.safetensors`` that ``from_pretrained`` loads.

    ``dtype``: of the written tensors (default: the params' own). ``tokenizer``: a Hugging
    Face tokenizer's files are copied beside the weights; one of ours is saved under
    ``dst/tjax_tokenizer`` so that converting back restores it.
    """
    arch, hf = hf_config_for(config, base_config, architecture)
    flat = {k: np.asarray(v) for k, v in flatten(params).items()}
    tensors = ours_to_hf(arch, config, hf, flat)
    if dtype is None:
        dtype = str(next(iter(flat.values())).dtype)
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={dtype!r}: valid choices: float32, bfloat16, float16")
    tensors = {k: v.astype(dtype) for k, v in tensors.items()}
    hf.pop("torch_dtype", None)
    hf["dtype"] = dtype
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, CONFIG_FILE), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    write_safetensors(os.path.join(dst, SAFETENSORS_FILE), tensors)
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.save_hf(dst)
    elif tokenizer is not None:
        tokenizer.save(os.path.join(dst, TJAX_TOKENIZER_DIR))
    return dst


def export_run(
    run_dir: str, dst: str, *, step: int | None = None, dtype: str | None = None,
    architecture: str | None = None,
) -> str:
    """Write a run (converted or trained here) as a Hugging Face directory.

    A run converted from Hugging Face gets its original ``config.json`` back, updated with
    the model's fields, and its original dtype; a run trained here needs a config that GPT-2
    or Llama can express.
    """
    run = open_run(run_dir, step)
    if run.classifier:
        raise ConversionError(
            f"{run_dir} holds a {run.objective.name} classifier, which has no Hugging Face "
            "architecture here (only language models convert): export the masked-LM run it "
            "was fine-tuned from, or evaluate this one with tjax eval")
    source = run.meta.get("source") or {}
    base = source.get("config") if source.get("format") == "huggingface" else None
    return save_hf(dst, run.config, run.params, base_config=base, architecture=architecture,
                   dtype=dtype or source.get("dtype"), tokenizer=run.tokenizer)


# Parity against transformers -------------------------------------------------------------------


def hf_logits(src: str, tokens: np.ndarray, decoder_tokens: np.ndarray | None = None):
    """Float32 logits ``[B, T, V]`` of the PyTorch model in ``src`` (needs torch+transformers).

    For an encoder-decoder, ``tokens`` are the encoder inputs and ``decoder_tokens`` (default
    ``tokens``) the decoder inputs.
    """
    import torch
    import transformers

    arch, _ = architecture_for(read_config(src))
    auto = getattr(transformers, arch.hf_auto)
    model = auto.from_pretrained(src, dtype=torch.float32).eval()
    ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    kwargs = {}
    if model.config.is_encoder_decoder:
        decoder = tokens if decoder_tokens is None else decoder_tokens
        kwargs["decoder_input_ids"] = torch.as_tensor(np.asarray(decoder), dtype=torch.long)
    with torch.no_grad():
        out = model(ids, **kwargs)
    return out.logits.float().numpy()


def compare_with_hf(src: str, hf: HFCheckpoint, tokens: np.ndarray) -> float:
    """Max absolute logit difference between our converted model and ``transformers`` on
    ``tokens`` (for an encoder-decoder: as both encoder and decoder inputs)."""
    import jax.numpy as jnp

    from transformers_jax.models import build_model, family_of

    model = build_model(hf.config)
    tokens_BT = jnp.asarray(tokens)
    extra = family_of(hf.config).inputs_for(hf.config, tokens_BT)
    ours = model.apply({"params": hf.params}, tokens_BT, **extra)
    return float(np.max(np.abs(np.asarray(ours, np.float32) - hf_logits(src, tokens))))


# tjax convert ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``tjax convert --from-hf DIR --out RUN_DIR`` / ``tjax convert --to-hf DIR --run RUN_DIR``."""
    parser = CommandParser(
        "tjax convert", "Convert Hugging Face PyTorch checkpoints to runs of this project and "
        f"back. Supported: {', '.join(supported_classes())}.")
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="DIR",
                           help="Hugging Face model directory (config.json + weights)")
    direction.add_argument("--to-hf", metavar="DIR", help="write a Hugging Face directory here")
    parser.add_argument("--out", metavar="RUN_DIR", help="run directory to create (--from-hf)")
    parser.add_argument("--run", metavar="RUN_DIR", help="run directory to export (--to-hf)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (--to-hf)")
    parser.add_argument("--dtype", default=None, choices=DTYPE_CHOICES,
                        help="params dtype (--from-hf, default float32) or written dtype "
                        "(--to-hf, default the source's)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the checkpoints of an existing run directory")
    parser.add_argument("--verify", action="store_true",
                        help="--from-hf: compare logits with transformers on random tokens "
                        "(needs torch and transformers)")
    args, _, _ = parser.parse(argv)
    try:
        return _run(parser, args)
    except (ConversionError, FileNotFoundError, FileExistsError, ValueError) as err:
        if os.environ.get("TJAX_DEBUG"):
            raise
        print(f"tjax convert: error: {err}", file=sys.stderr)
        return 2


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.from_hf:
        if not args.out:
            parser.error("--from-hf needs --out RUN_DIR")
        summary = convert_hf_directory(args.from_hf, args.out, dtype=args.dtype or "float32",
                                       overwrite=args.overwrite)
        cfg = summary["config"]
        print(f"converted {summary['architecture']} ({summary['params'] / 1e6:.2f}M params, "
              f"{cfg.n_layers} layers, d_model {cfg.d_model}, vocab {cfg.vocab_size}) -> "
              f"{summary['checkpoint']}")
        print(f"tokenizer: {summary['tokenizer']} ({summary['tokenizer_note']})")
        if args.verify:
            hf = load_hf(args.from_hf, dtype="float32")
            length = min(16, cfg.max_len)
            tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, length))
            print(f"verify: max |logit difference| vs transformers = "
                  f"{compare_with_hf(args.from_hf, hf, tokens):.3g} (float32, {length} tokens)")
        return 0
    if not args.run:
        parser.error("--to-hf needs --run RUN_DIR")
    if args.dtype == "auto":
        parser.error("--to-hf takes --dtype float32, bfloat16 or float16")
    dst = export_run(args.run, args.to_hf, step=args.step, dtype=args.dtype)
    print(f"exported {args.run} -> {dst} ({CONFIG_FILE}, {SAFETENSORS_FILE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
