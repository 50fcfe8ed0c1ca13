"""``tjax merge``: a LoRA run's adapters folded into its base model, written as a plain run
(a conversion between run formats, beside the Hugging Face ones)."""

from __future__ import annotations

import dataclasses
import os

from transformers_jax import __version__
from transformers_jax.config import LoraConfig
from transformers_jax.convert.api import export_class
from transformers_jax.nn.layers import count_params
from transformers_jax.runs.load import open_run
from transformers_jax.runs.readme import write_run_readme
from transformers_jax.runs.write import read_meta_of, write_run


def merge_lora_run(run_dir: str, out_dir: str, *, overwrite: bool = False) -> str:
    """Write a LoRA run's newest adapters folded into its base as a plain run that ``tjax
    sample``, ``eval`` and ``convert --to-hf`` read like any other: at the LoRA run's step,
    with its data (``tjax eval`` scores the same held-out text), its tokenizer and its
    training settings without the adapters, a README and ``tjax_config.json``. The base's
    ``source`` record (a converted model's config.json) is carried over, with the lineage:
    the adapter run, its step and rank, and the base run and step. Returns the checkpoint
    directory."""
    run = open_run(run_dir)
    if not run.train_config.lora.enabled:
        raise ValueError(f"{run_dir} was not trained with --train.lora.rank (no adapters): "
                         "it is a plain run already, read it as it is")
    base = run.meta["lora_base"]
    source = dict(read_meta_of(base["run"], base["step"]).get("source") or {})
    lora = dataclasses.asdict(run.train_config.lora)
    source["lora"] = {"run": os.path.abspath(run_dir), "step": run.step, "base": base, **lora}
    train_cfg = run.train_config.replace(lora=LoraConfig(), init_from=None, run_dir=out_dir)
    path = write_run(out_dir, run.config, run.params, tokenizer=run.tokenizer,
                     tokenizer_note=run.meta["tokenizer"].get("note"), source=source,
                     overwrite=overwrite, train_config=train_cfg, step=run.step,
                     data=run.meta.get("data"))
    lineage = [f"adapters of the LoRA run `{os.path.abspath(run_dir)}` at step {run.step} "
               f"(rank {lora['rank']} on {', '.join(lora['targets'])}) folded into its base, "
               f"`{base['run']}` at step {base['step']}",
               "a fresh optimizer state: `--train.init_from` this run to fine-tune it further"]
    write_run_readme(out_dir, run.config, train_cfg,
                     {"steps": run.step, "params": count_params(run.params)},
                     data_description=(run.meta.get("data") or {}).get("description", ""),
                     tokenizer=run.meta["tokenizer"].get("kind", "external"),
                     version=__version__, lineage=lineage,
                     command=f"tjax merge --run {run_dir} --out {out_dir}",
                     hf_class=export_class(run.config))
    return path
