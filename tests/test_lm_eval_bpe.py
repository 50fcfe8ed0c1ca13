"""The lm-eval adapter on a run with a trained BPE tokenizer (``sentencepiece_bpe``), where a
context and its continuation tokenized together are not the two tokenized apart: the
log-likelihood is minus the run's own eval-step loss on the continuation's tokens of the joint
encoding (lm-eval's ``TemplateLM._encode_pair``: encode ``context + continuation``, keep what
follows the context's own tokens), not on the continuation tokenized alone."""

import jax
import numpy as np
import pytest

pytest.importorskip("lm_eval")

from transformers_jax import ModelConfig, TrainConfig  # noqa: E402
from transformers_jax.harness.model import TjaxLM  # noqa: E402
from transformers_jax.learning.step import make_eval_step  # noqa: E402
from transformers_jax.runs.load import open_run  # noqa: E402
from transformers_jax.train.loop import train  # noqa: E402

SENTENCES = [
    "the cat sat on the mat", "the dog sat on the log", "a cat ran to the park",
    "the dogs ran in the park", "cats and dogs sat together", "the mat was on the floor",
]  # fmt: skip
# (context, continuation): split inside a word, so BPE merges across the boundary, or after
# a space, which lm-eval moves to the continuation
PAIRS = [
    ("the ca", "t sat on the mat"), ("the do", "gs ran in the park"), ("a cat ra", "n to the park"),
    ("the mat was on the fl", "oor"), ("cats and ", "dogs sat"), ("the", " cat sat"),
]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_bpe")
    text = root / "text.txt"
    rng = np.random.default_rng(0)
    text.write_text("\n".join(SENTENCES[i] + "." for i in rng.integers(0, 6, 1500)) + "\n")
    train(ModelConfig(d_model=32, n_layers=1, n_heads=2, max_len=64),
          TrainConfig(data=str(text), tokenizer="sentencepiece_bpe", tokenizer_vocab=300,
                      steps=8, batch_size=4, seq_len=32, warmup_steps=1, log_every=4,
                      eval_every=8, eval_batches=1, progress=False, run_dir=str(root / "run"),
                      tensorboard=False),
          auto_vocab=True)  # fmt: skip
    return open_run(str(root / "run"))


@pytest.mark.slow
def test_the_run_merges_pieces_across_the_boundary(run):
    assert run.train_config.tokenizer == "sentencepiece_bpe"
    encode = run.tokenizer.encode
    merged = [(c, x) for c, x in PAIRS
              if list(encode(c + x)) != [*encode(c), *encode(x)]]  # fmt: skip
    assert len(merged) >= 3, "no pair tokenizes differently together: the test tests nothing"


@pytest.mark.slow
def test_loglikelihood_scores_the_jointly_tokenized_continuation(run):
    step = jax.jit(make_eval_step(run.model, run.objective))
    encode, bos = run.tokenizer.encode, run.tokenizer.bos_id

    def own_logp(tokens: list[int], n: int) -> float:
        """Minus the eval step's summed loss of the last ``n`` of ``tokens``."""
        x = np.asarray(tokens, np.int32)[None]
        weights = np.zeros((1, x.shape[1] - 1), np.float32)
        weights[0, -n:] = 1
        metrics = jax.device_get(step(run.params, {"inputs": x[:, :-1], "targets": x[:, 1:],
                                                    "weights": weights}))  # fmt: skip
        return -float(metrics["loss"]) * n

    got = TjaxLM(run, batch_size=4).loglikelihood(
        [type("Request", (), {"args": pair})() for pair in PAIRS]
    )
    apart = []
    for (context, continuation), (logp, _) in zip(PAIRS, got, strict=True):
        spaces = len(context) - len(context.rstrip())  # trailing spaces move on (lm-eval)
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        ctx = [int(t) for t in encode(context)]
        joint = [int(t) for t in encode(context + continuation)][len(ctx) :]
        assert joint, (context, continuation)
        want = own_logp([bos, *ctx, *joint], len(joint))
        assert logp == pytest.approx(want, rel=1e-5, abs=1e-4), (context, continuation)
        alone = [int(t) for t in encode(continuation)]
        if alone != joint:
            apart.append(abs(logp - own_logp([bos, *ctx, *alone], len(alone))))
    # scored apart, the merged pairs would give other numbers: the joint encoding is what counts
    assert len(apart) >= 3 and min(apart) > 1e-2, apart


@pytest.mark.slow
def test_a_continuation_merged_into_the_context_is_refused(run):
    """The piece "ran": "n" after "a cat ra" leaves no token of its own (lm-eval would
    score nothing), and the error names the pair."""
    encode = run.tokenizer.encode
    context, continuation = "a cat ra", "n"
    assert len(encode(context + continuation)) <= len(encode(context))
    with pytest.raises(ValueError, match="the continuation 'n' .*'a cat ra'.* no tokens"):
        TjaxLM(run).loglikelihood([type("Request", (), {"args": (context, continuation)})()])
