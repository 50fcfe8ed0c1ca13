"""Golden parameter shapes: any change to a family's parameter tree fails here on purpose.

One JSON file per family x position scheme in ``tests/golden/``: the flattened parameter paths
(``encoder/layer_0/attention/query/kernel``) and their shapes, for a small fixed config. After an
intended change, regenerate them and review the diff:

    TJAX_REGEN_GOLDEN=1 python -m pytest -q tests/test_param_shapes.py

The schemes are every registered one (``model_helpers.POSITIONS``); a new scheme fails here
until its goldens exist: create only those with ``-k NAME`` added to the command above.
"""

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from model_helpers import POSITIONS

from transformers_jax import ModelConfig, build_model
from transformers_jax.models.heads import build_classifier

GOLDEN = Path(__file__).parent / "golden"
REGENERATE = os.environ.get("TJAX_REGEN_GOLDEN", "") not in ("", "0")
FAMILIES = ["gpt", "bert", "encdec"]
# Deliberately uneven sizes, so that a transposed or swapped dimension shows in the shapes.
BASE = dict(vocab_size=40, d_model=24, n_layers=2, n_heads=3, n_kv_heads=1, d_ff=56, max_len=20)


def param_shapes(model, *args, **kwargs) -> dict[str, list[int]]:
    """``{"a/b/kernel": [shape]}`` from abstract evaluation (nothing is computed)."""
    variables = jax.eval_shape(model.init, jax.random.key(0), *args, **kwargs)
    flat = jax.tree_util.tree_flatten_with_path(
        variables["params"], is_leaf=lambda x: hasattr(x, "unbox")
    )[0]
    shapes = {}
    for path, leaf in flat:
        leaf = leaf.unbox() if hasattr(leaf, "unbox") else leaf
        shapes["/".join(str(getattr(k, "key", k)) for k in path)] = list(leaf.shape)
    return dict(sorted(shapes.items()))


def shapes_for(family: str, position: str) -> dict[str, list[int]]:
    mask = "bidirectional" if family == "bert" else "causal"
    cfg = ModelConfig(family=family, position=position, mask=mask, **BASE)
    tokens = jnp.zeros((1, 8), jnp.int32)
    if family == "encdec":
        return param_shapes(build_model(cfg), tokens, encoder_inputs=tokens)
    return param_shapes(build_model(cfg), tokens)


def check_golden(name: str, shapes: dict) -> None:
    path = GOLDEN / f"{name}.json"
    if REGENERATE:
        GOLDEN.mkdir(exist_ok=True)
        lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in shapes.items()]
        path.write_text("{\n" + ",\n".join(lines) + "\n}\n")  # one parameter per line
        return
    if not path.exists():
        pytest.fail(f"no golden file {path}; create it with TJAX_REGEN_GOLDEN=1")
    expected = json.loads(path.read_text())
    added = sorted(set(shapes) - set(expected))
    removed = sorted(set(expected) - set(shapes))
    changed = sorted(k for k in set(shapes) & set(expected) if shapes[k] != expected[k])
    assert not (added or removed or changed), (
        f"parameter tree of {name} changed: added {added}, removed {removed}, changed "
        f"{[(k, expected[k], shapes[k]) for k in changed]}; if intended, regenerate with "
        "TJAX_REGEN_GOLDEN=1 and review the diff"
    )


def _cases():
    """Every family x scheme; the quick tier (``-m "not slow"``) checks each scheme once, the
    families in turn (each family at least once), and CI the whole product."""
    for family in FAMILIES:
        for i, position in enumerate(POSITIONS):
            quick = FAMILIES[i % len(FAMILIES)] == family
            yield pytest.param(family, position, id=f"{family}-{position}",
                               marks=() if quick else pytest.mark.slow)


@pytest.mark.parametrize("family, position", list(_cases()))
def test_parameter_shapes_match_golden(family, position):
    check_golden(f"{family}_{position}", shapes_for(family, position))


@pytest.mark.parametrize("kind", ["sequence", "token"])
def test_classifier_parameter_shapes_match_golden(kind):
    cfg = ModelConfig(family="bert", position="rope", mask="bidirectional", **BASE)
    model = build_classifier(cfg, num_labels=5, kind=kind)
    check_golden(f"bert_{kind}_classifier_rope", param_shapes(model, jnp.zeros((1, 8), jnp.int32)))


def test_a_changed_tree_fails(monkeypatch):
    monkeypatch.setattr(__import__(__name__), "REGENERATE", False)
    shapes = shapes_for("gpt", "rope")
    grown = {**shapes, "embed/tokens/embedding": [41, 24]}
    with pytest.raises(AssertionError, match="changed"):
        check_golden("gpt_rope", grown)
    with pytest.raises(AssertionError, match="removed"):
        check_golden("gpt_rope", {k: v for k, v in shapes.items() if "final_norm" not in k})
