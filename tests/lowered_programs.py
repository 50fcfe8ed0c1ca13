"""Digests of the programs a refactor must leave alone: the initialisation and the train step
of every family x four position schemes x the CPU's attention kernels, lowered to StableHLO
(no locations, so moving code between files changes nothing).

Run it in two checkouts and compare (a checkout's own sources win over the editable install):

    (cd OLD && PYTHONPATH=. python tests/lowered_programs.py /tmp/old.json)
    (cd NEW && PYTHONPATH=. python tests/lowered_programs.py /tmp/new.json)
    python tests/lowered_programs.py --compare /tmp/old.json /tmp/new.json

Not a test: what it compares is two versions of the code.
"""

import sys

# the checkout on PYTHONPATH, not the one an editable install points at
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]

import hashlib  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402

FAMILIES, POSITIONS, KERNELS = ("gpt", "bert", "encdec"), ("rope", "t5", "alibi", "learned"), (
    "xla", "chunked", "reference")


def digests() -> dict[str, str]:
    import jax
    import jax.numpy as jnp

    from transformers_jax import ModelConfig
    from transformers_jax.config import TrainConfig
    from transformers_jax.learning.objectives import objective_for
    from transformers_jax.learning.optim import make_optimizer
    from transformers_jax.learning.step import init_state, make_train_step
    from transformers_jax.models import build_model

    out = {}
    ids = jnp.ones((2, 16), jnp.int32)
    weights = jnp.ones((2, 16), jnp.float32)
    for family, position, kernel in itertools.product(FAMILIES, POSITIONS, KERNELS):
        cfg = ModelConfig(family=family, vocab_size=64, d_model=32, n_layers=1, n_heads=2,
                          max_len=32, position=position, attention=kernel)
        model, objective = build_model(cfg), objective_for(family)
        optimizer = make_optimizer(TrainConfig(steps=10, warmup_steps=2))
        batch = {"inputs": ids, "targets": ids, "weights": weights}
        if family == "encdec":
            batch |= {"encoder_inputs": ids, "encoder_segment_ids": ids, "segment_ids": ids}
        init = jax.jit(lambda b, model=model, optimizer=optimizer, objective=objective:
                       init_state(model, optimizer, 0, b, objective))
        step = jax.jit(make_train_step(model, optimizer, objective=objective))
        text = init.lower(batch).as_text() + step.lower(jax.eval_shape(init, batch),
                                                        batch).as_text()
        out[f"{family}-{position}-{kernel}"] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return out


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        old, new = (json.load(open(p)) for p in sys.argv[2:4])
        changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
        print(f"{len(old) - len(changed)} of {len(old)} programs identical; changed: {changed}")
        sys.exit(1 if changed else 0)
    with open(sys.argv[1], "w") as f:
        json.dump(digests(), f, indent=1)
