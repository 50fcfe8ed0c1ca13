"""``evaluate_tasks``: a run scored on lm-eval tasks, what ``tjax eval --lm-eval`` runs.

    evaluate_tasks("runs/gpt", ["my_task"], include_path="my_tasks/", limit=100)

Tasks are lm-eval's own (downloaded from the Hugging Face hub on first use) or YAML files
under ``include_path`` (lm-eval's ``--include_path``), whose ``dataset_path: json`` with
``dataset_kwargs: {data_files: ...}`` reads local JSONL without the network.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.util
import os
from collections.abc import Sequence
from unittest import mock

INSTALL = "pip install 'transformers-jax[lm-eval]'"


def require_lm_eval() -> None:
    """Raise ``ValueError`` naming the extra to install when lm-eval is not installed."""
    if importlib.util.find_spec("lm_eval") is None:
        raise ValueError(f"--lm-eval needs the lm-eval package, which is not installed: {INSTALL}")


def check_tasks(task_manager, tasks: Sequence[str]) -> list[str]:
    """The task names, each a task, group or tag lm-eval knows (a glob matching some, or a
    YAML file); ``ValueError`` naming an unknown one and the nearest known names."""
    if not tasks:
        raise ValueError("--lm-eval: name at least one task (e.g. --lm-eval hellaswag)")
    known = task_manager.all_tasks
    for name in tasks:
        if name in known or os.path.isfile(name) or task_manager.match_tasks([name]):
            continue
        near = difflib.get_close_matches(name, known, n=3)
        hint = f"did you mean {', '.join(near)}? " if near else ""
        raise ValueError(
            f"--lm-eval: unknown task {name!r}; {hint}lm-eval knows {len(known)} tasks, "
            "groups and tags (lm-eval ls tasks lists them); a task of your own is a YAML file "
            "in a folder given with --include-path")
    return list(tasks)


def task_manager(include_path: str | None = None):
    """lm-eval's ``TaskManager`` over its own tasks and ``include_path``'s, built once per
    process for the same folder contents: indexing lm-eval's catalogue (thousands of YAML
    files) takes seconds, so a notebook that scores several runs pays it once. A YAML file
    added or edited under ``include_path`` builds a new one."""
    return _task_manager(include_path, _yaml_files(include_path))


def _yaml_files(folder: str | None) -> tuple:
    if folder is None:
        return ()
    found = []
    for root, _, names in os.walk(folder):
        for name in names:
            if name.endswith((".yaml", ".yml")):
                path = os.path.join(root, name)
                found.append((path, os.stat(path).st_mtime_ns))
    return tuple(sorted(found))


@functools.lru_cache(maxsize=4)
def _task_manager(include_path: str | None, yaml_files: tuple):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


task_manager.cache_clear = _task_manager.cache_clear  # (tests start from an empty cache)


@contextlib.contextmanager
def _without_git_lookup():
    """lm-eval records the git commit of the working directory by running ``git``, which prints
    ``fatal: not a git repository`` outside a checkout; ``evaluate_tasks`` returns fields of
    its own, not that one, so the lookup is skipped."""
    import lm_eval.evaluator

    if not hasattr(lm_eval.evaluator, "get_git_commit_hash"):  # another lm-eval version
        yield
        return
    with mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", lambda: None):
        yield


def evaluate_tasks(
    run_dir: str,
    tasks: Sequence[str],
    *,
    include_path: str | None = None,
    limit: float | None = None,
    num_fewshot: int | None = None,
    batch_size: int | None = None,
    max_length: int | None = None,
    max_gen_toks: int | None = None,
    step: int | None = None,
    seed: int = 0,
) -> dict:
    """Score ``run_dir`` on lm-eval ``tasks``; returns one JSON-ready dict: lm-eval's results
    by task (``results``: ``acc,none`` and the like, with their standard errors), the few-shot
    counts, task versions and sample counts.

    ``limit``: documents per task (a fraction below 1); ``num_fewshot``: examples in each
    prompt (default: each task's own); ``batch_size``, ``max_length``, ``max_gen_toks``,
    ``step``, ``seed``: as ``TjaxLM``'s arguments.
    """
    require_lm_eval()
    if include_path is not None and not os.path.isdir(include_path):
        raise FileNotFoundError(f"--include-path {include_path}: no such folder (it holds "
                                "task YAML files)")
    import lm_eval

    from transformers_jax.data.hub_offline import offline_unless_reachable
    from transformers_jax.harness.model import TjaxLM

    lm = TjaxLM(run_dir, step=step, batch_size=batch_size, max_length=max_length,
                max_gen_toks=max_gen_toks, seed=seed)
    manager = task_manager(include_path)
    names = check_tasks(manager, tasks)
    offline = offline_unless_reachable()  # an uncached task then fails at once
    try:
        with _without_git_lookup():
            results = lm_eval.simple_evaluate(
                model=lm, tasks=names, task_manager=manager, limit=limit,
                num_fewshot=num_fewshot, log_samples=False, random_seed=seed,
                numpy_random_seed=seed, fewshot_random_seed=seed)
    except (ConnectionError, OSError) as err:
        if not offline:
            raise
        raise ValueError(
            f"--lm-eval {','.join(names)}: a task's dataset is on the Hugging Face hub, which "
            "cannot be reached, and is not in the local cache "
            f"({type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}); "
            "run it once online (the dataset stays cached), or score a task of your own: a "
            "YAML file under --include-path with dataset_path: json and its data_files") from None
    return {
        "run": run_dir, "step": lm.run.step, "family": lm.run.config.family,
        "lm_eval": lm_eval.__version__, "tasks": names,
        "max_length": lm.max_length, "batch_size": lm.scorer.batch_size,
        "limit": limit, "results": results["results"],
        "groups": results.get("groups", {}), "n_shot": results.get("n-shot", {}),
        "n_samples": results.get("n-samples", {}), "versions": results.get("versions", {}),
    }
