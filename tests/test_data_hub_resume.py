"""A run reading a mixture of a hub stream and a parquet file, killed mid-epoch (SIGKILL after
step 7) and resumed, equals the uninterrupted run bit for bit; its README names the mixture."""

import pytest

pytest.importorskip("datasets")  # the hf-data extra

import json
import os
import signal
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
from subprocess_env import single_device_env

from transformers_jax.runs.checkpoint import Checkpointer

TINY = [
    "--model.n_layers=1",
    "--model.d_model=32",
    "--model.n_heads=2",
    "--train.batch_size=4",
    "--train.seq_len=32",
    "--train.log_every=1",
    "--train.eval_batches=1",
    "--train.eval_every=4",
    "--no-progress",
    "--train.tensorboard=false",  # tensorboardX imports torch when installed: seconds a process
]


def offline_tjax(env, *args):
    script = os.path.join(os.path.dirname(__file__), "offline_hub.py")
    # this checkout's package, whichever one is installed
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, script, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**single_device_env(), **env},
    )


def losses(run_dir):
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {row["step"]: row["loss"] for row in rows if row["kind"] == "train"}


@pytest.mark.slow
def test_a_stream_mixture_killed_mid_epoch_resumes_exactly(tmp_path):
    train, valid = tmp_path / "train.jsonl", tmp_path / "validation.jsonl"
    train.write_text(
        "".join(
            json.dumps({"text": f"streamed record {i}: " + "q" * (i % 9)}) + "\n"
            for i in range(400)
        )
    )  # 8 steps read a small part
    valid.write_text("".join(json.dumps({"text": f"held {i}"}) + "\n" for i in range(40)))
    table = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"body": [f"parquet row {i} " * 3 for i in range(300)]}), table)
    env = {
        "TJAX_TEST_HUB": f"train={train},validation={valid}",
        "TJAX_DATA_DIR": str(tmp_path / "data"),
        # datasets imports torch, when installed, for every stream it opens (2.5 s of CPU a
        # process) to share an epoch counter with DataLoader workers: not part of a stream's
        # position (state_dict), which is what a resume restores
        "USE_TORCH": "0",
    }
    common = [
        "train",
        *TINY,
        "--steps",
        "8",
        "--train.checkpoint_every=3",
        "--data",
        f"0.6*hf:someone/corpus,0.4*{table}",
        "--data.field=text",
    ]
    straight, crashed = str(tmp_path / "straight"), str(tmp_path / "crashed")
    # --data.field names the stream's column; the parquet file's only text column is 'body',
    # which a field given for the whole mixture cannot name: refused, listing it
    refused = offline_tjax(env, *common, "--run-dir", straight)
    assert refused.returncode == 2 and "its fields: body (string)" in refused.stderr
    common = common[:-1]
    ran = offline_tjax(env, *common, "--run-dir", straight)
    assert ran.returncode == 0, ran.stderr[-3000:]
    died = offline_tjax(env, "7", *common, "--run-dir", crashed)
    assert died.returncode == -signal.SIGKILL, died.stderr[-3000:]
    assert Checkpointer(crashed).latest_step() in (3, 6)
    resumed = offline_tjax(env, *common, "--run-dir", crashed)
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-3000:]
    a, b = losses(straight), losses(crashed)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    assert [a[s] for s in a] == [b[s] for s in a]  # bit for bit
    readme = open(os.path.join(crashed, "README.md")).read()
    assert f"a mixture by documents of 60% hf:someone/corpus, 40% {table}" in readme
