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
