"""Smoke test of the test environment itself: fast, and first to fail if the
venv or tests/conftest.py is broken."""

import jax


def test_eight_cpu_devices():
    devices = jax.devices()
    assert len(devices) == 8
    assert all(d.platform == "cpu" for d in devices)


def test_import_gshard():
    import gshard

    # A regular package, not a namespace package picked up from a bare folder.
    assert gshard.__file__ is not None


def test_hypothesis_ci_profile_is_derandomized():
    """The profile conftest loads (in every xdist worker): "ci" by default, whose
    examples are the same on every run and every machine."""
    import os

    from hypothesis import settings

    name = os.environ.get("HYPOTHESIS_PROFILE", "ci")
    assert settings.default == settings.get_profile(name)
    ci = settings.get_profile("ci")
    assert ci.derandomize and ci.database is None and ci.deadline is None
