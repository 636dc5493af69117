"""Multi-process runs on JAX's runtime: ``python -m gshard.launch`` and what it starts.

The equality tests run tests/mp_cases.py (Megatron MLP, GPT train step with
an uneven vocabulary, MoE layer) three ways:

- 2 processes x 4 devices (``gshard.launch -n 2 -d 4``), each process feeding
  only its rows of the batch;
- 1 process x 8 devices under the same runtime (``gshard.launch -n 1 -d 8``:
  ``jax.distributed`` with one process, so the same gloo collectives). Same
  program, same collective algorithms: the results must be **bitwise** equal;
- 1 process x 8 devices in this pytest process (XLA's in-process CPU
  collectives, what ``make demo`` runs). The program is the same; XLA's
  in-process all-reduce adds the partial sums in another order than gloo. Two
  orders of a float32 sum of n terms differ by at most 2(n-1)u times the sum of
  the terms' magnitudes (u = 2^-24); with n <= 8 and about 4 reductions on a
  value's path per train step over 3 steps, that is RTOL = 12 * 14u (1.0e-5),
  relative to |value| + max|leaf| (a sum's error scales with its terms, which
  for a cancelling sum are larger than the result). Measured: at most 5% of
  that bound.

The launcher tests need no jax in the child processes; the fault tests kill a
process in the middle of a partitioned train loop.
"""

from __future__ import annotations

import os
import re
import textwrap
import time

import numpy as np
import pytest

from helpers_launch import TESTS, cache_dir, cli, run_launch

CASES = ("mlp", "gpt", "moe")
RTOL = 12 * 2 * 7 * 2.0 ** -24


def _run_cases(tmp_path_factory, processes: int, devices: int) -> dict:
  out = tmp_path_factory.mktemp(f"mp{processes}x{devices}")
  # these runs test results, not failure detection: a heartbeat timeout well
  # above the launcher's 10 s default, so that a worker starved of CPU by the
  # suite's other worker on a 2-core machine is not declared dead (the single
  # process of the 1 x 8 run once was, by its own coordination service)
  rc, log = run_launch([os.path.join(TESTS, "mp_worker.py"), str(out), *CASES], processes,
                       devices, cache=cache_dir(tmp_path_factory), heartbeat_timeout=60)
  assert rc == 0, f"gshard.launch -n {processes} -d {devices} failed ({rc}):\n{log}"
  return {name: dict(np.load(out / f"{name}.npz")) for name in CASES}


@pytest.fixture(scope="module")
def two_by_four(tmp_path_factory):
  return _run_cases(tmp_path_factory, 2, 4)


@pytest.fixture(scope="module")
def one_by_eight_gloo(tmp_path_factory):
  return _run_cases(tmp_path_factory, 1, 8)


def _state(res: dict) -> list[np.ndarray]:
  return [res[f"state_{i}"] for i in range(sum(k.startswith("state_") for k in res))]


# -- 2 x 4 against 1 x 8 -------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_two_processes_equal_one_process_bitwise(case, two_by_four, one_by_eight_gloo):
  got, want = two_by_four[case], one_by_eight_gloo[case]
  assert int(got["process_count"]) == 2 and int(want["process_count"]) == 1
  np.testing.assert_array_equal(got["losses"], want["losses"])
  assert len(_state(got)) == len(_state(want)) > 0
  for i, (a, b) in enumerate(zip(_state(got), _state(want))):
    assert a.dtype == b.dtype and a.shape == b.shape, (case, i)
    np.testing.assert_array_equal(a, b, err_msg=f"{case}: state leaf {i}")


@pytest.mark.parametrize("case", CASES)
def test_two_processes_equal_the_in_process_run(case, two_by_four):
  import mp_cases
  got, want = two_by_four[case], mp_cases.CASES[case]()
  np.testing.assert_allclose(got["losses"], want["losses"], rtol=RTOL, atol=0)
  assert want["losses"][-1] != want["losses"][0]          # it trained
  for i, (a, b) in enumerate(zip(_state(got), want["state"], strict=True)):
    assert a.shape == b.shape and a.dtype == b.dtype, (case, i)
    if a.dtype.kind != "f":
      np.testing.assert_array_equal(a, b, err_msg=f"{case}: state leaf {i}")
      continue
    scale = np.abs(b).max()
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL * scale,
                               err_msg=f"{case}: state leaf {i}")


def test_outputs_are_global_arrays(two_by_four):
  for case in CASES:
    res = two_by_four[case]
    assert bool(res["out_global"]), f"{case}: an output is not on the 8-device mesh"
    assert not bool(res["out_fully_addressable"]), \
        f"{case}: an output is fully addressable from one process"


def test_gpt_vocabulary_is_uneven_and_keeps_its_shape(two_by_four):
  import mp_cases
  embed = _state(two_by_four["gpt"])[0]
  assert mp_cases.GPT_VOCAB % 4 != 0
  assert embed.shape == (mp_cases.GPT_VOCAB, 32)


def test_moe_all_to_alls_cross_processes(two_by_four):
  spans = two_by_four["moe"]["all_to_all_processes"]
  assert len(spans) >= 3, spans           # dispatch, combine, and the combine's backward
  assert (spans == 2).all(), spans


# -- the launcher ----------------------------------------------------------------------------

def _script(tmp_path, body: str) -> str:
  path = tmp_path / "script.py"
  path.write_text(textwrap.dedent(body))
  return str(path)


def test_launcher_replaces_only_the_device_count_flag():
  from gshard.launch import process_env
  count = "--xla_force_host_platform_device_count=8"
  env = process_env({"XLA_FLAGS": count}, 0, 2, 4, 1234, 5, 5, 5)
  assert "XLA_FLAGS" not in env and env["JAX_NUM_CPU_DEVICES"] == "4"
  env = process_env({"XLA_FLAGS": f"--xla_a=1 {count} --xla_b=2"}, 1, 2, 4, 1234, 5, 5, 5)
  assert env["XLA_FLAGS"] == "--xla_a=1 --xla_b=2"


def test_launcher_sets_the_runtime_environment_and_prefixes_output(tmp_path):
  script = _script(tmp_path, """
      import os
      e = os.environ
      print(e["GSHARD_PROCESS_ID"], e["GSHARD_NUM_PROCESSES"], e["JAX_COORDINATOR_ADDRESS"],
            e["JAX_NUM_CPU_DEVICES"], e["JAX_PLATFORMS"],
            e["JAX_CPU_COLLECTIVES_IMPLEMENTATION"],
            "device_count" in e.get("XLA_FLAGS", ""), e.get("XLA_FLAGS") == "")
      import sys; print("to stderr", file=sys.stderr)
  """)
  t0 = time.monotonic()
  rc, out = run_launch([script], 3, 2, timeout=60)
  assert rc == 0, out
  port = re.search(r"coordinator 127\.0\.0\.1:(\d+)", out).group(1)
  for i in range(3):
    # the device-count flag is gone (the suite's other XLA flags are kept), and
    # no empty XLA_FLAGS is left behind
    assert f"[p{i}] {i} 3 127.0.0.1:{port} 2 cpu gloo False False" in out, out
    assert f"[p{i}] to stderr" in out
  assert time.monotonic() - t0 < 60


def test_launcher_cli_reports_a_failed_process(tmp_path):
  script = _script(tmp_path, """
      import os, sys
      if os.environ["GSHARD_PROCESS_ID"] == "1":
        raise ValueError("bad shard in process 1")
      print("process 0 done")
  """)
  res = cli(["--processes", "2", "--devices-per-process", "1", "--timeout", "60", script])
  assert res.returncode == 1, res
  assert "[p0] process 0 done" in res.stdout
  assert "[p1] ValueError: bad shard in process 1" in res.stderr
  assert "process 1/2 exited with code 1" in res.stderr
  assert "process 1 failed first" in res.stderr


@pytest.mark.parametrize("argv,message", [
    (["--processes", "2", "no_such_script.py"], "no such script: 'no_such_script.py'"),
    (["--processes", "0", __file__], "must be >= 1"),
    (["--processes", "2"], "give a script to run"),
])
def test_launcher_usage_errors(argv, message, capsys):
  from gshard.launch import main
  with pytest.raises(SystemExit) as e:
    main(argv)
  assert e.value.code == 2
  assert message in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["straggler", "timeout"])
def test_launcher_never_hangs(tmp_path, mode):
  """A process that outlives a failure by --grace is terminated; a run that outlives
  --timeout is stopped (exit 124)."""
  script = _script(tmp_path, """
      import os, sys, time
      if os.environ["GSHARD_PROCESS_ID"] == "1" and sys.argv[1] == "straggler":
        sys.exit(3)
      time.sleep(120)
  """)
  t0 = time.monotonic()
  rc, out = run_launch([script, mode], 2, 1, timeout=4 if mode == "timeout" else 60,
                       grace=1.0)
  took = time.monotonic() - t0
  assert took < 30, (took, out)
  if mode == "straggler":
    assert rc == 3, out
    assert "process 1/2 exited with code 3" in out
    assert "process 0/2 terminated" in out and "1 s after process 1 failed" in out
  else:
    assert rc == 124, out
    assert "timed out after 4 s" in out


# -- faults -------------------------------------------------------------------------------

FAULT_SCRIPT = os.path.join(TESTS, "mp_fault.py")
HEARTBEAT = 5


@pytest.mark.parametrize("victim", [1, 0], ids=["worker-dies", "coordinator-dies"])
def test_a_dead_process_stops_the_others(tmp_path_factory, victim):
  """Process ``victim`` is SIGKILLed between two train steps; the other, in the
  next step's collectives, is stopped by JAX's runtime (not by the launcher)
  within the heartbeat timeout, with an error saying a peer is gone."""
  rc, out = run_launch([FAULT_SCRIPT, str(victim)], 2, 4, cache=cache_dir(tmp_path_factory),
                       heartbeat_timeout=HEARTBEAT, grace=60.0, timeout=300)
  assert rc == 128 + 9, out                      # the victim's SIGKILL
  other = 1 - victim
  assert f"process {victim}/2 was killed by SIGKILL" in out, out
  assert f"process {other}/2 terminated" not in out, out     # not the launcher's doing
  m = re.search(rf"process {other}/2 (?:was killed by \w+|exited with code \d+) at "
                rf"[\d.]+ s, ([\d.]+) s after process {victim} failed", out)
  assert m, out
  assert float(m.group(1)) < HEARTBEAT + 10, out
  assert re.search(r"Connection closed by peer|heartbeat|Socket closed|"
                   r"detected fatal errors|Gloo", out), out
  assert f"[p{other}] step 3" in out                         # it was training
