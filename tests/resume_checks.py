"""The exact-resume check shared by the data tests."""

import json

import numpy as np

from transformers_jax.data.pipeline import take


def assert_resumes_exactly(make, after=(0,), batches: int = 6) -> dict:
    """An iterator from ``make()``, saved after each count of batches in ``after`` (its state
    through JSON, as a checkpoint stores it) and restored into a fresh one, yields the same next
    ``batches`` batches, every key of them. Returns the last saved state."""
    for k in after:
        it = make()
        take(it, k)
        state = json.loads(json.dumps(it.get_state()))
        expected = take(it, batches)
        fresh = make()
        fresh.set_state(state)
        for a, b in zip(expected, take(fresh, batches), strict=True):
            for key in a:
                np.testing.assert_array_equal(a[key], b[key])
    return state
