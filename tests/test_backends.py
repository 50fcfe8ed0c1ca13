"""``backends``: what a platform adds to the model's maths, chosen by the platform compiled for.

On this host (XLA:CPU) the CPU backend's hooks act; traced for a TPU topology's devices (a mesh
in context, as every step ``parallel.make_trainer`` builds is traced) the generic backend's
plain maths do, and the row groups and decoding options of the CPU are refused or absent.
The numbers of the CPU hooks are checked in ``test_matmul.py``, ``test_kvcache.py`` and
``test_sample.py``; the whole TPU training step in ``test_plan.py``.
"""

from __future__ import annotations

import importlib.util
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformers_jax import backends
from transformers_jax.backends.cpu import CpuMaths, CpuPrograms
from transformers_jax.backends.generic import Backend, Maths
from transformers_jax.config import ConfigError, ModelConfig
from transformers_jax.registry import ATTENTION

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu not installed (pip install -e '.[tpu]'): no TPU topology to compile for")


@pytest.fixture(scope="module")
def tpu_mesh():
    from transformers_jax import plan as planning
    from transformers_jax.parallel import make_mesh

    return make_mesh("data=1", devices=planning.tpu_target("v5e:2x2").devices[:1])


def _ops(fn, *args) -> set[str]:
    """The primitives of ``fn``'s jaxpr, nested ones included."""
    names = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            names.add(eqn.primitive.name)
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return names


def test_this_host_gets_the_cpu_backend_and_other_platforms_the_generic_one():
    assert jax.default_backend() == "cpu"  # conftest: the suite runs on XLA:CPU
    assert isinstance(backends.current().maths, CpuMaths)
    assert isinstance(backends.current().programs, CpuPrograms)
    assert backends.for_devices(jax.devices()[:2]) is backends.for_platform("cpu")
    for platform, named in (("tpu", "tpu"), ("cuda", "gpu"), ("rocm", "gpu"), ("gpu", "gpu")):
        backend = backends.for_devices([types.SimpleNamespace(platform=platform)])
        assert backend.generic and backend.platform == named
    assert backends.platform_of(types.SimpleNamespace(platform="cuda")) == "gpu"
    with pytest.raises(ValueError, match=r"one platform expected, got \['cpu', 'tpu'\]"):
        backends.for_devices([jax.devices()[0], types.SimpleNamespace(platform="tpu")])
    # inside a shard_map over this host's devices: still the CPU
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])
    seen = []

    def body(x):
        seen.append(backends.current())
        return x

    jax.shard_map(body, mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P("data"))(
        jnp.zeros(4))
    assert isinstance(seen[0].maths, CpuMaths)


@needs_libtpu
def test_a_tpu_mesh_in_context_chooses_the_generic_backend(tpu_mesh):
    with jax.set_mesh(tpu_mesh):
        assert backends.current() is backends.for_platform("tpu")
        assert backends.current().generic
        assert backends.platform_compiled_for() == "tpu"
    with jax.sharding.use_abstract_mesh(tpu_mesh.abstract_mesh):  # what eval_shape traces use
        assert backends.current() is backends.for_platform("tpu")
    assert backends.for_devices(tpu_mesh.devices.flat) is backends.for_platform("tpu")
    assert isinstance(backends.current().maths, CpuMaths)  # and back


@needs_libtpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_neutral_calls_are_the_plain_maths_for_a_tpu_and_the_cpu_rules_here(tpu_mesh,
                                                                                 dtype):
    x = jnp.ones((8, 32), dtype)
    w = jnp.ones((32, 16), dtype)  # in > out: the CPU computes the kernel gradient transposed

    def grads(x, w):
        loss = backends.matmul(x, w).sum() + backends.matmul_transposed(x, w.T).sum()
        return loss + backends.materialised(w.T).sum()

    here = _ops(jax.grad(grads, argnums=(0, 1)), x, w)
    assert {"custom_vjp_call", "optimization_barrier"} <= here, here
    with jax.set_mesh(tpu_mesh):
        there = _ops(jax.grad(grads, argnums=(0, 1)), x, w)
    assert not {"custom_vjp_call", "optimization_barrier"} & there, there
    assert "dot_general" in there


@needs_libtpu
def test_the_activation_runs_in_float32_on_the_cpu_only(tpu_mesh):
    """The MLP's activation: XLA:CPU gets it in float32, rounded back once; the TPU program
    keeps the compute dtype (a float32 copy of the hidden would be kept for the backward)."""
    x = jnp.linspace(-3, 3, 64, dtype=jnp.bfloat16).reshape(8, 8)

    def gelu(x):  # tanh-shaped, in the input's dtype (jax.nn.gelu converts a constant itself)
        return x * (1 + jnp.tanh(x)) / 2

    def float32_hidden() -> bool:  # a float32 array of the hidden's shape in fwd or bwd
        def backward(x):  # forward and backward, a cotangent in the compute dtype
            out, pull = jax.vjp(lambda x: backends.elementwise(gelu, x), x)
            return pull(jnp.ones_like(out))

        jaxpr = jax.make_jaxpr(backward)(x)
        return any(v.aval.dtype == jnp.float32 and v.aval.shape == x.shape
                   for eqn in jaxpr.jaxpr.eqns for v in eqn.outvars)

    here = backends.elementwise(gelu, x)
    assert here.dtype == jnp.bfloat16 and float32_hidden()
    np.testing.assert_array_equal(here, gelu(x.astype(jnp.float32)).astype(jnp.bfloat16))
    with jax.set_mesh(tpu_mesh):  # traced only: this host runs no TPU program
        assert not float32_hidden()
    np.testing.assert_array_equal(Maths().elementwise(gelu, x), gelu(x))


@needs_libtpu
def test_the_cache_write_is_tied_to_the_read_on_the_cpu_only(tpu_mesh):
    kv = (jnp.ones((1, 2, 1, 4)), jnp.full((1, 2, 1, 4), 2.0))
    read = jnp.array([[jnp.nan, 1.0]])
    tied = backends.ordered_after(kv, read)
    for a, b in zip(tied, kv, strict=True):  # the same values, finite even after a NaN read
        np.testing.assert_array_equal(a, b)
    assert "is_finite" in _ops(lambda r: backends.ordered_after(kv, r), read)
    with jax.set_mesh(tpu_mesh):
        assert backends.ordered_after(kv, read) is kv


@needs_libtpu
def test_a_decoding_step_reads_first_only_for_one_row_on_the_cpu(tpu_mesh):
    assert backends.decode_reads_first(1) and not backends.decode_reads_first(4)
    with jax.set_mesh(tpu_mesh):  # a TPU program writes first, whatever the batch
        assert not backends.decode_reads_first(1) and not backends.decode_reads_first(4)
    assert not Backend("gpu").maths.decode_reads_first(1)


@needs_libtpu
def test_row_groups_are_refused_for_devices_other_than_a_cpu(tpu_mesh):
    """``train.concurrent_groups`` is the CPU backend's: a trainer for TPU devices (``tjax
    plan``'s) or a step built under a TPU mesh says so, rather than splitting for nothing."""
    from transformers_jax.config import TrainConfig
    from transformers_jax.learning.optim import make_optimizer
    from transformers_jax.learning.step import make_train_step
    from transformers_jax.models import build_model
    from transformers_jax.parallel.strategies import make_trainer

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_len=16)
    batch = {"inputs": np.zeros((4, 16), np.int32), "targets": np.zeros((4, 16), np.int32)}
    optimizer = make_optimizer(TrainConfig(steps=2))
    with pytest.raises(ConfigError, match=r"concurrent_groups=2: row groups .* XLA:CPU .* tpu"):
        make_trainer("jit", build_model(cfg), optimizer, batch, mesh=tpu_mesh, groups=2)
    with jax.set_mesh(tpu_mesh), pytest.raises(ConfigError, match="XLA:CPU setting"):
        make_train_step(build_model(cfg), optimizer, groups=2)
    make_trainer("jit", build_model(cfg), optimizer, batch, mesh=tpu_mesh, groups=1)


def test_the_decoding_options_are_the_cpus_alone():
    assert dict(backends.for_platform("cpu").programs.decode_compiler_options) == {
        "xla_disable_hlo_passes": "cpu-parallel-task-assigner"}
    for platform in ("tpu", "gpu", "some_new_platform"):
        backend = backends.for_platform(platform)
        assert backend.generic and backend.platform == platform
        assert dict(backend.programs.decode_compiler_options) == {}


def _host(tmp_path, vendors=(), devices=()):
    """A fake filesystem root with PCI devices of ``vendors`` and device files ``devices``."""
    for i, vendor in enumerate(vendors):
        folder = tmp_path / "sys/bus/pci/devices" / f"0000:00:0{i}.0"
        folder.mkdir(parents=True)
        (folder / "vendor").write_text(vendor + "\n")
    for name in devices:
        (tmp_path / "dev" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "dev" / name).write_text("")
    return str(tmp_path)


@pytest.mark.parametrize("environ, vendors, devices, installed, expected", [
    ({}, ["0x8086", "0x1af4"], [], {"libtpu"}, "cpu"),  # libtpu and no chip: probe skipped
    ({}, ["0x8086", "0x1ae0"], [], {"libtpu"}, None),  # a TPU chip on the PCI bus
    ({}, [], ["accel0"], {"libtpu"}, None),  # a TPU VM's device file
    ({}, [], ["vfio/0"], {"libtpu"}, None),
    ({}, [], [], set(), None),  # no libtpu: JAX probes nothing
    ({}, [], [], {"libtpu", "jax_cuda12_plugin"}, None),  # a GPU plugin: JAX's own choice
    ({"JAX_PLATFORMS": "tpu"}, [], [], {"libtpu"}, None),  # the user's setting
])
def test_the_tpu_probe_is_skipped_only_where_there_is_no_tpu(tmp_path, environ, vendors,
                                                             devices, installed, expected):
    """With libtpu installed and no TPU, JAX's start-up prints libtpu's errors before it picks
    the CPU: ``JAX_PLATFORMS=cpu`` is set instead, and only there."""
    from transformers_jax.backends.tpu_probe import skip_absent_tpu

    environ = dict(environ)
    before = dict(environ)
    root = _host(tmp_path, vendors, devices)
    got = skip_absent_tpu(environ, root, find_spec=lambda name: name in installed or None)
    assert got == expected
    assert environ == ({**before, "JAX_PLATFORMS": "cpu"} if expected else before)


def test_a_host_without_a_tpu_starts_jax_without_libtpu_errors():
    """This host (no TPU; libtpu from the tpu extra where installed): importing the package
    before JAX leaves nothing on stderr, and the CPU is the device."""
    import os
    import subprocess
    import sys

    from transformers_jax.backends.tpu_probe import has_tpu_chip

    if has_tpu_chip():
        pytest.skip("a TPU is present")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    done = subprocess.run(
        [sys.executable, "-c", "import transformers_jax, jax; print(jax.devices()[0].platform)"],
        capture_output=True, text=True, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "cpu", done.stderr
    assert done.stderr == "", done.stderr


@pytest.mark.parametrize("name", sorted(ATTENTION.names()))
def test_a_kernel_that_cannot_run_here_is_refused_before_any_work(name, monkeypatch):
    """Each kernel's platform_refusal answers for the platforms it declares; a training run on
    this CPU with one that cannot run here stops before its data is read, naming the fix."""
    from transformers_jax.config import TrainConfig
    from transformers_jax.train import loop

    entry = ATTENTION.get(name)()
    config = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_len=32)
    for platform in ("cpu", "gpu", "tpu"):
        refusal = entry.platform_refusal(platform, config)
        assert (refusal is None) == (platform in entry.backends), (platform, refusal)
    if "cpu" in entry.backends:
        return
    monkeypatch.setattr(loop, "plan_segment", lambda cfg: pytest.fail("work started"))
    with pytest.raises(ConfigError, match=rf"attention='{name}' runs on .* this run's devices "
                                          "are cpu; use attention=chunked"):
        loop.train(config.replace(attention=name), TrainConfig(steps=1, seq_len=16))
