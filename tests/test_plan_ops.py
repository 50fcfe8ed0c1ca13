"""plan.ops: the per-operation roofline, on hand-written HLO with worked numbers and on a real
compile for TPU v5e (libtpu; skipped without it, as in test_plan.py)."""

from __future__ import annotations

import importlib.util

import jax
import pytest

from transformers_jax import plan as planning
from transformers_jax.config import ModelConfig, TrainConfig
from transformers_jax.plan.hlo import Module
from transformers_jax.plan.ops import op_roofline

V5E = planning.CHIPS["v5e"]  # 197e12 FLOP/s bf16, 819e9 B/s HBM, 400e9 B/s ICI over 4 links
TARGET = planning.Target("v5e:2x2", V5E, tuple(range(4)), chips=4, slices=1, hosts=1)

DOT_2048 = 2 * 2048**3 / 197e12  # a bf16 2048^3 matmul: 683 FLOP per byte, compute-bound
ADD_1M = 3 * 4 * 2**20 / 819e9  # f32[1024,1024] + f32[1024,1024]: 12 MiB moved, memory-bound
# all-gather to f32[4096,1024] over 4 chips of a 2x2 torus: 3/4 of 16 MiB sent per device, a
# ring over both axes: 2 of 4 links' share of 400 GB/s
GATHER = 0.75 * 16 * 2**20 / 200e9

PARAMS = """
  %a = bf16[2048,2048]{1,0} parameter(0)
  %b = bf16[2048,2048]{1,0} parameter(1)
  %x = f32[1024,1024]{1,0} parameter(2)
  %y = f32[1024,1024]{1,0} parameter(3)
  %w = f32[1024,1024]{1,0} parameter(4)"""
DOT = ("  %dot.1 = bf16[2048,2048]{1,0} dot(%a, %b), lhs_contracting_dims={1}, "
       "rhs_contracting_dims={0}")
ADD = "  %add.1 = f32[1024,1024]{1,0} add(%x, %y)"


def entry(*lines: str) -> str:
    return "\n".join(["ENTRY %main (p: f32[]) -> f32[] {", PARAMS, *lines, "}"])


def test_a_large_matmul_costs_its_flops_at_the_mxu_peak():
    line = op_roofline(Module.parse(entry(DOT)), TARGET, model_flops=2 * 2048**3)
    assert line["step_s"] == pytest.approx(DOT_2048, rel=1e-9)
    assert line["split"]["matmul"] == pytest.approx(DOT_2048, rel=1e-9)
    assert line["mfu"] == pytest.approx(1.0)
    assert line["top_ops"][0]["name"] == "dot.1" and line["top_ops"][0]["bound"] == "matmul"


def test_an_elementwise_add_costs_its_bytes_at_hbm_bandwidth():
    line = op_roofline(Module.parse(entry(ADD)), TARGET, model_flops=0.0)
    assert line["step_s"] == pytest.approx(ADD_1M, rel=1e-9)
    assert line["split"]["memory_bound"] == pytest.approx(ADD_1M, rel=1e-9)
    assert line["hbm_bytes"] == 3 * 4 * 2**20


LOOP = """
%body (state: (s32[], bf16[2048,2048])) -> (s32[], bf16[2048,2048]) {
  %state = (s32[], bf16[2048,2048]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %a = bf16[2048,2048]{1,0} get-tuple-element(%state), index=1
  %dot.2 = bf16[2048,2048]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], bf16[2048,2048]{1,0}) tuple(%next, %dot.2)
}

%cond (state: (s32[], bf16[2048,2048])) -> pred[] {
  %state = (s32[], bf16[2048,2048]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: bf16[2048,2048]) -> bf16[2048,2048] {
  %a = bf16[2048,2048]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[2048,2048]{1,0}) tuple(%zero, %a)
  %loop = (s32[], bf16[2048,2048]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %r = bf16[2048,2048]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_a_loop_body_costs_as_often_as_it_runs():
    line = op_roofline(Module.parse(LOOP), TARGET, model_flops=4 * 2 * 2048**3)
    # four matmuls; the counter's scalar add and compare add about 1e-11 s
    assert line["step_s"] == pytest.approx(4 * DOT_2048, rel=1e-5)
    assert line["mxu_flops"] == 4 * 2 * 2048**3
    assert line["top_ops"][0] == pytest.approx(
        {"name": "dot.2", "op": "dot", "runs": 4.0, "est_s": 4 * DOT_2048, "bound": "matmul",
         "flops": 2 * 2048**3, "bytes": 3 * 2 * 2048**2})


COND = """
%update (a: bf16[2048,2048]) -> bf16[2048,2048] {
  %a = bf16[2048,2048]{1,0} parameter(0)
  %d1 = bf16[2048,2048]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %d2 = bf16[2048,2048]{1,0} dot(%d1, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%skip (a: bf16[2048,2048]) -> bf16[2048,2048] {
  ROOT %a = bf16[2048,2048]{1,0} parameter(0)
}

ENTRY %main (a: bf16[2048,2048], p: pred[]) -> bf16[2048,2048] {
  %a = bf16[2048,2048]{1,0} parameter(0)
  %p = pred[] parameter(1)
  %dot.0 = bf16[2048,2048]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %c = bf16[2048,2048]{1,0} conditional(%p, %dot.0, %dot.0), BRANCHES
}
""".replace("BRANCHES", "true_computation=%update, false_computation=%skip")


def test_a_conditional_counts_its_dearest_branch_in_the_step_and_its_split():
    """One branch of a conditional runs (a step that skips a bad update): the step and its
    split both count the dearer branch, so they agree (they once summed every branch)."""
    line = op_roofline(Module.parse(COND), TARGET, model_flops=3 * 2 * 2048**3)
    assert line["step_s"] == pytest.approx(3 * DOT_2048, rel=1e-5)
    assert sum(line["split"].values()) == pytest.approx(line["step_s"], rel=1e-12)
    assert line["split"]["matmul"] == pytest.approx(3 * DOT_2048, rel=1e-5)


GATHER_START = ("  %ags = (f32[1024,1024]{1,0}, f32[4096,1024]{1,0}) all-gather-start(%w), "
                "channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}")
GATHER_DONE = "  %agd = f32[4096,1024]{1,0} all-gather-done(%ags)"
ALL_REDUCE = ("  %ar = f32[1024,1024]{1,0} all-reduce(%w), channel_id=2, "
              "replica_groups=[1,4]<=[4], to_apply=%sum")


def test_an_async_collective_hides_behind_the_compute_between_its_start_and_done():
    hidden = op_roofline(Module.parse(entry(GATHER_START, DOT, GATHER_DONE)), TARGET, 0.0)
    assert hidden["collective_transfer_s"] == pytest.approx(GATHER, rel=1e-9)
    assert GATHER < DOT_2048  # so the matmul covers it
    assert hidden["split"]["exposed_collectives"] == 0.0
    assert hidden["step_s"] == pytest.approx(DOT_2048, rel=1e-9)
    # nothing between start and done: the whole transfer shows
    bare = op_roofline(Module.parse(entry(GATHER_START, GATHER_DONE, DOT)), TARGET, 0.0)
    assert bare["split"]["exposed_collectives"] == pytest.approx(GATHER, rel=1e-9)
    assert bare["step_s"] == pytest.approx(DOT_2048 + GATHER, rel=1e-9)


def test_a_synchronous_collective_is_exposed_and_rings_over_the_torus():
    line = op_roofline(Module.parse(entry(DOT, ALL_REDUCE)), TARGET, 0.0)
    ring = 2 * 3 / 4 * 4 * 2**20  # all-reduce: 2 (n-1)/n of the 4 MiB result per device
    assert line["collective_bytes"] == ring
    assert line["split"]["exposed_collectives"] == pytest.approx(ring / 200e9, rel=1e-9)
    assert line["step_s"] == pytest.approx(DOT_2048 + ring / 200e9, rel=1e-9)
    assert line["top_collectives"][0]["kind"] == "all-reduce"


def test_an_async_start_moves_its_results_not_its_operands():
    """XLA's GPU compiler writes an async start's shape as (operands, results); a combined
    all-gather delivers every whole array, a reduce-scatter only its shard."""
    scatter = ("  %rss = ((f32[4096,1024]{1,0}), f32[1024,1024]{1,0}) reduce-scatter-start(%w), "
               "channel_id=4, replica_groups=[1,4]<=[4], dimensions={0}, to_apply=%sum\n"
               "  %rsd = f32[1024,1024]{1,0} reduce-scatter-done(%rss)")
    line = op_roofline(Module.parse(entry(scatter)), TARGET, 0.0)
    assert line["collective_bytes"] == 3 * 4 * 2**20  # (n-1) shards of 4 MiB
    gathers = ("  %ags = ((f32[256]{0}, f32[1024]{0}), (f32[1024]{0}, f32[4096]{0})) "
               "all-gather-start(%a, %b), channel_id=5, replica_groups=[1,4]<=[4], "
               "dimensions={0}\n  %agd = (f32[1024]{0}, f32[4096]{0}) all-gather-done(%ags)")
    line = op_roofline(Module.parse(entry(gathers)), TARGET, 0.0)
    assert line["collective_bytes"] == 3 / 4 * 4 * (1024 + 4096)  # both whole arrays


FLASH = ("  %q = bf16[2,4,1024,128]{3,2,1,0} parameter(5)\n"
         "  %k = bf16[2,4,1024,128]{3,2,1,0} parameter(6)\n"
         "  %flash_attention.1 = bf16[2,4,1024,128]{3,2,1,0} custom-call(%q, %k, %k), "
         'custom_call_target="tpu_custom_call"')


def test_a_flash_attention_kernel_costs_its_matmuls_from_its_shapes():
    from transformers_jax.plan.ops import KERNEL_EFFICIENCY

    causal = op_roofline(Module.parse(entry(FLASH)), TARGET, 0.0, causal=True)
    flops = 2 * 2 * (2 * 4 * 1024 * 1024 * 128) / 2  # QK and PV; causal skips half the blocks
    assert causal["mxu_flops"] == flops and causal["opaque_custom_calls"] == []
    assert causal["step_s"] == pytest.approx(flops / (197e12 * KERNEL_EFFICIENCY), rel=1e-9)
    full = op_roofline(Module.parse(entry(FLASH)), TARGET, 0.0, causal=False)
    assert full["mxu_flops"] == 2 * flops


# cuDNN's fused attention as XLA's GPU compiler writes it: q, k, v [B, T, H, D]
CUDNN = ("  %q = bf16[2,1024,4,128]{3,2,1,0} parameter(5)\n"
         "  %k = bf16[2,1024,4,128]{3,2,1,0} parameter(6)\n"
         "  %dot_product_attention_fwd.1 = (bf16[2,4,1024,128]{3,1,2,0}, f32[2,4,1024]{2,1,0}, "
         "u8[0]{0}) custom-call(%q, %k, %k), custom_call_target=\"__cudnn$fmhaSoftmax\"\n"
         "  %dot_product_attention_bwd.1 = (bf16[2,4,1024,128]{3,1,2,0}, bf16[2,4,1024,128]"
         "{3,1,2,0}, bf16[2,4,1024,128]{3,1,2,0}, u8[0]{0}) custom-call(%q, %k, %k), "
         "custom_call_target=\"__cudnn$fmhaSoftmaxBackward\"")


def test_cudnn_attention_costs_its_matmuls_from_its_shapes():
    line = op_roofline(Module.parse(entry(CUDNN)), TARGET, 0.0, causal=True)
    one = 2 * 2 * 4 * 1024 * 1024 * 128 / 2  # one causal (T x S x D) matmul over b and h
    assert line["mxu_flops"] == (2 + 5) * one  # forward QK, PV; backward five
    assert line["opaque_custom_calls"] == []


def test_a_mesh_axis_collective_rings_over_that_axis_only():
    # the TPU compiler's form: groups along 'x' (2 of the 2 x 2 devices), device ids between
    gather = ("  %ag = f32[4096,1024]{1,0} all-gather(%w), channel_id=3, replica_groups="
              "mesh['x'=2,'y'=2], device_ids=([2,2]T(1,0)) {'x'}, dimensions={0}")
    line = op_roofline(Module.parse(entry(gather)), TARGET, 0.0)
    assert line["collective_bytes"] == 0.5 * 16 * 2**20  # (n-1)/n with n = 2, not 4
    assert line["split"]["exposed_collectives"] == pytest.approx(8 * 2**20 / 100e9, rel=1e-9)


# libtpu: a real compile for TPU v5e 2x2 ---------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu not installed (pip install -e '.[tpu]')")
@pytest.mark.slow
def test_a_compiled_step_splits_into_operations_that_sum_to_the_step():
    tiny = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                       max_len=128, dtype="bfloat16", dropout=0.0, scan_layers=True)
    cfg = TrainConfig(batch_size=8, seq_len=128, strategy="jit", mesh="data=2,fsdp=2,tensor=1")
    with jax.default_matmul_precision("default"):  # conftest's float32 is not for Mosaic
        got = planning.compile_train(tiny, cfg, planning.tpu_target("v5e:2x2"))
    line = got["roofline"]
    assert sum(line["split"].values()) == pytest.approx(line["step_s"], rel=1e-9)
    # the matmuls counted per operation, loops included, are XLA's (loop-aware) FLOPs
    assert line["mxu_flops"] == pytest.approx(got["flops_per_device"], rel=0.25)
    assert line["step_s"] >= line["mxu_flops"] / V5E.peak_flops
    est = [op["est_s"] for op in line["top_ops"]]
    assert est == sorted(est, reverse=True) and est[0] > 0
    assert line["collective_bytes"] > 0 and line["top_collectives"]  # FSDP gathers
    assert 0 < line["mfu"] <= 1 and line["whole_program"]["step_s"] > 0  # the old, kept
