"""``tjax``: the command line. ``tjax train [--model.FIELD=VALUE ...] [--train.FIELD=VALUE ...]``.

Every field of ``ModelConfig`` and ``TrainConfig`` can be overridden as ``--model.position=alibi``;
a switch's own settings as ``--model.position.scaling yarn`` (``--model.mask=sliding_window
--model.mask.window=64``); ``--config FILE.json`` loads both sections first. Short
aliases: ``--data PATH``, ``--steps N``, ``--json``, ``--run-dir DIR``, ``--family NAME``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from transformers_jax.config import (
    ConfigError,
    ModelConfig,
    TrainConfig,
    apply_overrides,
    from_dict,
)
from transformers_jax.overrides import ALIASES, FLAGS, parse_overrides
from transformers_jax.registry import FAMILIES, UnknownNameError
from transformers_jax.train.errors import RunFailedError


def build_configs(argv: list[str]) -> tuple[ModelConfig, TrainConfig]:
    overrides, config_file = parse_overrides(argv)
    base: dict[str, Any] = {}
    if config_file:
        with open(config_file) as f:
            base = json.load(f)
    model_cfg = from_dict(ModelConfig, base.get("model", {}))
    train_cfg = from_dict(TrainConfig, base.get("train", {}))
    sections = {"model": {}, "train": {}}
    for key, value in overrides.items():
        section, _, rest = key.partition(".")
        sections[section][rest] = value
    family = FAMILIES.get(sections["model"].get("family", model_cfg.family))
    if "mask" not in sections["model"] and "mask" not in base.get("model", {}):
        sections["model"]["mask"] = family.default_mask  # e.g. bert: bidirectional
    model_cfg = apply_overrides(model_cfg, sections["model"], "model.")
    train_cfg = apply_overrides(train_cfg, sections["train"], "train.")
    return model_cfg, train_cfg


def cmd_train(argv: list[str]) -> int:
    model_cfg, train_cfg = build_configs(argv)
    from transformers_jax.loop import train  # imports JAX: after the configs are valid

    # The vocabulary follows the tokenizer unless given explicitly.
    explicit = model_cfg.vocab_size != ModelConfig().vocab_size
    final = train(model_cfg, train_cfg, auto_vocab=not explicit)
    if train_cfg.json:
        print(json.dumps({k: v for k, v in final.items() if k != "history"}, indent=None))
    return 0


def cmd_sample(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tjax sample", description="Sample from a trained run.")
    parser.add_argument("--run", required=True, help="run directory written by tjax train")
    parser.add_argument("--prompt", default="\n", help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 for greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")
    args = parser.parse_args(argv)

    from transformers_jax.runs import load_run
    from transformers_jax.sample import SamplingConfig, generate

    model, params, tokenizer, _ = load_run(args.run, args.step)
    if tokenizer is None:
        raise ValueError(
            f"{args.run} has no tokenizer this project can load (converted weights with an "
            "external tokenizer): sample from Python with token ids instead"
        )
    sampling = SamplingConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        stop_tokens=(tokenizer.special["eos"],),
        pad_id=tokenizer.pad_id,
        bos_id=tokenizer.special["bos"],
    )
    prompt = list(tokenizer.encode(args.prompt))
    if args.num_samples == 1 and tokenizer.unit == "byte":  # stream bytes as they are emitted
        stream = ByteStream(tokenizer)
        sys.stdout.write(args.prompt)
        generate(model, params, [prompt], sampling, seed=args.seed,
                 on_token=lambda step, tokens, done: stream.push(int(tokens[0])))
        stream.flush()
        sys.stdout.write("\n")
        return 0
    outputs = generate(model, params, [prompt] * args.num_samples, sampling, seed=args.seed)
    if args.num_samples == 1:
        print(f"{args.prompt}{tokenizer.decode(outputs[0])}")
        return 0
    for i, out in enumerate(outputs):
        print(f"--- sample {i + 1} ---\n{args.prompt}{tokenizer.decode(out)}")
    return 0


class ByteStream:
    """Writes byte tokens to stdout as soon as they form whole UTF-8 characters."""

    def __init__(self, tokenizer) -> None:
        import codecs

        self.tokenizer = tokenizer
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> None:
        if 0 <= token < 256:
            sys.stdout.write(self.decoder.decode(bytes([token])))
            sys.stdout.flush()

    def flush(self) -> None:
        sys.stdout.write(self.decoder.decode(b"", final=True))
        sys.stdout.flush()


def cmd_fill_mask(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tjax fill-mask",
                                     description="Top predictions for each [MASK] of a text.")
    parser.add_argument("--run", required=True, help="run directory of a --family bert run")
    parser.add_argument("--text", required=True, help='e.g. "The [MASK] statement"')
    parser.add_argument("--top-k", type=int, default=5)
    args = parser.parse_args(argv)

    from transformers_jax.models.bert import fill_mask
    from transformers_jax.runs import load_run

    model, params, tokenizer, config = load_run(args.run)
    if not FAMILIES.get(config.family).fills_masks:
        raise ValueError(f"{args.run} holds a {config.family!r} model; fill-mask needs a masked "
                         "LM (train with --family bert)")
    for i, options in enumerate(fill_mask(model, params, tokenizer, args.text, args.top_k)):
        shown = ", ".join(f"{o['token']!r} {o['score']:.3f}" for o in options)
        print(f"[MASK] {i + 1}: {shown}")
    return 0


def _lengths(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected lengths like 128,256") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one length, e.g. 128,256")
    return values


def cmd_eval(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tjax eval",
        description="Evaluate a trained or converted run: held-out loss, perplexity, bits per "
        "byte (or per token), the loss at several lengths and by position, and passkey "
        "retrieval. Prints one JSON object.")
    parser.add_argument("--run", required=True, help="run directory (tjax train --run-dir, or "
                        "tjax convert --out)")
    parser.add_argument("--data", default=None, help="text to evaluate on (PATH, lines:PATH, "
                        "tfds:NAME); default: the run's own held-out split")
    parser.add_argument("--split", default=None, help="a tfds split to read instead of the "
                        "held-out one (e.g. validation)")
    parser.add_argument("--lengths", type=_lengths, default=None,
                        help="window lengths, e.g. 128,256 (default: the run's seq_len)")
    parser.add_argument("--batches", type=int, default=None,
                        help="batches per length (default: the run's eval_batches)")
    parser.add_argument("--passkey", action="store_true",
                        help="passkey retrieval accuracy by length and depth (generating "
                        "families)")
    parser.add_argument("--passkey-lengths", type=_lengths, default=None,
                        help="prompt lengths of the passkey test (default: --lengths; the byte "
                        "tokenizer needs at least about 110)")
    parser.add_argument("--passkey-trials", type=int, default=4, help="keys per length and depth")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")
    parser.add_argument("--plot", default=None, help="PNG of the loss by position (default: "
                        "RUN/eval_loss_by_position.png)")
    parser.add_argument("--out", default=None, help="also write the JSON to this file")
    args = parser.parse_args(argv)
    if args.batches is not None and args.batches <= 0:
        raise ValueError(f"--batches {args.batches}: must be a positive integer")

    from transformers_jax.evaluation import evaluate_run

    result = evaluate_run(
        args.run, data=args.data, split=args.split, lengths=args.lengths, batches=args.batches,
        passkey=args.passkey, passkey_lengths=args.passkey_lengths,
        passkey_trials=args.passkey_trials, step=args.step,
        plot=args.plot or os.path.join(args.run, "eval_loss_by_position.png"))
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


def cmd_convert(argv: list[str]) -> int:
    from transformers_jax.convert import main as convert_main

    return convert_main(argv)


def cmd_bench(argv: list[str]) -> int:
    from transformers_jax.bench import main as bench_main

    return bench_main(argv)


def cmd_plan(argv: list[str]) -> int:
    from transformers_jax.plan import main as plan_main

    # The config is read by build_configs, as for tjax train: a --preset NAME option plugs in
    # there (once presets land) and tjax plan takes it with no change here.
    return plan_main(argv, build_configs)


COMMANDS = {"train": cmd_train, "sample": cmd_sample, "bench": cmd_bench, "eval": cmd_eval,
            "convert": cmd_convert, "fill-mask": cmd_fill_mask, "plan": cmd_plan}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="tjax",
        description="Train and study transformers in JAX. Run 'tjax train' to train a small "
        "GPT on the built-in corpus; 'tjax train --help' lists every option.",
    )
    parser.add_argument("command", choices=sorted(COMMANDS))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        parser.parse_args([command])  # prints the usage error and exits 2
    if command == "train" and rest and rest[0] in ("-h", "--help"):
        print(option_help())
        return 0
    try:
        return COMMANDS[command](rest)
    except (ConfigError, UnknownNameError, FileNotFoundError, FileExistsError, ValueError) as err:
        if os.environ.get("TJAX_DEBUG"):
            raise
        print(f"tjax {command}: error: {err}", file=sys.stderr)
        return 2
    except RunFailedError as err:  # the run was set up well and stopped: diverged, locked, ...
        if os.environ.get("TJAX_DEBUG"):
            raise
        print(f"tjax {command}: error: {err}", file=sys.stderr)
        return 1


def option_help() -> str:
    import dataclasses

    def settings(switch_cls) -> str:
        return " ".join(f"--model.{{field}}.{f.name}={f.default}" for f in
                        dataclasses.fields(switch_cls) if f.init)

    lines = ["tjax train options (defaults shown):", ""]
    for section, cls in (("model", ModelConfig), ("train", TrainConfig)):
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            registry = f.metadata.get("registry")
            if registry is None:
                lines.append(f"  --{section}.{f.name}={default}")
                continue
            # a switch: its entries, and the settings each one takes
            lines.append(f"  --{section}.{f.name}={default}  ({', '.join(registry.names())})")
            for name, entry in registry.items():
                own = settings(entry).replace("{field}", f.name)
                if own:
                    lines.append(f"      {f.name}={name}: {own}")
    lines += ["", "aliases: " + ", ".join([*ALIASES, *FLAGS, "--config FILE.json"])]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
