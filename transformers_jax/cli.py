"""``tjax``: the command line. ``tjax train [--model.FIELD=VALUE ...] [--train.FIELD=VALUE ...]``.

Every field of ``ModelConfig`` and ``TrainConfig`` can be overridden as ``--model.position=alibi``;
a switch's own settings as ``--model.position.scaling yarn`` (``--model.mask=sliding_window
--model.mask.window=64``); ``--config FILE.json`` loads both sections first. Short
aliases: ``--data PATH``, ``--steps N``, ``--json``, ``--run-dir DIR``, ``--family NAME``,
``--profile START:STEPS``.
"""

from __future__ import annotations

import json
import os
import shlex
import sys

from transformers_jax.backends import prepare_host
from transformers_jax.compile_cache import use_compile_cache, without_persistent_cache
from transformers_jax.config import ConfigError
from transformers_jax.errors import RunFailedError
from transformers_jax.overrides import CommandParser, closest, int_list, print_json, write_json
from transformers_jax.registry import FAMILIES, UnknownNameError
from transformers_jax.train_options import (  # noqa: F401  (tests and plan read them here)
    build_configs,
    follows_tokenizer,
    model_of_run,
    option_help,
    train_parser,
)


def cmd_train(argv: list[str]) -> int:
    model_cfg, train_cfg = build_configs(argv)
    preset = train_parser().parse(argv)[0].preset
    use_compile_cache()  # every seed and resume of a run compiles the same step
    from transformers_jax.train.loop import train  # imports JAX: after the configs are valid

    final = train(model_cfg, train_cfg, auto_vocab=follows_tokenizer(model_cfg), preset=preset,
                  command=shlex.join(["tjax", "train", *argv]))
    if train_cfg.json:
        print(json.dumps({k: v for k, v in final.items() if k != "history"}, indent=None))
    return 0


def cmd_sample(argv: list[str]) -> int:
    parser = CommandParser("tjax sample", "Sample from a trained or converted run.")
    parser.add_argument("--run", required=True, help="run directory (tjax train --run-dir, or "
                        "tjax convert --out)")
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help=f"tokens to generate (default: {DEFAULT_NEW_TOKENS}, fewer where "
                        "the model's position table ends sooner)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 for greedy")
    parser.add_argument("--top-k", type=int, default=None,
                        help="sample among the k likeliest tokens only")
    parser.add_argument("--top-p", type=float, default=None,
                        help="sample among the likeliest tokens holding this much probability")
    parser.add_argument("--seed", type=int, default=0, help="sampling randomness")
    parser.add_argument("--num-samples", type=int, default=1, help="continuations of the prompt")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")
    args, _, _ = parser.parse(argv)
    use_compile_cache()

    from transformers_jax.models import family_of
    from transformers_jax.runs import open_run
    from transformers_jax.sample import SamplingConfig, check_generates, generate

    run = open_run(args.run, args.step)
    run.refuse_classifier("tjax sample")
    model, params, tokenizer, config = run.model, run.params, run.tokenizer, run.config
    check_generates(config)  # before anything is printed
    if tokenizer is None:
        raise ValueError(
            f"{args.run} has no tokenizer this project can load (converted weights with an "
            "external tokenizer): sample from Python with token ids instead"
        )
    prompt = list(tokenizer.encode(args.prompt))
    max_new_tokens = new_token_budget(config, len(prompt), args.max_new_tokens)
    sampling = SamplingConfig(
        max_new_tokens=max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        stop_tokens=(tokenizer.special["eos"],),
        pad_id=tokenizer.pad_id,
        bos_id=tokenizer.special["bos"],
    )
    # a decoder's sample reads on from the prompt; a seq2seq model's answers it
    shown = (f"source: {args.prompt}\n=> " if family_of(config).generates == "seq2seq"
             else args.prompt)
    if args.num_samples == 1 and tokenizer.unit == "byte":  # stream bytes as they are emitted
        stream = ByteStream(tokenizer)
        sys.stdout.write(shown)
        try:
            generate(model, params, [prompt], sampling, seed=args.seed,
                     on_token=lambda step, tokens, done: stream.push(int(tokens[0])))
        finally:  # an error then starts on a line of its own
            stream.flush()
            sys.stdout.write("\n")
            sys.stdout.flush()
        return 0
    outputs = generate(model, params, [prompt] * args.num_samples, sampling, seed=args.seed)
    if args.num_samples == 1:
        print(f"{shown}{tokenizer.decode(outputs[0])}")
        return 0
    for i, out in enumerate(outputs):
        print(f"--- sample {i + 1} ---\n{shown}{tokenizer.decode(out)}")
    return 0


DEFAULT_NEW_TOKENS = 200


def new_token_budget(config, prompt_len: int, asked: int | None) -> int:
    """``--max-new-tokens``, checked against the model's positions before anything is
    printed: the default is capped (with a note), an explicit count that cannot fit is an
    error naming the most that can."""
    from transformers_jax.sample import room_for_new_tokens

    if asked is not None and asked <= 0:
        raise ValueError(f"--max-new-tokens {asked}: must be a positive integer")
    room = room_for_new_tokens(config, prompt_len)
    if room is not None and room <= 0:
        raise ValueError(f"the prompt is {prompt_len} tokens, which fills the model's "
                         f"{config.position.max_length(config)} positions "
                         f"(position={config.position.name}); shorten --prompt")
    if room is None or room >= (asked or DEFAULT_NEW_TOKENS):
        return asked or DEFAULT_NEW_TOKENS
    if asked is not None:
        raise ValueError(f"--max-new-tokens {asked}: the model has room for {room} after this "
                         f"{prompt_len}-token prompt (position={config.position.name}, "
                         f"{config.position.max_length(config)} positions); use "
                         f"--max-new-tokens {room} or less")
    print(f"tjax sample: note: generating {room} tokens, all the model's "
          f"{config.position.max_length(config)} positions leave after the prompt "
          f"(position={config.position.name})", file=sys.stderr)
    return room


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
    parser = CommandParser("tjax fill-mask", "Top predictions for each [MASK] of a text.")
    parser.add_argument("--run", required=True, help="run directory of a --family bert run")
    parser.add_argument("--text", required=True, help='e.g. "The [MASK] statement"')
    parser.add_argument("--top-k", type=int, default=5, help="predictions shown per [MASK]")
    args, _, _ = parser.parse(argv)
    use_compile_cache()

    from transformers_jax.models.bert import fill_mask
    from transformers_jax.runs import open_run

    run = open_run(args.run)
    run.refuse_classifier("tjax fill-mask")
    model, params, tokenizer, config = run.model, run.params, run.tokenizer, run.config
    if not FAMILIES.get(config.family).fills_masks:
        raise ValueError(f"{args.run} holds a {config.family!r} model; fill-mask needs a masked "
                         "LM (train with --family bert)")
    for i, options in enumerate(fill_mask(model, params, tokenizer, args.text, args.top_k)):
        shown = ", ".join(f"{o['token']!r} {o['score']:.3f}" for o in options)
        print(f"[MASK] {i + 1}: {shown}")
    return 0


def cmd_eval(argv: list[str]) -> int:
    parser = CommandParser(
        "tjax eval",
        "Evaluate a trained or converted run: held-out loss, perplexity, bits per "
        "byte (or per token), the loss at several lengths and by position, and passkey "
        "retrieval; or lm-eval-harness tasks (--lm-eval). Prints a summary (--json: one JSON "
        "object with every figure).")
    parser.add_argument("--run", required=True, help="run directory (tjax train --run-dir, or "
                        "tjax convert --out)")
    parser.add_argument("--data", default=None, help="text to evaluate on (PATH, lines:PATH, "
                        "tfds:NAME; local text is read whole); default: the run's own held-out "
                        "split")
    parser.add_argument("--split", default=None, help="a tfds split to read instead of the "
                        "held-out one (e.g. validation)")
    parser.add_argument("--lengths", type=int_list, default=None,
                        help="window lengths, e.g. 128,256 (default: the run's seq_len)")
    parser.add_argument("--batches", type=int, default=None,
                        help="batches per length (default: the run's eval_batches)")
    parser.add_argument("--passkey", action="store_true",
                        help="passkey retrieval accuracy by length and depth (generating "
                        "families)")
    parser.add_argument("--passkey-lengths", type=int_list, default=None,
                        help="prompt lengths of the passkey test (default: --lengths; the byte "
                        "tokenizer needs at least about 110)")
    parser.add_argument("--passkey-trials", type=int, default=4,
                        help="keys per length and depth")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")
    parser.add_argument("--plot", default=None, help="PNG of the loss by position (default: "
                        "RUN/eval_loss_by_position.png)")
    parser.add_argument("--json", action="store_true",
                        help="print every figure as one JSON object (default: a summary)")
    parser.add_argument("--out", default=None, help="also write the JSON to this file")
    lm_eval = parser.add_argument_group(
        "lm-eval tasks (the lm-eval extra; the options above are for held-out loss)")
    lm_eval.add_argument("--lm-eval", default=None, metavar="TASKS",
                         help="score the run on lm-evaluation-harness tasks, e.g. "
                         "hellaswag,arc_easy or tasks of your own (--include-path)")
    lm_eval.add_argument("--include-path", default=None,
                         help="a folder of lm-eval task YAML files")
    lm_eval.add_argument("--limit", type=float, default=None,
                         help="documents per task (below 1: a fraction of them)")
    lm_eval.add_argument("--num-fewshot", type=int, default=None,
                         help="examples in each prompt (default: each task's own)")
    lm_eval.add_argument("--batch-size", type=int, default=None,
                         help="rows per compiled call (default 8)")
    lm_eval.add_argument("--max-length", type=int, default=None,
                         help="tokens one forward pass reads (default: the run's seq_len, or "
                         "its learned position table)")
    lm_eval.add_argument("--max-gen-toks", type=int, default=None,
                         help="tokens generated when a task sets no limit (default 256)")
    args, _, _ = parser.parse(argv)
    if args.lm_eval is not None:
        return _eval_lm_eval(args, argv)
    harness_only = [o for o in ("--include-path", "--limit", "--num-fewshot", "--batch-size",
                                "--max-length", "--max-gen-toks")
                    if getattr(args, o[2:].replace("-", "_")) is not None]
    if harness_only:
        raise ValueError(f"{', '.join(harness_only)} apply to lm-eval tasks: add --lm-eval "
                         "TASKS, or drop them")
    if args.batches is not None and args.batches <= 0:
        raise ValueError(f"--batches {args.batches}: must be a positive integer")
    if args.passkey_trials <= 0:
        raise ValueError(f"--passkey-trials {args.passkey_trials}: must be a positive integer")
    if args.out:  # before the evaluation, so a bad path does not lose its result
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    use_compile_cache()

    from transformers_jax.evaluation import evaluate_run

    result = evaluate_run(
        args.run, data=args.data, split=args.split, lengths=args.lengths, batches=args.batches,
        passkey=args.passkey, passkey_lengths=args.passkey_lengths,
        passkey_trials=args.passkey_trials, step=args.step,
        plot=args.plot or os.path.join(args.run, "eval_loss_by_position.png"))
    _print_eval(result, args)
    return 0


def _print_eval(result: dict, args) -> None:
    """``tjax eval``'s result: a summary, or the JSON with ``--json``; ``--out`` gets the JSON
    either way."""
    if args.json:
        print_json(result, args.out)
        return
    from transformers_jax.eval_summary import summary

    print(summary(result))
    if args.out:
        write_json(result, args.out)


def _eval_lm_eval(args, argv: list[str]) -> int:
    """``tjax eval --lm-eval TASKS``: the run scored on lm-eval tasks (``harness/tasks.py``)."""
    refused = [o for o in ("--data", "--split", "--lengths", "--batches", "--passkey",
                           "--passkey-lengths", "--plot")
               if any(a.partition("=")[0] == o for a in argv)]
    if refused:
        raise ValueError(f"{', '.join(refused)} apply to the held-out loss, not to --lm-eval "
                         "tasks: drop them (or run tjax eval twice)")
    for name in ("limit", "num_fewshot", "batch_size", "max_length", "max_gen_toks"):
        value = getattr(args, name)
        if value is not None and not (value > 0 or (name == "num_fewshot" and value == 0)):
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be a positive number"
                             + (" or 0" if name == "num_fewshot" else ""))
    if args.limit is not None and args.limit >= 1 and args.limit != int(args.limit):
        raise ValueError(f"--limit {args.limit}: a count of documents (a whole number) or a "
                         "fraction below 1")
    if args.out:  # before the evaluation, so a bad path does not lose its result
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    use_compile_cache()

    from transformers_jax.harness.tasks import evaluate_tasks

    tasks = [t.strip() for t in args.lm_eval.split(",") if t.strip()]
    limit = None if args.limit is None else (args.limit if args.limit < 1 else int(args.limit))
    result = evaluate_tasks(
        args.run, tasks, include_path=args.include_path, limit=limit,
        num_fewshot=args.num_fewshot, batch_size=args.batch_size, max_length=args.max_length,
        max_gen_toks=args.max_gen_toks, step=args.step)
    _print_eval(result, args)
    return 0


def cmd_convert(argv: list[str]) -> int:
    from transformers_jax.convert import main as convert_main

    return convert_main(argv)


def cmd_merge(argv: list[str]) -> int:
    parser = CommandParser(
        "tjax merge", "Fold a LoRA run's adapters (--train.lora.rank) into its base model and "
        "write the result as a plain run directory, which tjax sample, eval and convert "
        "--to-hf read like any other.")
    parser.add_argument("--run", required=True, help="the LoRA run directory")
    parser.add_argument("--out", required=True, help="the new run directory")
    parser.add_argument("--overwrite", action="store_true", help="replace --out's checkpoints")
    args, _, _ = parser.parse(argv)
    from transformers_jax.convert.merge import merge_lora_run

    print(merge_lora_run(args.run, args.out, overwrite=args.overwrite))
    return 0


def cmd_presets(argv: list[str]) -> int:
    parser = CommandParser(
        "tjax presets", "Named models: published architectures with their exact parameter "
        "counts, and a few CPU-sized ones. Use one with 'tjax train --preset NAME' or 'tjax "
        "bench --preset NAME' (--model.FIELD=VALUE applies on top) or ModelConfig.preset(NAME).")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON list (name, family, params, published, hf_class, "
                        "source, notes, cpu, model fields)")
    args, _, _ = parser.parse(argv)
    from transformers_jax.presets import PRESETS, presets_table

    if args.json:
        print(json.dumps([p.summary() for p in PRESETS.values()]))
    else:
        print(presets_table())
    return 0


def cmd_corpus(argv: list[str]) -> int:
    parser = CommandParser(
        "tjax corpus", "Fetch and prepare a research corpus: 'linux-source' is the kernel tree "
        "of Debian's linux-source-6.1 package (its Documentation/ prose and its C source), "
        "pinned by sha256, split by file with duplicates removed across the splits; read it "
        "with --data tfds:tjax_linux_source/CONFIG. Prints the manifest (bytes and files per "
        "split, duplicates removed, held_out_overlap, sha256s) as JSON.")
    parser.add_argument("corpus", choices=["linux-source"], help="which corpus")
    parser.add_argument("--config", default="docs,c,all",
                        help="configs to prepare, comma-separated: docs, c, all (both)")
    parser.add_argument("--data-dir", default=None, help="where the tfds dataset goes (default "
                        "$TJAX_DATA_DIR or ~/.cache/transformers_jax/datasets)")
    parser.add_argument("--deb", default=None, help="a linux-source-6.1 .deb you already have "
                        "(machines without Debian's apt); default: apt-get download")
    parser.add_argument("--tarball", default=None,
                        help="the kernel tree's tar.xz itself (usr/src/linux-source-6.1.tar.xz "
                        "of the package, or another 6.1 tree with --sha256)")
    parser.add_argument("--sha256", default=None,
                        help="accept this sha256 of --deb/--tarball instead of the pinned one")
    parser.add_argument("--version", default=None, help="the package version to download "
                        "(default: the pinned one; another needs --sha256)")
    args, _, _ = parser.parse(argv)
    from transformers_jax.data import linux_source

    result = {}
    for config in [c.strip() for c in args.config.split(",") if c.strip()]:
        result[config] = linux_source.prepare(
            config, args.data_dir, deb=args.deb, tarball=args.tarball, sha256=args.sha256,
            version=args.version or linux_source.VERSION)
    print_json(result, indent=1)
    return 0


def cmd_tokenizer(argv: list[str]) -> int:
    parser = CommandParser(
        "tjax tokenizer", "Train a Hugging Face tokenizer on your text with the tokenizers "
        "library: byte-level BPE (default) or unigram, lossless on any text, with the special "
        "tokens <pad> <s> </s> [MASK]. Writes one tokenizer.json; train a model with it by "
        "'tjax train --train.tokenizer=hf:FILE'. Prints a JSON summary.")
    parser.add_argument("action", choices=["train"], help="what to do (train: a new tokenizer)")
    parser.add_argument("--data", default=None, help="text to train on, as for tjax train: "
                        "PATH (file, folder or glob), lines:PATH, tfds:NAME (default: the "
                        "built-in corpus)")
    parser.add_argument("--vocab", type=int, default=8192,
                        help="vocabulary size, special tokens and the 256 byte symbols included")
    parser.add_argument("--model", choices=["bpe", "unigram"], default="bpe",
                        help="the tokenizer model")
    parser.add_argument("--out", required=True,
                        help="the tokenizer.json to write (a folder: FOLDER/tokenizer.json)")
    parser.add_argument("--data-dir", default=None, help="tfds data_dir (as --train.data_dir)")
    parser.add_argument("--text-key", default=None, help="tfds text feature (as "
                        "--train.text_key; auto-detected)")
    parser.add_argument("--val-fraction", type=float, default=0.05,
                        help="share of the text held out, as tjax train holds it out (never "
                        "trained on)")
    parser.add_argument("--max-bytes", type=int, default=100_000_000,
                        help="read at most about this much text, evenly spaced over the data")
    args, _, _ = parser.parse(argv)
    if args.max_bytes <= 0:
        raise ValueError(f"--max-bytes {args.max_bytes}: must be a positive integer")
    out = args.out
    if not out:
        raise ValueError("--out: give the tokenizer.json to write")
    if os.path.isdir(out) or out.endswith(os.sep):
        out = os.path.join(out, "tokenizer.json")
    from transformers_jax.data.hf_tokenizer import HFJsonTokenizer, train_hf_tokenizer
    from transformers_jax.data.pipeline import training_texts

    texts = training_texts(args.data, args.max_bytes, data_dir=args.data_dir,
                           text_key=args.text_key, val_fraction=args.val_fraction)
    trained = train_hf_tokenizer(texts, args.vocab, args.model, length=len(texts))
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            f.write(trained.to_str(pretty=True))
    except OSError as err:
        raise ValueError(f"--out {args.out}: cannot write it ({err.strerror or err})") from None
    tok = HFJsonTokenizer.from_path(out)  # what --train.tokenizer=hf:OUT will read
    print_json({"out": out, "model": args.model, "vocab_size": tok.vocab_size,
                "special": tok.special, "pieces": len(texts),
                "bytes": sum(len(t) for t in texts),
                "use": f"tjax train --train.tokenizer=hf:{out}"}, indent=1)
    return 0


def cmd_bench(argv: list[str]) -> int:
    from transformers_jax.bench import main as bench_main

    return bench_main(argv)


def cmd_sweep(argv: list[str]) -> int:
    from transformers_jax.sweep.command import main as sweep_main

    use_compile_cache()  # every seed of a cell compiles the same step
    return sweep_main(argv)


def cmd_plan(argv: list[str]) -> int:
    from transformers_jax.plan import main as plan_main

    # The config is read by build_configs, as for tjax train (--preset, --model.*, --train.*);
    # its programs are for a TPU or GPU, which this process could not load from a cache
    with without_persistent_cache():
        return plan_main(argv, build_configs)


COMMANDS = {"train": cmd_train, "sample": cmd_sample, "bench": cmd_bench, "eval": cmd_eval,
            "convert": cmd_convert, "fill-mask": cmd_fill_mask, "presets": cmd_presets,
            "plan": cmd_plan, "sweep": cmd_sweep, "corpus": cmd_corpus,
            "tokenizer": cmd_tokenizer, "merge": cmd_merge}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = CommandParser(
        "tjax", "Train and study transformers in JAX. Run 'tjax train' to train a small GPT on "
        "the built-in corpus; 'tjax COMMAND --help' lists every option of a command.")
    parser.add_argument("command", choices=sorted(COMMANDS), help="what to do")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        near = closest(command, COMMANDS)
        parser.error(f"unknown command {command!r}" + (f"; did you mean {near!r}?" if near
                                                       else f"; choose from {sorted(COMMANDS)}"))
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


def entry() -> int:
    """The ``tjax`` console script: ``main`` in a process set up for the platform it computes
    on (``backends.prepare_host``: on a CPU host, re-executed once with the malloc setting).
    Tests call ``main`` in their own process instead."""
    if sys.argv[1:] and not {"-h", "--help"} & set(sys.argv[1:]):
        try:
            prepare_host()
        except ValueError as err:
            print(f"tjax: error: {err}", file=sys.stderr)
            return 2
    return main()


if __name__ == "__main__":
    sys.exit(entry())
