"""``TjaxLM``: a run directory as an lm-evaluation-harness model, registered as ``tjax``
when this module is imported.

    import transformers_jax.harness.model  # registers "tjax"
    lm_eval.simple_evaluate(model="tjax", model_args="run=runs/gpt", tasks=[...])

Every text is read as the run's training text is: ``[bos]`` then the text's ids (the pipeline
starts each document with bos), so a context, a continuation with an empty context and a
rolling document all condition on bos. A (context, continuation) pair is tokenized jointly and
split after the context's own tokens (lm-eval's ``TemplateLM._encode_pair``), so a tokenizer
that merges across the boundary is scored on the tokens it would really produce. Inputs longer
than ``max_length`` lose tokens from the left.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from transformers_jax.harness.scoring import TokenScorer
from transformers_jax.models import family_of
from transformers_jax.runs.load import Run, open_run
from transformers_jax.sample import SamplingConfig, check_generates

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 8
DEFAULT_MAX_GEN_TOKS = 256
# generation settings this adapter reads; any other is named in a warning and ignored
READ_GEN_KWARGS = {"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p"}


def check_scores_text(run: Run) -> None:
    """Refuse a run lm-eval cannot score: a classifier, a masked LM, an encoder-decoder, or a
    run without a tokenizer this project loads."""
    run.refuse_classifier("lm-eval")
    if not run.objective.per_position:
        raise ValueError(
            f"{run.directory} holds a family={run.config.family!r} model trained with the "
            f"{run.objective.name} objective; lm-eval scores models that predict the next "
            "token at every position (family gpt or lstm, the lm objective): evaluate this "
            f"run with tjax eval --run {run.directory} instead")
    if run.tokenizer is None:
        raise ValueError(
            f"{run.directory} has no tokenizer this project can load (converted with an "
            "external tokenizer), and lm-eval tasks are text: convert it again from a "
            "directory that holds tokenizer.json")


def _int_arg(name: str, value, default: int) -> int:
    if value is None or value == "auto":
        return default
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number <= 0 or str(number) != str(value).strip():
        raise ValueError(f"{name}={value!r}: must be a positive integer")
    return number


@register_model("tjax")
class TjaxLM(TemplateLM):
    """A transformers-jax run as an lm-eval model.

    ``run``: the run directory; ``step``: its checkpoint (default the newest intact one);
    ``batch_size``: rows per compiled call ("auto": 8); ``max_length``: the most tokens one
    forward pass reads (default: the learned position table's rows, else the run's
    ``seq_len``); ``max_gen_toks``: generation length when a task gives none; ``seed``:
    sampling randomness (greedy decoding uses none). ``max_batch_size`` and ``device`` (lm-eval
    passes them to every model) are ignored: JAX places the arrays.
    """

    def __init__(self, run: str | Run | None = None, step: int | str | None = None,
                 batch_size: int | str | None = None, max_length: int | str | None = None,
                 max_gen_toks: int | str | None = None, seed: int | str = 0,
                 max_batch_size=None, device=None) -> None:
        super().__init__()
        if run is None:
            raise ValueError("the tjax model needs its run directory: --model_args "
                             "run=RUN_DIR (a tjax train --run-dir or a tjax convert --out)")
        if not isinstance(run, Run):
            if not os.path.isdir(run):
                raise FileNotFoundError(
                    f"no run directory at {run!r}; give the --run-dir of a tjax train "
                    "run or the --out of tjax convert --from-hf")
            run = open_run(run, None if step is None else _int_arg("step", step, 0))
        check_scores_text(run)
        self.run = run
        self.tokenizer_ = run.tokenizer
        config = run.config
        default_length = config.position.max_length(config) or run.train_config.seq_len
        self._max_length = _int_arg("max_length", max_length, default_length)
        table = config.position.max_length(config)
        if table is not None and self._max_length > table:
            raise ValueError(
                f"max_length={self._max_length} is longer than the model's positions "
                f"({config.position.limit_text(config)}); use max_length={table} or less")
        self.max_gen_toks = _int_arg("max_gen_toks", max_gen_toks, DEFAULT_MAX_GEN_TOKS)
        self.seed = int(seed)
        self.scorer = TokenScorer(run.model, run.params, self._max_length,
                                  _int_arg("batch_size", batch_size, DEFAULT_BATCH_SIZE),
                                  run.tokenizer.pad_id)
        self.generation_refusal = generation_refusal(config)

    # what TemplateLM asks of a model ---------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer_.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer_.bos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer_.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs) -> list[int]:
        """The ids of ``string``, after bos unless ``add_special_tokens`` is False."""
        ids = [int(t) for t in self.tokenizer_.encode(string)]
        return ids if add_special_tokens is False else [self.prefix_token_id, *ids]

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer_.decode(list(ids))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs
                              ) -> list[tuple[float, bool]]:
        rows, cut = [], 0
        for (context, continuation), context_enc, continuation_enc in requests:
            if not continuation_enc:
                raise ValueError(f"the continuation {continuation!r} (after the context "
                                 f"{context[-40:]!r}) has no tokens of its own to score")
            if len(continuation_enc) > self.max_length:
                raise ValueError(
                    f"a continuation of {len(continuation_enc)} tokens is longer than "
                    f"max_length={self.max_length}: raise max_length in --model_args")
            tokens = [*context_enc, *continuation_enc]
            cut += len(tokens) > self.max_length + 1
            rows.append((tokens[-(self.max_length + 1):], len(continuation_enc)))
        if cut:
            log.warning("%d of %d requests were longer than max_length=%d tokens: their "
                        "contexts lost tokens from the left", cut, len(rows), self.max_length)
        results = self.scorer.score(rows)
        for ((context, continuation), _, _), result in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", (context, continuation), result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of whole texts, in disjoint windows of ``max_length`` predicted
        tokens, the first one after bos, the last one with a full window of context (lm-eval's
        ``get_rolling_token_windows``)."""
        rows, owner = [], []
        for index, request in enumerate(requests):
            (string,) = request.args
            windows = get_rolling_token_windows(
                token_list=self.tok_encode(string, add_special_tokens=False),
                prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1)
            for context, predicted in map(make_disjoint_window, windows):
                rows.append(([*context, *predicted], len(predicted)))
                owner.append(index)
        totals = [0.0] * len(requests)
        for index, (logp, _) in zip(owner, self.scorer.score(rows), strict=True):
            totals[index] += logp
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continuations through the KV cache, greedy unless a task asks to sample, cut before
        the first ``until`` string (or eos), at most ``max_gen_toks`` tokens."""
        if self.generation_refusal:
            raise ValueError(
                f"{self.run.directory} cannot generate: {self.generation_refusal}; pick tasks "
                "whose output_type is loglikelihood, loglikelihood_rolling or multiple_choice")
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str),
                              []).append(index)
        out = [""] * len(requests)
        for indices in groups.values():
            gen_kwargs = requests[indices[0]].args[1]
            contexts = [requests[i].args[0] for i in indices]
            for i, text in zip(indices, self._generate(contexts, gen_kwargs), strict=True):
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    def _generate(self, contexts: list[str], gen_kwargs: dict) -> list[str]:
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
        ignored = sorted(set(kwargs) - READ_GEN_KWARGS)
        if ignored:
            log.warning("tjax: generation settings %s are not read (greedy or temperature, "
                        "top_k, top_p only)", ", ".join(ignored))
        until = kwargs["until"]
        until = [until] if isinstance(until, str) else list(until or [])
        max_new = int(kwargs["max_gen_toks"])
        room = self.max_length - max_new
        if room < 1:
            raise ValueError(f"max_gen_toks={max_new} leaves no room for a prompt within "
                             f"max_length={self.max_length}: lower max_gen_toks")
        tok = self.tokenizer_
        # a stop string that is one token ends a row inside the compiled loop; longer ones
        # are cut from the text afterwards (the text is the same either way)
        single = {tuple(tok.encode(s)) for s in until if s}
        stops = tuple(sorted({tok.eos_id, *(ids[0] for ids in single if len(ids) == 1
                                            and tok.decode(list(ids)) in until)}))
        sample = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature", 0.0)) > 0
        sampling = SamplingConfig(
            max_new_tokens=max_new, temperature=float(kwargs["temperature"]) if sample else 0.0,
            top_k=int(kwargs["top_k"]) if sample and kwargs.get("top_k") else None,
            top_p=float(kwargs["top_p"]) if sample and kwargs.get("top_p") else None,
            stop_tokens=stops, pad_id=tok.pad_id)
        prompts = [self.tok_encode(c)[-room:] for c in contexts]
        texts = []
        for new in self.scorer.generate(prompts, sampling, self.seed):
            ends = [i for i, t in enumerate(new) if t in stops]
            text = self.tok_decode(new[: ends[0]] if ends else new)
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            texts.append(text)
        return texts


def generation_refusal(config) -> str | None:
    """Why the model cannot continue a prompt with a KV cache (None when it can): lm-eval's
    generation tasks feed it a prompt and read the continuation."""
    if not family_of(config).continues_prompt:
        return f"family={config.family!r} does not continue a prompt"
    try:
        check_generates(config)
    except ValueError as err:
        return str(err)
    return None
