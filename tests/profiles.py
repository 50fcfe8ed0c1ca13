"""How hard the property tests search: ``ci`` (the default, what `pytest` and CI run) or
``thorough`` (``TJAX_TEST_PROFILE=thorough``, before a release or after touching what a
property test covers). Hypothesis searches derandomized in both, so a failure reproduces;
``thorough`` tries more inputs. Profiles registered here are loaded by ``tests/conftest.py``."""

import os

from hypothesis import HealthCheck, settings

PROFILE = os.environ.get("TJAX_TEST_PROFILE", "ci")
if PROFILE not in ("ci", "thorough"):
    raise ValueError(f"TJAX_TEST_PROFILE={PROFILE!r}: use ci or thorough")

settings.register_profile("ci", derandomize=True, database=None, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", parent=settings.get_profile("ci"))
settings.load_profile(PROFILE)


def examples(ci: int, thorough: int) -> int:
    """Inputs a property test tries under the active profile: CI's number keeps the suite
    fast; the thorough number is the search the test was written for."""
    return thorough if PROFILE == "thorough" else ci
