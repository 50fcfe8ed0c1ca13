"""Experiment tracking: the TensorBoard event files of a run, read back, hold the scalars of
its metrics.jsonl, its config and text samples; W&B in offline mode logs the same scalars."""

import glob
import json
import os
import struct

import pytest

from transformers_jax import ModelConfig, TrainConfig
from transformers_jax.train.loop import train
from transformers_jax.train.tracking import TENSORBOARD_DIR, flatten_config

TINY_MODEL = ModelConfig(vocab_size=262, d_model=32, n_layers=1, n_heads=2, max_len=64)


def read_events(directory: str) -> list:
    """Every ``Event`` of the event files in ``directory`` (TFRecord framing: length, its CRC,
    data, its CRC), parsed with tensorboardX's protos: no TensorFlow needed."""
    from tensorboardX.proto.event_pb2 import Event

    events = []
    for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
        data = open(path, "rb").read()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            events.append(Event.FromString(data[at + 12:at + 12 + length]))
            at += 12 + length + 4
    return events


def scalars_of(events) -> dict[tuple[str, int], float]:
    return {(v.tag, e.step): v.simple_value for e in events for v in e.summary.value
            if v.HasField("simple_value")}


def texts_of(events) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for e in events:
        for v in e.summary.value:
            if v.metadata.plugin_data.plugin_name == "text":
                out.setdefault(v.tag, []).append(v.tensor.string_val[0].decode())
    return out


def tiny_cfg(run_dir, **kw) -> TrainConfig:
    return TrainConfig(steps=4, batch_size=4, seq_len=16, warmup_steps=1, log_every=2,
                       eval_every=2, eval_batches=1, progress=False, run_dir=str(run_dir), **kw)


@pytest.mark.slow
def test_event_files_hold_the_metrics_config_and_samples(tmp_path):
    train(TINY_MODEL, tiny_cfg(tmp_path))
    events = read_events(str(tmp_path / TENSORBOARD_DIR))
    scalars = scalars_of(events)
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    expected = {(f"{r['kind']}/{k}", r["step"]): float(v) for r in rows
                if r["kind"] in ("train", "eval") for k, v in r.items()
                if k not in ("kind", "step")}
    assert set(scalars) == set(expected)
    for key, value in expected.items():
        assert scalars[key] == pytest.approx(value, rel=1e-6), key  # stored as float32
    tags = {tag for tag, _ in scalars}
    assert {"train/loss", "train/learning_rate", "train/grad_norm", "train/tokens_per_s",
            "train/mfu", "eval/loss"} <= tags
    texts = texts_of(events)
    config = json.loads(texts["config/text_summary"][0].strip("`\n"))
    assert config["model"]["d_model"] == 32 and config["train"]["steps"] == 4
    assert len(texts["samples/text_summary"]) == 2  # one per evaluation (steps 2 and 4)
    assert "greedy continuation" in texts["samples/text_summary"][0]
    hparams = [v for e in events for v in e.summary.value
               if v.metadata.plugin_data.plugin_name == "hparams"]
    assert hparams  # the experiment, session start and session end summaries


@pytest.mark.slow
def test_no_samples_for_a_family_or_positions_that_cannot_decode(tmp_path):
    train(TINY_MODEL, tiny_cfg(tmp_path / "off", tensorboard=False))
    assert not os.path.exists(tmp_path / "off" / TENSORBOARD_DIR)
    bert = TINY_MODEL.replace(family="bert", mask="bidirectional")
    train(bert, tiny_cfg(tmp_path / "bert"))
    texts = texts_of(read_events(str(tmp_path / "bert" / TENSORBOARD_DIR)))
    assert "config/text_summary" in texts and "samples/text_summary" not in texts
    # nor for positions that refuse the KV cache (randomized, as set by default): the run
    # trains to its end and checkpoints rather than failing at its first evaluation
    randomized = TINY_MODEL.replace(position="randomized")
    train(randomized, tiny_cfg(tmp_path / "randomized", checkpoint_every=2))
    assert os.listdir(tmp_path / "randomized" / "checkpoints")
    texts = texts_of(read_events(str(tmp_path / "randomized" / TENSORBOARD_DIR)))
    assert "eval/loss" in {tag for tag, _ in scalars_of(read_events(
        str(tmp_path / "randomized" / TENSORBOARD_DIR)))}
    assert "samples/text_summary" not in texts


def test_flatten_config_gives_hyperparameter_values():
    flat = flatten_config({"model": {"d": 8, "pos": {"name": "rope"}}, "train": {"x": None,
                           "lengths": (1, 20), "on": True}})
    assert flat == {"model.d": 8, "model.pos.name": "rope", "train.x": "null",
                    "train.lengths": "[1, 20]", "train.on": True}


@pytest.mark.slow
def test_wandb_offline_logs_the_same_scalars(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    logged = []
    real_init = wandb.init

    def init(**kw):
        run = real_init(**kw)
        original = run.log
        run.log = lambda data, step=None: (logged.append((step, dict(data))),
                                            original(data, step=step))
        return run

    monkeypatch.setattr(wandb, "init", init)
    train(TINY_MODEL, tiny_cfg(tmp_path / "run", wandb_project="tjax-test"))
    assert glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "*.wandb"))
    rows = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    evals = [r for r in rows if r["kind"] == "eval"]
    wandb_evals = [(s, d["eval/loss"]) for s, d in logged if "eval/loss" in d]
    assert wandb_evals == [(r["step"], pytest.approx(r["loss"])) for r in evals]


def test_wandb_missing_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kw):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ValueError, match="pip install wandb"):
        train(TINY_MODEL, tiny_cfg(tmp_path, wandb_project="p"))


def test_the_writer_imports_no_pytorch_and_leaves_it_importable(tmp_path):
    """tensorboardX imports PyTorch whenever it is installed (about a second of CPU a training
    process); the tracker's import keeps it out, writes its events, and ``import torch``
    still works afterwards."""
    pytest.importorskip("torch")
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from transformers_jax.train.tracking import Tracker\n"
        "assert 'torch' not in sys.modules\n"
        f"tracker = Tracker({str(tmp_path)!r}, {{'model': {{'d_model': 8}}}})\n"
        "tracker.log('train', 1, {'loss': 2.5})\n"
        "tracker.close()\n"
        "assert 'torch' not in sys.modules\n"
        "import torch\n"
        "print(torch.ones(2).sum().item())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "2.0", done.stderr[-2000:]
    scalars = [(v.tag, v.simple_value) for e in read_events(str(tmp_path / TENSORBOARD_DIR))
               for v in e.summary.value if v.tag == "train/loss"]
    assert scalars == [("train/loss", 2.5)]
