"""Input-pipeline throughput: packed LM batches from the default corpus, as the trainer sees them.

    python benchmarks/input_pipeline.py            # prints one JSON object
    python benchmarks/input_pipeline.py --seconds 5

For each configuration (tokenizer x batch x length x packing) it builds the pipeline with
``make_lm_iterator``, discards the first batch (start-up: opening the prepared corpus, starting
threads), then pulls batches for ``--seconds`` (several windows where rows are shuffled: the
refills are in the figure) and reports ``tokens_per_s`` (batch slots ``B * T`` per second,
what a training step consumes) and ``real_tokens_per_s`` (non-padding tokens). The default
model trains at about 9,000 tokens/s on the project's 2-core CPU; the pipeline must stay far
above that. SentencePiece training time is reported separately.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformers_jax.config import SHUFFLE_ROWS  # noqa: E402
from transformers_jax.data.pipeline import make_lm_iterator  # noqa: E402
from transformers_jax.data.sources import open_documents  # noqa: E402
from transformers_jax.data.tokenizers import ByteTokenizer, train_tokenizer  # noqa: E402

TRAINING_TOKENS_PER_S = 9_000  # the default model on the project's 2-core CPU (README)


def measure(
    tokenizer,
    batch: int,
    seq_len: int,
    pack: str,
    seconds: float,
    data_dir: str,
    num_threads: int,
    shuffle_rows: int = 0,
) -> dict:
    start = time.perf_counter()
    it = make_lm_iterator(
        None,
        tokenizer,
        seq_len,
        batch,
        seed=0,
        pack=pack,
        shard=(0, 1),
        data_dir=data_dir,
        num_threads=num_threads,
        shuffle_rows=shuffle_rows,
    )
    next(it)
    first_s = time.perf_counter() - start
    n, real, t0 = 0, 0.0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        b = next(it)
        n += 1
        real += float(b["weights"].sum())
    elapsed = time.perf_counter() - t0
    slots = n * batch * seq_len
    return {
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "batch": batch,
        "seq_len": seq_len,
        "pack": pack,
        "shuffle_rows": shuffle_rows,
        "batches": n,
        "tokens_per_s": round(slots / elapsed),
        "real_tokens_per_s": round(real / elapsed),
        "fill": round(real / slots, 4),
        "x_training_speed": round(slots / elapsed / TRAINING_TOKENS_PER_S, 1),
        "first_batch_s": round(first_s, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per config")
    parser.add_argument("--vocab-size", type=int, default=1024, help="SentencePiece vocabulary")
    parser.add_argument("--threads", type=int, default=2, help="Grain read threads")
    parser.add_argument("--data-dir", default=None, help="prepared-data cache (default: temp)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = args.data_dir or tmp
        t0 = time.perf_counter()
        docs = open_documents(None, "train", data_dir=data_dir)
        prepare_s = time.perf_counter() - t0
        texts = [docs[i].text for i in range(len(docs))]
        t0 = time.perf_counter()
        sp = train_tokenizer("sentencepiece", texts, vocab_size=args.vocab_size)
        sp_train_s = time.perf_counter() - t0

        runs = []
        for tok in (ByteTokenizer(), sp):
            for batch, seq_len in ((16, 128), (64, 512)):
                runs.append(
                    measure(tok, batch, seq_len, "concat", args.seconds, data_dir, args.threads)
                )
        runs.append(
            measure(ByteTokenizer(), 16, 128, "first_fit", args.seconds, data_dir, args.threads)
        )
        runs.append(measure(ByteTokenizer(), 16, 128, "none", args.seconds, data_dir, args.threads))
        for batch, seq_len in ((16, 128), (64, 512)):  # TrainConfig's default for text
            runs.append(
                measure(ByteTokenizer(), batch, seq_len, "concat", args.seconds, data_dir,
                        args.threads, shuffle_rows=SHUFFLE_ROWS)
            )

    result = {
        "benchmark": "input_pipeline",
        "corpus": "default (pydoc topics), train pieces",
        "corpus_bytes": sum(len(t) for t in texts),
        "pieces": len(texts),
        "prepare_s": round(prepare_s, 3),
        "sentencepiece_train_s": round(sp_train_s, 3),
        "threads": args.threads,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "training_tokens_per_s": TRAINING_TOKENS_PER_S,
        "runs": runs,
        "min_x_training_speed": min(r["x_training_speed"] for r in runs),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
