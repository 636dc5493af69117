"""Running scripts as several JAX processes from the tests (tests/test_multiprocess.py,
tests/test_checkpoint.py), through gshard.launch.

Every launch has a timeout. Launches of one test session share a persistent
compilation cache (a fresh directory per session): a program the processes
compiled once (the same HLO on the same topology) is loaded, not compiled
again, by the next launch, which keeps these tests fast. The executables are
the ones XLA built; nothing about the results depends on the cache.
"""

from __future__ import annotations

import io
import os
import sys

from gshard.launch import launch

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
LAUNCH_TIMEOUT = 420.0          # seconds for one whole launch, on a loaded 2-core box


def cache_dir(tmp_path_factory) -> str:
  """The session's compilation cache directory (created on first use)."""
  path = tmp_path_factory.getbasetemp() / "jax-compilation-cache"
  path.mkdir(exist_ok=True)
  return str(path)


def env_with_cache(cache: str | None) -> dict[str, str]:
  env = dict(os.environ)
  if cache:
    env["JAX_COMPILATION_CACHE_DIR"] = cache
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
  return env


def run_launch(command, processes: int, devices: int, *, cache: str | None = None,
               timeout: float = LAUNCH_TIMEOUT, **kw) -> tuple[int, str]:
  """``gshard.launch.launch`` in this process; returns (exit status, all output)."""
  buf = io.StringIO()
  rc = launch(list(command), processes, devices, timeout=timeout, stdout=buf, stderr=buf,
              env=env_with_cache(cache), **kw)
  return rc, buf.getvalue()


def cli(args, timeout: float = 120.0, cwd: str | None = None):
  """``python -m gshard.launch ARGS`` as a subprocess; the CompletedProcess."""
  import subprocess
  return subprocess.run([sys.executable, "-m", "gshard.launch", *args], capture_output=True,
                        text=True, timeout=timeout, cwd=cwd or ROOT)
