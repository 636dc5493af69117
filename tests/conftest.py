"""Test configuration shared by the whole suite.

The suite runs on 8 emulated CPU devices, so that meshes such as (2, 4) or (8,)
exist on any laptop or CI box. XLA reads XLA_FLAGS once, when the backend is
first created, so the flag must be in the environment before jax is imported.

``make test`` runs the suite in 2 pytest-xdist worker processes
(``-n 2 --dist loadfile``). Each worker is a fresh interpreter that imports
this file before any test module, so each sets the flag and gets its own 8
devices (checked below, per process); a test file runs in one worker, so its
module fixtures and jit caches are built once. The "ci" hypothesis profile is
loaded in every worker, so every worker's examples are derandomized.
"""

import atexit
import os
import re
import shutil
import tempfile

_DEVICE_COUNT = 8
_FLAG = f"--xla_force_host_platform_device_count={_DEVICE_COUNT}"
# XLA's CPU backend at LLVM's -O1, not its default -O2: a quarter of every
# compile here, and the suite compiles ~1000 programs. What the tests check
# is decided before LLVM runs (the HLO gshard emits, its collectives, buffer
# assignment, i.e. memory_analysis) or is a value compared with the one-device
# program compiled with the same flags, within a bound derived from the
# arithmetic. (-O0 would halve the compiles again, but its programs round
# differently from -O2's in the last bits; -O1's gave -O2's bits on the
# programs compared.) Launched processes inherit the flags.
# ``GSHARD_TEST_XLA_OPT=1`` keeps XLA's default.
_OPT_FLAG = "--xla_backend_optimization_level=1"

# Append to any XLA_FLAGS already set, replacing an earlier device-count flag so
# the value is unambiguous.
_existing = re.sub(
    r"--xla_force_host_platform_device_count=\S*", "",
    os.environ.get("XLA_FLAGS", ""),
).split()
os.environ["XLA_FLAGS"] = " ".join(
    [*_existing, _FLAG, *([] if os.environ.get("GSHARD_TEST_XLA_OPT") == "1" else [_OPT_FLAG])])
# Run on the CPU host platform unless the caller chose a platform explicitly;
# on a machine with one accelerator jax.devices() would otherwise return 1 device.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must come after XLA_FLAGS is set)
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# In this process (an xdist worker, PYTEST_XDIST_WORKER=gw0, gw1, ..., or the
# only one): the flag took effect.
assert len(jax.devices()) == _DEVICE_COUNT, (
    f"expected {_DEVICE_COUNT} devices, got {jax.devices()}: jax was imported "
    f"before tests/conftest.py could set XLA_FLAGS={os.environ['XLA_FLAGS']!r}, "
    f"or JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')!r} selects a platform "
    f"with a different number of devices (worker "
    f"{os.environ.get('PYTEST_XDIST_WORKER', 'none')})"
)

# Compiled programs kept on disk for this process's run only: a fresh directory,
# removed at exit, so nothing carries over between runs. Tests compile the same
# program again under a new function object (each hypothesis example builds
# its step and its jax.jit reference anew and repeats shapes), which jax's
# in-memory caches, keyed by the function, miss; about one compile in five
# here is such a repeat. jax's persistent cache is
# keyed by the program's text, compile options and backend, so a repeat gets
# the same executable XLA would build again.
# ``GSHARD_TEST_XLA_CACHE=0`` compiles every program.
if os.environ.get("GSHARD_TEST_XLA_CACHE") != "0":
    _cache_dir = tempfile.mkdtemp(prefix="gshard-tests-xla-")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", _cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# Hypothesis: "ci" (default) is reproducible and bounded; jax compilation makes
# per-example time unpredictable, so no deadline. Select "dev" with
# HYPOTHESIS_PROFILE=dev for a longer, randomized search.
settings.register_profile("ci", deadline=None, max_examples=30, derandomize=True)
settings.register_profile("dev", deadline=None, max_examples=300)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def devices():
    """The 8 emulated devices, in jax's order."""
    devs = jax.devices()
    assert len(devs) == _DEVICE_COUNT
    return devs
