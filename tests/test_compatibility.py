"""The compatibility table (``transformers_jax/compatibility.py``): the documents show what the
registries' own checks say; every refusal names something that works; every supported cell of
a kernel that runs here trains and decodes to the reference kernel's numbers.

Parametrised over the registries, so a new scheme, kernel or mask is covered once registered.
"""

import re

import jax.numpy as jnp
import numpy as np
import pytest
from model_helpers import attention as attention_switch
from model_helpers import init, mask_settings, tiny
from readme_tables import COMBINATIONS, COMPATIBILITY, GENERATED, KERNELS, README, readme_table

from transformers_jax import ConfigError, build_model, compatibility
from transformers_jax.nn.kvcache import check_decoding
from transformers_jax.registry import ATTENTION, MASKS, POSITIONS

CPU_KERNELS = [k for k, impl in ATTENTION.items() if "cpu" in impl.backends and not impl.oracle]


def _combinations():
    for mask in MASKS.names():
        for position in POSITIONS.names():
            for kernel in ATTENTION.names():
                yield position, kernel, mask


def test_the_documents_show_the_generated_tables():
    """Regenerate with ``python tests/readme_tables.py`` after registering an entry."""
    for path, markers, table in GENERATED:
        if markers in (KERNELS, COMBINATIONS):
            assert readme_table(path.read_text(), markers) == table(), path.name
    assert "docs/compatibility.md" in README.read_text()
    assert COMPATIBILITY.exists()


def test_every_refusal_names_what_works():
    """A refused use's message names a kernel that serves it (and that kernel does), or a mask
    or setting to change (``use ...``, ``choose ...``)."""
    kernels = ATTENTION.names()
    refused = 0
    for position, kernel, mask in _combinations():
        cell = compatibility.support(position, kernel, mask)
        for use, why in cell.refusals.items():
            if why in (None, "n/a") or (use != "train" and not cell.ok("train")):
                continue  # a refused config answers every use with the same message
            refused += 1
            named = [k for k in kernels if k != kernel and re.search(rf"\b{k}\b", why)]
            if named:
                assert any(compatibility.support(position, k, mask).ok(use) for k in named), (
                    f"{use} {position}/{kernel}/{mask}: {why}"
                )
            else:
                assert re.search(r"\b(use|choose)\b", why), why
    assert refused > 0  # pallas refuses windows: the loop above checked something


def test_the_table_follows_the_checks():
    """Spot checks of the generated answers against what the library does when asked."""
    window = compatibility.support("alibi", "pallas", "sliding_window")
    assert not window.ok("train") and "use attention=chunked" in window.refusals["train"]
    with pytest.raises(ConfigError, match="use attention=chunked"):
        tiny(attention="pallas", mask={"name": "sliding_window", "window": 4})
    pallas = compatibility.support("rope", "pallas", "causal")
    assert pallas.ok("train") and pallas.ok("context:ring")
    assert not pallas.ok("decode") and not pallas.ok("context:all_gather")
    with pytest.raises(ConfigError, match="attention=chunked or xla"):
        check_decoding(tiny(attention="pallas"))
    assert compatibility.bias_only_on("alibi", "pallas", "causal") == ("tpu",)
    assert compatibility.bias_only_on("rope", "pallas", "causal") is None
    assert compatibility.support("rope", "xla", "bidirectional").refusals["decode"] is not None
    # randomized positions refuse the cache as set by default, and the fix they name works
    assert not compatibility.support("randomized", "chunked", "causal").ok("decode")
    check_decoding(tiny(position={"name": "randomized", "evaluate": "real"}))


def _quick_cells(cells):
    """A covering subset of the supported CPU cells for the quick tier: each position scheme
    once, on a diagonal through the masks and kernels, then whatever (kernel, mask) pair the
    diagonal missed. The rest (the full product, run by CI) only combine entries that these
    cells already check one by one."""
    cells = list(cells)
    positions = list(dict.fromkeys(p for p, _, _ in cells))
    kernels = list(dict.fromkeys(k for _, k, _ in cells))
    masks = list(dict.fromkeys(m for _, _, m in cells))
    quick = []
    for i, position in enumerate(positions):
        mask, kernel = masks[i % len(masks)], kernels[(i + i // len(masks)) % len(kernels)]
        mine = [c for c in cells if c[0] == position]
        quick.append((position, kernel, mask) if (position, kernel, mask) in mine else mine[0])
    for kernel in kernels:
        for mask in masks:
            pair = [c for c in cells if c[1:] == (kernel, mask)]
            if pair and not any(c[1:] == (kernel, mask) for c in quick):
                quick.append(pair[0])
    return set(quick)


def _cpu_cases():
    cells = [(position, kernel, mask) for position, kernel, mask in _combinations()
             if kernel in CPU_KERNELS and compatibility.support(position, kernel, mask).ok("train")]
    quick = _quick_cells(cells)
    for cell in cells:
        marks = () if cell in quick else pytest.mark.slow
        yield pytest.param(*cell, id="-".join(cell), marks=marks)


@pytest.mark.parametrize("position, kernel, mask", list(_cpu_cases()))
def test_supported_cells_give_the_reference_numbers(position, kernel, mask):
    """Training logits equal the reference kernel's; where decoding is supported, a prefill
    and greedy steps through the KV cache give the full forward pass's logits."""
    from transformers_jax.sample import decode_step, prefill

    cell = compatibility.support(position, kernel, mask)
    cfg = tiny(
        family=cell.config.family,
        position=position,
        attention=attention_switch(kernel),
        mask={"name": mask, **mask_settings(mask)},
        n_kv_heads=2,
        n_layers=1,
        init_std=0.3,
    )
    lengths = jnp.array([6], jnp.int32)
    inputs = {"prefix_len": lengths} if cfg.mask.needs_prefix_len else {}
    model, params, tokens = init(cfg, T=6, B=1, **inputs)
    ref = build_model(cfg.replace(attention="reference"))  # the same params, another kernel
    got = np.asarray(model.apply({"params": params}, tokens, **inputs))
    want = np.asarray(ref.apply({"params": params}, tokens, **inputs))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    if not cell.ok("decode"):
        return
    logits, cache = prefill(model, params, tokens, lengths, max_new_tokens=3)
    seq = tokens
    for _ in range(3):
        full = ref.apply({"params": params}, seq, **inputs)[:, -1]
        np.testing.assert_allclose(logits, full, atol=2e-5, rtol=1e-5)
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        seq = jnp.concatenate([seq, token[:, None]], axis=1)
        logits, cache = decode_step(model, params, token, cache)
