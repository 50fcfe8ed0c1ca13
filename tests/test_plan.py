"""tjax plan: the real train step compiled for a TPU topology from this CPU host (libtpu).

The compile tests need libtpu (``pip install -e ".[tpu]"``); without it they skip, unless
``TJAX_REQUIRE_LIBTPU=1`` (CI sets it) makes a missing libtpu a failure. The parsing and
roofline tests need nothing.
"""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import pytest
from plan_fixtures import memoised_compile_train, use_memo
from subprocess_env import single_device_env

from transformers_jax import plan as planning
from transformers_jax.cli import main
from transformers_jax.config import (
    CONTEXT_ATTENTION,
    ConfigError,
    LoraConfig,
    ModelConfig,
    TrainConfig,
)
from transformers_jax.plan.summary import summary
from transformers_jax.registry import ATTENTION

HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None
if not HAVE_LIBTPU and os.environ.get("TJAX_REQUIRE_LIBTPU") == "1":
    raise RuntimeError("TJAX_REQUIRE_LIBTPU=1 but libtpu is not installed: pip install -e '.[tpu]'")
needs_libtpu = pytest.mark.skipif(
    not HAVE_LIBTPU, reason="libtpu not installed (pip install -e '.[tpu]'): cannot compile "
    "for a TPU topology")

TOPOLOGY = "v5e:2x2"  # the smallest: 4 chips, one host
TINY = ModelConfig(vocab_size=256, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, max_len=128,
                   dtype="bfloat16", dropout=0.0)
TINY_PARAMS = 62_336  # count_params of build_model(TINY)'s initialised parameters
TINY_TRAIN = TrainConfig(batch_size=4, seq_len=128, strategy="jit")
TPU_ATTENTION = [name for name in ATTENTION.names() if "tpu" in ATTENTION.get(name).backends]
# the Pallas kernels (nothing but a TPU or GPU runs them) compile for v5p too
TPU_ONLY = [name for name in TPU_ATTENTION if "cpu" not in ATTENTION.get(name).backends]
AOT_STRATEGIES = {"single": None, "shard_map": "data=4", "jit": "data=1,fsdp=2,tensor=2"}
# The compile matrix: a covering subset of kernel x strategy x chip (issue 61). Each strategy
# wraps a Pallas kernel its own way (whole, per shard under shard_map unchecked, per shard
# under the jit partitioner): those kernels compile under every strategy on v5e. The Mosaic
# compile for another chip sees the same kernel body whatever the strategy (only the grid's
# batch and head counts differ): v5p under jit. The XLA-lowered kernels are ordinary programs
# for the partitioner: xla (the Dense layers' generic path) and chunked (the one with backend
# hooks of its own) under every strategy, the reference kernel under the sharded jit.
XLA_LOWERED = [name for name in TPU_ATTENTION if name not in TPU_ONLY]
EVERY_STRATEGY = [name for name in XLA_LOWERED if name in ("xla", "chunked")] + TPU_ONLY
COMPILES = ([(TOPOLOGY, name, s) for name in EVERY_STRATEGY for s in sorted(AOT_STRATEGIES)]
            + [(TOPOLOGY, name, "jit") for name in XLA_LOWERED if name not in EVERY_STRATEGY]
            + [("v5p:2x2x1", name, "jit") for name in TPU_ONLY])


# No libtpu needed ---------------------------------------------------------------------------
HLO = """
  %ag = bf16[512,256]{1,0} all-gather(%p), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}
  %ar = (f32[1024]{0}, f32[8]{0}) all-reduce(%a, %b), replica_groups={{0,1},{2,3}}, to_apply=%add
  %rs = f32[64]{0} reduce-scatter(%c), replica_groups=mesh['x'=4,'y'=2] {'x'}, dimensions={0}
  %ags = (bf16[16]{0}, bf16[64]{0}) all-gather-start(%d), replica_groups=[2,4]<=[8]
  %agd = bf16[64]{0} all-gather-done(%ags)
  %add = f32[] add(%x, %y)
"""


def test_collectives_counts_and_ring_bytes():
    got = planning.collectives(HLO, n_devices=8)
    assert set(got) == {"all-gather", "all-reduce", "reduce-scatter"}
    # all-gather: 512*256*2 bytes over 4 devices, plus the async one: 64*2 bytes over 4
    assert got["all-gather"]["count"] == 2
    assert got["all-gather"]["result_bytes"] == 512 * 256 * 2 + 128
    assert got["all-gather"]["ici_bytes"] == pytest.approx(0.75 * (512 * 256 * 2 + 128))
    # all-reduce of a tuple (4096 + 32 bytes) in groups of 2: 2 (n-1)/n = 1
    assert got["all-reduce"]["ici_bytes"] == pytest.approx(4128)
    # reduce-scatter over mesh axis x (4): (n-1) x result = 3 x 256
    assert got["reduce-scatter"]["ici_bytes"] == pytest.approx(768)


LOOP_HLO = """
%body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,16] get-tuple-element(%p), index=1
  %w = f32[16,16] constant({...})
  %y = f32[8,16] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %s = f32[8,16] all-reduce(%y), replica_groups=[1,4]<=[4], to_apply=%add
  ROOT %t = (s32[], f32[8,16]) tuple(%i, %s)
}

%cond (c: (s32[], f32[8,16])) -> pred[] {
  %c = (s32[], f32[8,16]) parameter(0)
  %k = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%k, %n), direction=LT
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %r = f32[] add(%a, %b)
}

ENTRY %main (x0: f32[8,16]) -> f32[8,16] {
  %x0 = f32[8,16] parameter(0)
  %w0 = f32[16,16] constant({...})
  %y0 = f32[8,16] dot(%x0, %w0), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]) tuple(%zero, %y0)
  %loop = (s32[], f32[8,16]) while(%init), condition=%cond, body=%body
  %twice = (s32[], f32[8,16]) while(%loop), condition=%cond, body=%body,\
 backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[8,16] get-tuple-element(%twice), index=1
}
"""


def test_loops_count_as_often_as_they_run():
    module = planning.Module.parse(LOOP_HLO)
    runs, unknown = module.multiplicities()
    # the body runs 5 times (its condition's constant) plus 3 (the known trip count)
    assert module.entry == "main" and unknown == []
    assert runs["body"] == 8 and runs["main"] == 1 and runs["add"] == 8
    matmul = 2 * 8 * 16 * 16  # one [8,16] x [16,16] dot
    assert planning.matmul_flops(module, runs) == 9 * matmul
    got = planning.collectives(LOOP_HLO, n_devices=4)["all-reduce"]
    assert got["count"] == 8 and got["result_bytes"] == 8 * 512
    assert got["ici_bytes"] == pytest.approx(8 * 512 * 2 * 3 / 4)
    # a condition that is not `counter < constant`: counted once, and said so
    odd = planning.Module.parse(LOOP_HLO.replace("direction=LT", "direction=NE"))
    runs, unknown = odd.multiplicities()
    assert unknown == ["loop"] and runs["body"] == 1 + 3


NESTED_SLICE_HLO = """
%inner (a: f32[12,256], i: s32[]) -> f32[256] {
  %a = f32[12,256] parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = f32[1,256] dynamic-slice(%a, %i, %z), dynamic_slice_sizes={1,256}
  ROOT %b = f32[256] bitcast(%ds)
}

%outer (w: f32[12,256], j: s32[], x: f32[256]) -> f32[256] {
  %w = f32[12,256] parameter(0)
  %j = s32[] parameter(1)
  %x = f32[256] parameter(2)
  %row = f32[256] fusion(%w, %j), kind=kLoop, calls=%inner
  ROOT %y = f32[256] add(%row, %x)
}

ENTRY %main (w0: f32[12,256], j0: s32[], x0: f32[256]) -> f32[256] {
  %w0 = f32[12,256] parameter(0)
  %j0 = s32[] parameter(1)
  %x0 = f32[256] parameter(2)
  ROOT %f = f32[256] fusion(%w0, %j0, %x0), kind=kOutput, calls=%outer
}
"""


def test_byte_model_reads_only_the_slice_of_a_stacked_operand():
    """A scanned layer reads its row of the stacked [L, ...] weights through a nested fusion:
    1 KiB of the 12 KiB operand, plus the other operand and the output (1 KiB each)."""
    module = planning.Module.parse(NESTED_SLICE_HLO)
    runs, _ = module.multiplicities()
    assert planning.hbm_bytes(module, runs) == 1024 + 4 + 1024 + 1024
    whole = planning.Module.parse(NESTED_SLICE_HLO.replace(
        "ROOT %b = f32[256] bitcast(%ds)", "%b = f32[256] bitcast(%ds)\n"
        "  ROOT %e = f32[256] reduce(%a, %z), dimensions={0}"))  # now it reads all of %a
    assert planning.hbm_bytes(whole, whole.multiplicities()[0]) == 12 * 1024 + 4 + 1024 + 1024


def test_convolution_flops_count_only_real_taps():
    """TPU programs write a batched matmul as a convolution whose batch dims are dilated
    spatial dims: attention scores of batch 2, 12 heads, 1024 x 1024 keys, head width 64."""
    module = planning.Module.parse(
        "%q = bf16[2,1024,12,64]{3,2,1,0} parameter(0)\n"
        "%k = bf16[2,1024,12,64]{3,2,1,0} parameter(1)\n"
        "%s = f32[2,12,1024,1024]{3,2,1,0} convolution(%q, %k), window={size=2x12 stride=1x11 "
        "lhs_dilate=2x12}, dim_labels=0b1f_0o1i->01bf\n"
        # an FSDP projection: 2048 tokens, two 192-wide input chunks as a 2-tap window
        "%x = bf16[2048,2,192]{2,1,0} parameter(2)\n"
        "%w = bf16[2,192,768]{2,1,0} parameter(3)\n"
        "%y = f32[2048,768,1]{1,0,2} convolution(%x, %w), window={size=2}, "
        "dim_labels=b0f_0io->bf0\n")
    runs, _ = module.multiplicities()
    assert planning.matmul_flops(module, runs) == (2 * 2 * 12 * 1024 * 1024 * 64
                                                  + 2 * 2048 * 768 * 384)


@pytest.mark.slow
def test_scanned_stack_costs_what_the_unrolled_one_does():
    """On CPU: a 4-layer GPT's training step with scan_layers counts its loop's matmuls as the
    unrolled program does, and the byte model matches XLA's count with each loop once."""
    from transformers_jax.learning.objectives import objective_for
    from transformers_jax.learning.optim import make_optimizer
    from transformers_jax.models import build_model
    from transformers_jax.parallel.strategies import make_trainer

    got = {}
    for scan in (False, True):
        config = ModelConfig.preset("gpt2-cpu", dropout=0.0, scan_layers=scan)
        cfg = TrainConfig(batch_size=2, seq_len=64, strategy="single")
        batch = planning.example_batch(config, cfg.batch_size, cfg.seq_len)
        trainer = make_trainer("single", build_model(config), make_optimizer(cfg),
                               {k: jax.numpy.zeros(v.shape, v.dtype) for k, v in batch.items()},
                               objective=objective_for(config.family))
        compiled = trainer.lower(trainer.abstract_state(), trainer.abstract_batch(batch)).compile()
        module = planning.Module.parse(compiled.as_text())
        got[scan] = planning.cost(compiled, module), module
    unrolled, scanned = got[False][0], got[True][0]
    trips = sorted(loop["trips"] for loop in scanned["loops"])
    for loop in unrolled["loops"]:  # e.g. the optimizer's; the scanned step has them too
        trips.remove(loop["trips"])
    assert trips == [4, 4]  # the layer stack, forward and backward
    assert scanned["xla_flops"] < 0.5 * unrolled["xla_flops"]  # XLA counts the body once
    assert scanned["flops"] == pytest.approx(unrolled["flops"], rel=0.05)
    module = got[False][1]
    ones = {name: 1.0 for name in module.multiplicities()[0]}
    assert planning.hbm_bytes(module, ones) == pytest.approx(unrolled["xla_bytes_accessed"],
                                                             rel=0.02)


def test_roofline_adds_collectives_and_counts_model_flops():
    chip = planning.CHIPS["v5e"]
    target = planning.Target("v5e:2x2", chip, tuple(range(4)), chips=4, slices=1, hosts=1)
    line = planning.roofline(per_device_flops=1.97e12, model_flops=0.985e12,
                             bytes_accessed=8.19e8, ici_bytes=4e8, target=target)
    assert line["compute_s"] == pytest.approx(0.01)  # 1.97e12 / 197e12
    assert line["hbm_s"] == pytest.approx(0.001)
    assert line["ici_s"] == pytest.approx(0.001)
    assert line["step_s"] == pytest.approx(0.011)
    assert line["mfu"] == pytest.approx(0.5 / 1.1)
    assert line["bound"] == "compute"
    assert "mfu_causal_half" not in line  # only when the causal-halved count is given
    # MaxText's convention: the same step time, fewer model FLOPs
    line = planning.roofline(per_device_flops=1.97e12, model_flops=0.985e12,
                             bytes_accessed=8.19e8, ici_bytes=4e8, target=target,
                             model_flops_causal_half=0.788e12)
    assert line["mfu"] == pytest.approx(0.5 / 1.1) and line["step_s"] == pytest.approx(0.011)
    assert line["mfu_causal_half"] == pytest.approx(0.4 / 1.1)
    assert line["mfu_causal_half_overlapped"] == pytest.approx(0.4)


def test_candidate_meshes_cover_every_split():
    meshes = planning.candidate_meshes(8)
    assert meshes[0] == "data=8,fsdp=1,tensor=1"
    assert len(meshes) == len(set(meshes)) == 10  # ordered factorisations of 8 into 3 parts
    assert "data=1,fsdp=2,tensor=4" in meshes
    # the short list: data parallel, then FSDP x tensor with tensor within a host of 4
    assert planning.candidate_meshes(32, "fsdp", per_host=4) == [
        "data=32,fsdp=1,tensor=1", "data=1,fsdp=32,tensor=1", "data=1,fsdp=16,tensor=2",
        "data=1,fsdp=8,tensor=4"]
    with pytest.raises(ConfigError, match="--search-meshes='every'"):
        planning.candidate_meshes(8, "every")


def test_candidate_meshes_split_long_sequences_only():
    """A context axis joins the candidates only where each shard keeps at least min_shard
    tokens: none at 1024 tokens, 2 ways at 2048, 2 and 4 ways at 4096."""
    assert planning.candidate_meshes(8, seq_len=1024) == planning.candidate_meshes(8)
    at_2k = [m for m in planning.candidate_meshes(8, seq_len=2048) if "context" in m]
    assert at_2k and all("context=2," in m for m in at_2k)
    at_4k = planning.candidate_meshes(8, seq_len=4096)
    assert {m.split("context=")[1][0] for m in at_4k if "context" in m} == {"2", "4"}
    # every split of 8 into data x fsdp x context x tensor with context in {1, 2, 4}
    assert len(at_4k) == len(set(at_4k)) == 10 + 6 + 3
    assert planning.candidate_meshes(8, "fsdp", per_host=2, seq_len=4096, min_shard=2048) == [
        "data=8,fsdp=1,tensor=1", "data=1,fsdp=8,tensor=1", "data=1,fsdp=4,tensor=2",
        "data=1,fsdp=4,context=2,tensor=1", "data=1,fsdp=2,context=2,tensor=2"]


def test_bad_target_is_a_clear_error():
    with pytest.raises(ConfigError, match="GENERATION:SHAPE"):
        planning.tpu_target("v9z:2x2")
    with pytest.raises(SystemExit) as stop:  # no --target: argparse's usage error
        main(["plan", "--model.d_model=64"])
    assert stop.value.code == 2


# libtpu: real compiles for TPU v5e 2x2 --------------------------------------------------------
@pytest.fixture(autouse=True)
def mxu_precision():
    """conftest asks for float32 matmuls everywhere; Mosaic (the Pallas TPU kernel) cannot
    contract bfloat16 at that precision, so these compiles use the TPU's default."""
    with jax.default_matmul_precision("default"):
        yield


@pytest.fixture(autouse=True)
def shared_compiles(monkeypatch):
    """A step several tests (or a plan and then a search) compile is compiled once
    (``plan_fixtures``)."""
    use_memo(monkeypatch)


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("topology, attention, strategy", COMPILES)
def test_train_step_compiles_for_tpu(topology, attention, strategy):
    target = planning.tpu_target(topology)
    cfg = TINY_TRAIN.replace(strategy=strategy, mesh=AOT_STRATEGIES[strategy])
    got = memoised_compile_train(TINY.replace(attention=attention), cfg, target)
    memory = got["memory"]
    assert memory["argument_bytes"] > 0 and memory["generated_code_bytes"] > 0
    hbm = {"v5e": 16, "v5p": 95}[topology.split(":")[0]] * 2**30
    assert memory["fits"] and memory["total_bytes"] < memory["hbm_bytes"] == hbm
    assert got["params"] == TINY_PARAMS  # the same model whatever the strategy
    # XLA's FLOPs agree with the model's count (matmuls, forward + backward) to 25%
    assert got["flops_per_device"] == pytest.approx(got["model_flops_per_device"], rel=0.25)
    if strategy == "single":
        assert got["devices"] == 1 and got["collectives"] == {}
    elif strategy == "shard_map":  # one all-reduce of gradient sums over data
        assert "all-reduce" in got["collectives"]
    else:  # fsdp gathers parameters
        assert got["collectives"]["all-gather"]["ici_bytes"] > 0


@needs_libtpu
@pytest.mark.slow
def test_a_step_the_compiler_cannot_fit_is_a_plan_that_does_not_fit(monkeypatch):
    """The TPU compiler refuses a program whose temporaries exceed HBM (RESOURCE_EXHAUSTED):
    the plan says it does not fit, with the compiler's words, and a search goes on."""
    big = TINY.replace(attention="xla", max_len=2048)  # [256, 4, 2048, 2048] f32 scores
    cfg = TrainConfig(batch_size=256, seq_len=2048, strategy="single")
    got = planning.compile_train(big, cfg, planning.tpu_target(TOPOLOGY))
    assert got["memory"]["fits"] is False and got["roofline"] is None
    assert "exceeds available HBM" in got["memory"]["compiler"]
    assert got["params"] == TINY_PARAMS  # no position table: the same weights as TINY
    wide = cfg.replace(strategy="jit", batch_size=1024)  # 256 rows per device, or 4 x 1024 x 1
    monkeypatch.setattr(planning.steps, "MIN_CONTEXT_SHARD", 4096)  # no context axis here
    found = planning.search(big, wide, planning.tpu_target(TOPOLOGY),
                            ("none",), log=lambda _: None, meshes="fsdp")
    assert found["best"] is None
    # data=4, fsdp=4, fsdp=2 x tensor=2 refused by the compiler; tensor=4 cannot split 2 kv heads
    assert [row.get("fits") for row in found["tried"]] == [False, False, False, None]


@needs_libtpu
@pytest.mark.slow
def test_scanned_stack_plans_like_the_unrolled_one_on_tpu():
    """XLA counts a loop body once; the plan counts the scanned layers' collectives and matmuls
    as often as they run, so both programs of a 4-layer model give the same figures."""
    target = planning.tpu_target(TOPOLOGY)
    cfg = TINY_TRAIN.replace(mesh="data=1,fsdp=4,tensor=1")
    got = {scan: planning.compile_train(TINY.replace(n_layers=4, scan_layers=scan), cfg, target)
           for scan in (False, True)}
    assert got[True]["loops"] and not got[False]["loops"]
    assert got[True]["xla_flops_per_device"] < 0.5 * got[False]["flops_per_device"]
    assert got[True]["flops_per_device"] == pytest.approx(got[False]["flops_per_device"],
                                                          rel=0.15)
    assert got[True]["ici_bytes_per_device"] == pytest.approx(
        got[False]["ici_bytes_per_device"], rel=0.1)


@needs_libtpu
@pytest.mark.slow
def test_plan_command_prints_the_plan_json(capsys):
    argv = ["plan", "--target", TOPOLOGY, "--mesh", "data=2,fsdp=2", "--batch", "4",
            "--seq-len", "128", "--model.vocab_size=256", "--model.d_model=64",
            "--model.n_layers=1", "--model.n_heads=4", "--model.max_len=128",
            "--model.attention=pallas", "--model.dtype=bfloat16", "--json"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert "compiling the training step for v5e" in err  # said before a wait of minutes
    assert {"target", "model", "train", "decode", "note"} <= set(result)
    assert result["target"]["chips"] == 4 and result["target"]["chip"] == "TPU v5e"
    for step in ("train", "decode"):
        got = result[step]
        assert {"memory", "flops_per_device", "bytes_accessed_per_device", "collectives",
                "ici_bytes_per_device", "roofline", "tokens_per_s"} <= set(got)
        assert got["memory"]["fits"] and got["memory"]["argument_bytes"] > 0
        assert 0 < got["roofline"]["mfu"] <= 1 and got["roofline"]["step_s"] > 0
    assert result["train"]["mesh"] == "data=2,fsdp=2,tensor=1"
    # without --json: a few lines for a person, from the same figures
    text = summary(result).splitlines()
    train, decode = result["train"], result["decode"]
    assert text[0].startswith(f"{TOPOLOGY} (4 x TPU v5e): batch 4 x 128 tokens")
    assert text[1].startswith("train: mesh data=2,fsdp=2,tensor=1, remat none: fits, ")
    assert f"step {train['roofline']['step_s']:.4g} s (" in text[2]
    assert f"MFU {100 * train['roofline']['mfu']:.1f}%" in text[2]
    assert any(f"step {decode['roofline']['step_s']:.4g} s" in line for line in text)
    assert len(text) <= 8 and "--json prints every figure" in text[-1]


@needs_libtpu
@pytest.mark.slow
def test_plan_leaves_a_persistent_cache_alone(tmp_path):
    """With JAX's cache set (as on many TPU VMs), `tjax plan` writes nothing there: it could
    not load a TPU program back, and each later plan would warn about every one."""
    cache = tmp_path / "cache"
    env = {**single_device_env(), "JAX_COMPILATION_CACHE_DIR": str(cache),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "transformers_jax.cli", "plan", "--target", TOPOLOGY, "--mesh",
         "data=4", "--batch", "4", "--seq-len", "32", "--model.d_model=32",
         "--model.n_layers=1", "--model.n_heads=2", "--no-decode", "--json"],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["train"]["memory"]["fits"]
    assert not cache.exists() or not os.listdir(cache)


def _sharded_attention_grad_hlo(topology: str, implementation: str, t: int,
                                window: int | None = None, **options) -> str:
    """The compiled text of the gradient of ``implementation`` with a causal mask (and
    ``window``), packed segments, key padding and grouped heads (4 query, 2 key/value), on
    inputs split over data and tensor, for ``topology``."""
    import flax.linen as nn
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from transformers_jax.nn.attention import dot_product_attention
    from transformers_jax.nn.masks import AttentionMask
    from transformers_jax.parallel import LOGICAL_RULES, make_mesh

    mesh = make_mesh("data=2,tensor=2", devices=planning.tpu_target(topology).devices)
    b, h, n, d = 4, 4, 2, 128

    def loss(q, k, v, segments, valid):
        pos = jnp.broadcast_to(jnp.arange(t), (b, t))
        mask = AttentionMask(q_positions=pos, kv_positions=pos, q_segments=segments,
                             kv_segments=segments, kv_valid=valid, causal=True, window=window)
        out = dot_product_attention(q, k, v, mask=mask, implementation=implementation,
                                    **options)
        return out.astype(jnp.float32).sum()

    def spec(*axes):
        return NamedSharding(mesh, P(*axes))

    heads = spec(("data", "fsdp"), None, "tensor", None)
    args = (jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16, sharding=heads),
            jax.ShapeDtypeStruct((b, t, n, d), jnp.bfloat16, sharding=heads),
            jax.ShapeDtypeStruct((b, t, n, d), jnp.bfloat16, sharding=heads),
            jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=spec("data", None)),
            jax.ShapeDtypeStruct((b, t), jnp.bool_, sharding=spec("data", None)))
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_RULES):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    assert compiled.memory_analysis().argument_size_in_bytes > 0
    return compiled.as_text()


@needs_libtpu
def test_pallas_with_segments_gqa_and_padding_compiles_sharded_for_tpu():
    """The Pallas TPU kernel, differentiated, with packed segments, key padding and grouped
    heads, on inputs split over data and tensor: mapped per shard, it compiles for v5e."""
    hlo = _sharded_attention_grad_hlo(TOPOLOGY, "pallas", 256)
    assert "tpu_custom_call" in hlo  # the Mosaic kernel itself, not a fallback


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("topology", [TOPOLOGY, "v5p:2x2x1"])
def test_splash_with_every_mask_part_compiles_sharded_for_tpu(topology):
    """The splash kernel, differentiated, with a sliding window, packed segments, key padding,
    soft-capping and grouped heads, on inputs split over data and tensor: mapped per shard, it
    compiles for v5e and v5p."""
    hlo = _sharded_attention_grad_hlo(topology, "splash", 512, window=200, logit_softcap=30.0)
    assert "tpu_custom_call" in hlo  # the Mosaic kernels themselves, not a fallback
    # each device holds one k/v head and its two query heads: the MQA kernel, k/v not repeated
    assert all(f"splash_mqa_{p}_segmented" in hlo for p in ("fwd", "dq", "dkv"))


@needs_libtpu
@pytest.mark.slow
def test_single_strategy_plan_decodes_on_one_chip():
    target = planning.tpu_target(TOPOLOGY)
    result = planning.plan(TINY.replace(attention="xla"), TINY_TRAIN.replace(strategy="single"),
                           target)
    assert result["train"]["devices"] == 1 and result["train"]["mesh"] == "data=1,fsdp=1,tensor=1"
    assert result["decode"]["memory"]["fits"] and result["decode"]["collectives"] == {}
    line = result["decode"]["roofline"]  # per operation, as the training step's
    assert line["step_s"] == pytest.approx(sum(line["split"].values()), rel=1e-9)
    assert line["bound"] == "memory_bound" and "whole_program" in line


@needs_libtpu
@pytest.mark.slow
def test_seeds_trained_together_plan_spreads_seeds_over_chips():
    """``--seeds S``: the step of S seeds trained together (``parallel.seeds``), each chip its
    own seeds on a ``seed`` mesh axis over as many chips as divide S: 4 seeds on the 2x2
    topology hold one seed's arguments and FLOPs per chip, 8 seeds two seeds', and no
    collective crosses chips."""
    target = planning.tpu_target(TOPOLOGY)
    cfg = TINY_TRAIN.replace(strategy="single")
    model = TINY.replace(attention="xla")
    one = memoised_compile_train(model, cfg, target)  # the matrix's xla single step
    four = planning.compile_train(model, cfg, target, seeds=4)
    eight = planning.compile_train(model, cfg, target, seeds=8)
    assert four["seeds"] == 4 and four["params"] == one["params"] == TINY_PARAMS
    assert (four["devices"], four["mesh"]) == (4, "seed=4") and eight["devices"] == 4
    assert four["memory"]["fits"] and four["collectives"] == eight["collectives"] == {}
    for result, per_chip in ((four, 1), (eight, 2)):
        assert result["memory"]["argument_bytes"] == pytest.approx(
            per_chip * one["memory"]["argument_bytes"], rel=0.05)
        assert result["model_flops_per_device"] == per_chip * one["model_flops_per_device"]
    assert planning.compile_train(model, cfg, target, seeds=3)["devices"] == 3
    with pytest.raises(ConfigError, match="--seeds 4: .*--strategy single"):
        planning.plan(TINY, TINY_TRAIN.replace(strategy="jit"), target, seeds=4)


HAVE_CUDA_PLUGIN = importlib.util.find_spec("jax_cuda12_plugin") is not None


@pytest.mark.skipif(not HAVE_CUDA_PLUGIN, reason="the CUDA plugin is not installed (pip install "
                    "-e '.[gpu-plan]'): cannot compile for a GPU")
@pytest.mark.slow
def test_train_step_compiles_for_h100_without_a_gpu():
    target = planning.make_target("h100:2")
    assert target.devices[0].device_kind == planning.GPU_SPECS["h100"]
    got = planning.compile_train(TINY.replace(attention="xla"),
                                 TINY_TRAIN.replace(mesh="data=2"), target)
    assert got["memory"]["fits"] and got["memory"]["argument_bytes"] > 0
    assert got["params"] == TINY_PARAMS and "all-reduce" in got["collectives"]


def test_gpu_target_description_carries_the_datasheet():
    text = planning.gpu_target_config("h200")
    assert "device_memory_size: 141000000000" in text
    assert "memory_bandwidth: 4800000000000" in text
    assert 'device_description_str: "NVIDIA H200"' in text


@needs_libtpu
@pytest.mark.slow
def test_search_keeps_the_fastest_fit_and_skips_meshes_that_cannot_split():
    target = planning.tpu_target(TOPOLOGY)
    model = TINY.replace(attention="xla", n_heads=2, n_kv_heads=None)  # 2 heads: not tensor=4
    result = planning.plan(model, TINY_TRAIN, target, do_search=True, remats=("none",),
                           decode=False)
    rows = result["search"]
    assert len(rows) == len(planning.candidate_meshes(4)) == 6
    skipped = [r for r in rows if "skipped" in r]
    assert [r["mesh"] for r in skipped] == ["data=1,fsdp=1,tensor=4"]
    assert "cannot be split evenly" in skipped[0]["skipped"]
    fits = [r for r in rows if r.get("fits")]
    assert result["train"]["roofline"]["step_s"] == min(r["step_s"] for r in fits)
    assert result["train"]["mesh"] in {r["mesh"] for r in fits}


@pytest.mark.slow
@pytest.mark.parametrize("strategy,mesh", [("jit", "data=2,fsdp=2,tensor=2"),
                                           ("shard_map", "data=8")])
def test_abstract_state_matches_the_real_state_without_allocating(strategy, mesh):
    """What plan compiles against: the state's shapes, dtypes and shardings, from shapes only."""
    import numpy as np

    from transformers_jax.learning.optim import make_optimizer
    from transformers_jax.models import build_model
    from transformers_jax.parallel import make_trainer

    model_cfg = TINY.replace(attention="xla", dtype="float32", max_len=16)
    example = {"inputs": np.zeros((8, 16), np.int32), "targets": np.zeros((8, 16), np.int32)}
    trainer = make_trainer(strategy, build_model(model_cfg), make_optimizer(TINY_TRAIN),
                           example, mesh=mesh)
    abstract, real = trainer.abstract_state(), trainer.init_state(0)
    pairs = zip(jax.tree.leaves(abstract), jax.tree.leaves(real), strict=True)
    for shape, array in pairs:
        assert isinstance(shape, jax.ShapeDtypeStruct)
        assert (shape.shape, shape.dtype) == (array.shape, array.dtype)
        assert shape.sharding.is_equivalent_to(array.sharding, array.ndim)
    batch = trainer.abstract_batch(example)
    assert batch["inputs"].sharding.spec[0] in ("data", ("data", "fsdp"))


def _lowered_train_step(model_cfg: ModelConfig, devices) -> str:
    """StableHLO of the "single" strategy's train step lowered for ``devices``."""
    from transformers_jax.learning.objectives import objective_for
    from transformers_jax.learning.optim import make_optimizer
    from transformers_jax.models import build_model
    from transformers_jax.parallel.mesh import make_mesh
    from transformers_jax.parallel.strategies import make_trainer
    from transformers_jax.plan.steps import example_batch, host_zeros

    cfg = TINY_TRAIN.replace(strategy="single", mesh=None)
    batch = example_batch(model_cfg, cfg.batch_size, cfg.seq_len)
    trainer = make_trainer(cfg.strategy, build_model(model_cfg), make_optimizer(cfg),
                           host_zeros(batch), mesh=make_mesh(cfg.mesh, devices=devices),
                           objective=objective_for(model_cfg.family))
    return trainer.lower(trainer.abstract_state(), trainer.abstract_batch(batch)).as_text()


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_only_gradients_stay_out_of_the_tpu_program(dtype):
    """Issue 17: nothing done for the CPU may change the accelerator program. The CPU backend's
    gradients (``backends.cpu``: Dense kernel gradients computed in another orientation behind
    an ``optimization_barrier``, the chunked kernel's k^T kept as a copy) follow the platform
    compiled for: lowered for a TPU the train step has none of them; lowered for this host it
    has them (so the check can fail)."""
    model_cfg = TINY.replace(dtype=dtype, attention="chunked")  # MLP down: I > O (256 -> 64)
    on_tpu = _lowered_train_step(model_cfg, planning.tpu_target(TOPOLOGY).devices[:1])
    on_cpu = _lowered_train_step(model_cfg, jax.devices("cpu")[:1])
    assert on_cpu.count("optimization_barrier") >= 2  # a kernel gradient and the attention's k^T
    assert "optimization_barrier" not in on_tpu


@needs_libtpu
def test_the_decoding_loop_with_its_cpu_compile_option_compiles_for_tpu():
    """``generate_tokens`` takes its compile options from the backend compiled for: under a TPU
    mesh none of XLA:CPU's (a pass the TPU compiler does not have), and the loop compiles."""
    import flax.linen as nn
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from transformers_jax import backends
    from transformers_jax.models import build_model
    from transformers_jax.parallel import make_mesh
    from transformers_jax.sample import SamplingConfig, generate_tokens

    model = build_model(TINY)
    mesh = make_mesh("data=1", devices=planning.tpu_target(TOPOLOGY).devices[:1])
    whole = NamedSharding(mesh, P())

    def placed(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=whole)

    params = jax.eval_shape(lambda: nn.meta.unbox(
        model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]))
    args = (jax.tree.map(placed, params), placed(jnp.zeros((2, 8), jnp.int32)),
            placed(jnp.zeros((2,), jnp.int32)), placed(jax.random.key(0)))
    with jax.set_mesh(mesh):
        assert dict(backends.current().programs.decode_compiler_options) == {}
        compiled = generate_tokens.lower(
            model, *args, cfg=SamplingConfig(max_new_tokens=4, temperature=0.0)).compile()
    assert "generate_tokens" in compiled.as_text().splitlines()[0]  # the HloModule line
    assert compiled.memory_analysis().argument_size_in_bytes > 0


def test_lora_memory_counts_the_adapters_by_hand():
    """Rank 4 on q, k, v, o of TINY (C 64, 4 query heads and 2 kv heads of 16): per layer
    r (C + 64) for q and o, r (C + 32) for k and v; float32, AdamW's two moments."""
    got = planning.lora_memory(TINY, TINY_TRAIN.replace(lora=LoraConfig(rank=4, alpha=8.0)))
    adapters = 4 * (2 * (64 + 64) + 2 * (64 + 32))
    assert got["trainable_params"] == adapters == 1792
    assert got["frozen_params"] == TINY_PARAMS
    assert got["adapter_bytes"] == 4 * adapters
    assert got["optimizer_state_bytes"] == 2 * 4 * adapters
    assert got["full_finetune_optimizer_state_bytes"] == 2 * 4 * TINY_PARAMS
    assert got["kept_between_steps_bytes"] == 4 * TINY_PARAMS + 4 * 4 * adapters
    assert got["rank"] == 4 and got["alpha"] == 8.0
    assert got["targets"] == ["query", "key", "value", "out"]


@needs_libtpu
@pytest.mark.slow
def test_plan_with_lora_reports_the_adapters_and_a_smaller_step(capsys):
    argv = ["plan", "--target", TOPOLOGY, "--mesh", "data=4", "--batch", "4", "--seq-len",
            "128", "--no-decode", "--model.vocab_size=256", "--model.d_model=64",
            "--model.n_layers=1", "--model.n_heads=4", "--model.n_kv_heads=2",
            "--model.max_len=128", "--model.attention=xla", "--json"]
    results = {}
    for extra in ([], ["--train.lora.rank=4"]):
        assert main([*argv, *extra]) == 0
        results[bool(extra)] = json.loads(capsys.readouterr().out)
    full, lora = results[False], results[True]
    assert "lora" not in full
    assert lora["lora"]["trainable_params"] == 1792
    assert lora["lora"]["frozen_params"] == full["train"]["params"]
    # the compiled step holds AdamW moments for the adapters only: its arguments shrink by
    # the base's two moments less the adapters and theirs (float32, replicated over data=4:
    # whole on each device), to within what the TPU layouts' tile padding adds (7% here)
    shrink = full["train"]["memory"]["argument_bytes"] - lora["train"]["memory"]["argument_bytes"]
    assert shrink == pytest.approx(
        lora["lora"]["full_finetune_optimizer_state_bytes"]
        - lora["lora"]["optimizer_state_bytes"] - lora["lora"]["adapter_bytes"], rel=0.1)


@needs_libtpu
@pytest.mark.slow
def test_context_mesh_plans_each_way_across_shards(monkeypatch):
    """On a mesh that splits sequences the plan compiles all-gather and ring, counts what each
    sends (the ring's hops are collective-permutes) and names the faster; --search tries each
    way on such a mesh."""
    target = planning.tpu_target(TOPOLOGY)
    model = TINY.replace(attention="xla")
    cfg = TINY_TRAIN.replace(mesh="data=1,context=4", seq_len=128)  # 4 shards of 32
    result = planning.plan(model, cfg, target, decode=False)
    assert result["train"]["context_attention"] == "all_gather"
    methods = result["context"]["methods"]
    assert list(methods) == list(CONTEXT_ATTENTION)  # every way, as registered
    for ring in (m for m in methods if m.startswith("ring")):
        assert "collective-permute" in methods[ring]["collectives"]
    assert "collective-permute" not in methods["all_gather"]["collectives"]
    assert methods["all_gather"]["step_s"] == result["train"]["roofline"]["step_s"]
    fastest = min(methods, key=lambda m: methods[m]["step_s"])
    assert result["context"]["cheaper"] == fastest
    # a kernel that masks by array index cannot take gathered keys: the ring alone (the
    # configured zigzag's plan given, the plain ring compiled)
    only_ring = planning.compare_context_methods(
        TINY.replace(attention="pallas"), cfg.replace(context_attention="ring_zigzag"), target,
        {"mesh": "data=1,fsdp=1,context=4,tensor=1", "memory": {"fits": False},
         "roofline": None})
    assert list(only_ring["methods"]) == [m for m in CONTEXT_ATTENTION if m != "all_gather"]
    monkeypatch.setattr(planning.steps, "candidate_meshes",
                        lambda *a, **k: ["data=1,fsdp=1,context=4,tensor=1"])
    found = planning.search(model, cfg, target, ("none",), log=lambda _: None)
    assert [r.get("context_attention") for r in found["tried"]] == list(CONTEXT_ATTENTION)
    assert found["best"]["roofline"]["step_s"] == pytest.approx(methods[fastest]["step_s"])
