"""Helpers shared by the model-family tests (test_encdec, test_bert, test_mlm, test_families)."""

import jax

# The suite compiles with XLA's backend optimisation off (tests/conftest.py): right for the
# thousands of programs run once or twice, wrong for a training loop that runs one program
# hundreds of times. With it back on for that one program an encoder-decoder step takes 13 ms
# instead of 25 (measured on the 2-core CI machine), for about 1 s more compile.
OPTIMISED = {"xla_backend_optimization_level": 3}


def jit_optimised(fn, **kwargs):
    """``jax.jit(fn)`` compiled with XLA's full backend optimisation (a training step)."""
    return jax.jit(fn, compiler_options=OPTIMISED, **kwargs)

