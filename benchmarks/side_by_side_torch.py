"""The PyTorch side of ``side_by_side.py``, one process per call; never imports jax.

    python benchmarks/side_by_side_torch.py --dir D --impl hf      # GPT2LMHeadModel
    python benchmarks/side_by_side_torch.py --dir D --impl torch   # torch_gpt.TorchGPT
    python benchmarks/side_by_side_torch.py --dir D --impl torch --compile  # torch.compile

Loads the weights ``side_by_side_jax.py prepare`` exported (GPT-2 layout), trains them on the
prepared batches with ``torch.optim.AdamW`` matched to our optimizer (the same betas, epsilon,
weight decay on matrices only, global-norm clipping and the prepared learning rate of every
step), decodes greedily with a KV cache (Hugging Face ``generate``; the plain GPT's own loop),
and prints one JSON object like the JAX worker's. Threads: PyTorch's defaults unless
``--threads N`` is given (recorded either way).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
from side_by_side_shared import (
    HF_DIR,
    add_run_options,
    emit,
    forbidden_imports,
    host_memory,
    median,
    process_facts,
    read_plan,
    time_decoding,
)


def load_model(directory: str, impl: str, shape: dict) -> torch.nn.Module:
    path = os.path.join(directory, HF_DIR)
    if impl == "hf":
        from transformers import BertForMaskedLM, GPT2LMHeadModel

        hf_class = GPT2LMHeadModel if shape["kind"] == "gpt" else BertForMaskedLM
        return hf_class.from_pretrained(path)  # default attention (sdpa)
    from safetensors.torch import load_file
    from torch_gpt import GPTShape, TorchGPT

    model = TorchGPT(GPTShape(vocab=shape["vocab"], context=shape["context"],
                              width=shape["width"], layers=shape["layers"],
                              heads=shape["heads"]))
    model.load_gpt2_state_dict(load_file(os.path.join(path, "model.safetensors")))
    return model


def logits_of(model, impl: str):
    if impl == "hf":
        return lambda tokens: model(input_ids=tokens).logits
    return model


def train(model, impl: str, compile_: bool, plan: dict, arrays: dict, warmup: int,
          timed: bool) -> dict:
    hyper = plan["optimizer"]
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": hyper["weight_decay"]},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=float(arrays["learning_rates"][0]), betas=(hyper["b1"], hyper["b2"]),
        eps=hyper["eps"])
    forward = logits_of(torch.compile(model) if compile_ else model, impl)
    losses, seconds = [], []
    for i in range(plan["steps"]):
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = float(arrays["learning_rates"][i])
        inputs = torch.from_numpy(arrays["inputs"][i]).long()
        targets = torch.from_numpy(arrays["targets"][i]).long()
        if "weights" in arrays:  # masked LM: the loss over the chosen positions only
            targets = torch.where(torch.from_numpy(arrays["weights"][i]) > 0, targets, -100)
        logits = forward(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                                 ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, hyper["grad_clip_global_norm"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.item()))
        seconds.append(time.perf_counter() - start)
    out = {"losses": losses}
    if timed:
        timed_s = seconds[warmup:]
        tokens = plan["shape"]["batch"] * plan["shape"]["train_len"]
        out.update(tokens_per_s=tokens / median(timed_s), step_s=timed_s, warmup_steps=warmup,
                   first_step_s=seconds[0])
    return out


def greedy(model, impl: str, compile_: bool, prompts: np.ndarray, new: int):
    """A function that decodes ``new`` tokens greedily after ``prompts`` with the KV cache,
    prefill included, and returns the new tokens ``[B, new]``. Compiled (plain GPT only): the
    per-token step, whose shapes stay fixed (a mask over the whole cache)."""
    ids = torch.from_numpy(prompts).long()
    if impl == "hf":
        from transformers import GenerationConfig

        config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  num_beams=1, use_cache=True, eos_token_id=None,
                                  pad_token_id=0)
        attention = torch.ones_like(ids)

        def run():
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=attention,
                                     generation_config=config)
            return out[:, ids.shape[1]:]

        return run
    # static shapes: one graph per decoding batch, compiled in its warm-up call
    step = torch.compile(model.decode_step, dynamic=False) if compile_ else None
    return lambda: model.generate_greedy(ids, new, step=step)


def decode(model, impl: str, compile_: bool, plan: dict, arrays: dict, repeats: int,
           timed: bool) -> dict:
    model.eval()
    new = plan["shape"]["new_tokens"]
    out = {}
    for b in plan["shape"]["decode_batches"]:
        run = greedy(model, impl, compile_, arrays[f"prompts_b{b}"], new)
        out[f"batch_{b}"] = time_decoding(run, lambda t: t.numpy().tolist(), b * new,
                                          repeats, timed)
    return out


def versions() -> dict:
    out = {"torch": torch.__version__, "numpy": np.__version__}
    if "transformers" in sys.modules:
        out["transformers"] = sys.modules["transformers"].__version__
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--impl", choices=("hf", "torch"), required=True)
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model for training and the decoding step "
                        "(plain GPT only)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--tjax-malloc", action="store_true",
                        help="glibc malloc tunables as tjax sets them for itself "
                        "(default: the system's malloc settings, what PyTorch users run)")
    add_run_options(parser)
    args = parser.parse_args(argv)
    if args.compile and args.impl != "torch":
        parser.error("--compile is for the plain PyTorch GPT (--impl torch)")
    malloc = host_memory()
    if args.tjax_malloc:
        malloc.relaunch_with_tunables()
    host_malloc = malloc.status()
    facts_start = process_facts()
    if args.threads:
        torch.set_num_threads(args.threads)
    plan, arrays = read_plan(args.dir)
    name = {"hf": "hf", "torch": "torch_compile" if args.compile else "torch"}[args.impl]
    result = {"contender": name, "library": "transformers" if args.impl == "hf" else "torch",
              "dtype": "float32", "timed": not args.check,
              "attention": "sdpa (the library's default)" if args.impl == "hf" else
              "torch.nn.functional.scaled_dot_product_attention", "host_malloc": host_malloc}
    if not args.no_train:
        model = load_model(args.dir, args.impl, plan["shape"])
        result["training"] = train(model, args.impl, args.compile, plan, arrays, args.warmup,
                                   not args.check)
    if args.impl == "torch" and plan["shape"]["kind"] != "gpt":
        parser.error("the plain PyTorch model is a GPT: use --impl hf for a BERT shape")
    if not args.no_decode and plan["shape"]["decode_batches"]:
        # A fresh copy of the initial weights: decoding starts where the others start.
        model = load_model(args.dir, args.impl, plan["shape"])
        result["decoding"] = decode(model, args.impl, args.compile, plan, arrays,
                                    args.decode_repeats, not args.check)
    result.update(process_start=facts_start, process_end=process_facts(), versions=versions(),
                  threads={"torch_num_threads": torch.get_num_threads(),
                           "torch_interop_threads": torch.get_num_interop_threads(),
                           "set_by_harness": args.threads,
                           "parallel_info": torch.__config__.parallel_info().splitlines()[:6]},
                  jax_imported=forbidden_imports("jax"))
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
