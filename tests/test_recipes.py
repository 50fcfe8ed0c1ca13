"""The README's recipes for adding a variant, followed: each writes a toy entry into a module of
its own (as a contributor would write its file), and the registry's property suite runs on it
in a pytest process that registers it before collecting (``TJAX_TEST_EXTRA_ENTRIES``,
``conftest.py``). A recipe that no longer works, or a property suite that stopped taking its
cases from the registry, fails here."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TOY_POSITION = '''
"""A toy positional scheme: one distance penalty shared by every head, with a setting."""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformers_jax.nn.positions.base import PositionScheme, distance_BQK
from transformers_jax.registry import POSITIONS


class PenaltyBias(nn.Module):
    """``-slope * |i - j|`` for every head: ``(q_pos [B, Q], k_pos [B, K])`` to ``[B, H, Q, K]``."""

    n_heads: int
    slope: float

    def __call__(self, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
        dist_BQK = jnp.abs(distance_BQK(q_pos, k_pos)).astype(jnp.float32)
        B, Q, K = dist_BQK.shape
        return jnp.broadcast_to(-self.slope * dist_BQK[:, None], (B, self.n_heads, Q, K))


@POSITIONS.register("toy_penalty")
@dataclasses.dataclass(frozen=True)
class ToyPenalty(PositionScheme):
    slope: float = 0.25

    def bias(self, config: Any, bidirectional: bool) -> nn.Module:
        return PenaltyBias(config.n_heads, self.slope)
'''

TOY_ATTENTION = '''
"""A toy attention kernel: the reference's maths computed in float32 whatever the inputs."""

import dataclasses

import jax
import jax.numpy as jnp

from transformers_jax.nn.attention.implementations import AttentionImpl
from transformers_jax.nn.attention.reference import reference_attention
from transformers_jax.registry import ATTENTION


def toy_attention(q, k, v, *, bias, mask, scale, logit_softcap) -> jax.Array:
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    out = reference_attention(*up, bias=bias, mask=mask, scale=scale,
                              logit_softcap=logit_softcap)
    return out.astype(q.dtype)


@ATTENTION.register("toy_attention")
@dataclasses.dataclass(frozen=True)
class ToyAttention(AttentionImpl):
    def attend(self, q, k, v, **options) -> jax.Array:
        return toy_attention(q, k, v, **options)
'''

TOY_FAMILY = '''
"""A toy model family: each position predicts from the mean of the embeddings up to it."""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformers_jax.models.family import Family
from transformers_jax.registry import FAMILIES


class CumulativeMeanLM(nn.Module):
    """``tokens [B, T] -> logits [B, T, V]``, causal without attention."""

    config: Any

    @nn.compact
    def __call__(self, tokens_BT: jax.Array, *, deterministic: bool = True, **unused):
        x_BTC = nn.Embed(self.config.vocab_size, self.config.d_model)(tokens_BT)
        seen_T = jnp.arange(1, tokens_BT.shape[1] + 1, dtype=jnp.float32)
        mean_BTC = jnp.cumsum(x_BTC, axis=1) / seen_T[None, :, None]
        return nn.Dense(self.config.vocab_size)(mean_BTC).astype(jnp.float32)


FAMILIES.add("toy_family", Family(CumulativeMeanLM, objective="lm", tasks=None,
                                  recurrent=True, input_keys=()))
'''

# (recipe, toy module, the test files whose property tests take their cases from the registry)
RECIPES = {
    "positional scheme": (TOY_POSITION, "toy_penalty",
                          ["test_gpt.py", "test_kvcache.py", "test_bert.py", "test_encdec.py",
                           "test_positions_new.py"]),
    "attention kernel": (TOY_ATTENTION, "toy_attention",
                         ["test_attention.py"]),
    "model family": (TOY_FAMILY, "toy_family", ["test_families.py", "test_lstm.py"]),
}


def run_property_suite(tmp_path, source: str, name: str, files: list[str]):
    module = tmp_path / f"recipe_{name}.py"
    module.write_text(textwrap.dedent(source))
    env = {**os.environ, "TJAX_TEST_EXTRA_ENTRIES": str(module)}
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", name,
         *(str(ROOT / "tests" / f) for f in files)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_toy_entry_made_by_the_recipe_passes_the_property_suite(recipe, tmp_path):
    source, name, files = RECIPES[recipe]
    done = run_property_suite(tmp_path, source, name, files)
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= 3, tail  # the suite found the entry
