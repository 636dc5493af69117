"""``python -m gshard.launch``: run one script as several JAX processes on this machine.

For development and CI: what a TPU pod or a GPU cluster does with one process
per host, on loopback with simulated CPU devices::

  python -m gshard.launch --processes 2 --devices-per-process 4 train.py --steps 10

starts ``train.py --steps 10`` twice. Each process gets, in its environment,
what :func:`gshard.distributed.initialize` (and so ``jax.distributed``) needs:

  JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>   process 0 runs the coordinator
  GSHARD_NUM_PROCESSES, GSHARD_PROCESS_ID         the process count and this one's id
  JAX_PLATFORMS=cpu, JAX_NUM_CPU_DEVICES=<d>      d simulated CPU devices per process
  JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo         collectives across processes over TCP
  GSHARD_HEARTBEAT_TIMEOUT, GSHARD_INIT_TIMEOUT,  JAX's own failure detection, short
  GSHARD_SHUTDOWN_TIMEOUT

(a ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS`` is removed: the
device count is ``--devices-per-process``). The script calls
``gshard.distributed.initialize()`` before any other jax call. Every line the
processes print is streamed with a ``[p<id>]`` prefix. The launcher exits 0
when every process does; otherwise it says which process failed and how, and
exits with that process's code (128 + the signal for a killed one).

When a process dies, JAX's runtime brings the others down (its heartbeat, or a
collective whose peer is gone, fails them with an error). The launcher waits
``--grace`` seconds for that, then terminates any process still running, so a
run never hangs; ``--timeout`` bounds the whole run.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO

from gshard import distributed

# gloo prints one of these per communicator it builds; they say nothing a user needs.
_GLOO_NOISE = re.compile(rb"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
                         rb"Expected number of connected peer ranks is : \d+\s*$")
_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port that is free on ``host`` now (the OS picks it)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def process_env(base: dict[str, str], process_id: int, processes: int, devices: int,
                port: int, heartbeat_timeout: int, init_timeout: int,
                shutdown_timeout: int) -> dict[str, str]:
  """The environment of process ``process_id`` (see the module docstring)."""
  env = dict(base)
  flags = _DEVICE_COUNT_FLAG.sub("", env.get("XLA_FLAGS", "")).split()
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  else:
    env.pop("XLA_FLAGS", None)
  env.update({
      distributed.ENV_COORDINATOR: f"127.0.0.1:{port}",
      distributed.ENV_NUM_PROCESSES: str(processes),
      distributed.ENV_PROCESS_ID: str(process_id),
      distributed.ENV_HEARTBEAT_TIMEOUT: str(heartbeat_timeout),
      distributed.ENV_INIT_TIMEOUT: str(init_timeout),
      distributed.ENV_SHUTDOWN_TIMEOUT: str(shutdown_timeout),
      "JAX_PLATFORMS": "cpu",
      "JAX_NUM_CPU_DEVICES": str(devices),
      "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
      "PYTHONUNBUFFERED": "1",
  })
  return env


def describe_exit(code: int) -> str:
  """``exited with code 1`` / ``was killed by SIGKILL``."""
  if code < 0:
    try:
      return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"was killed by signal {-code}"
  return f"exited with code {code}"


class _Process:
  """One child: the process and the threads that stream its output."""

  def __init__(self, index: int, command: list[str], env: dict[str, str],
               out: TextIO, err: TextIO, lock: threading.Lock, quiet_gloo: bool):
    self.index = index
    self.started = time.monotonic()
    self.ended: float | None = None
    self.terminated = False          # by the launcher, not by itself
    self.proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    prefix = f"[p{index}] "
    self.threads = [threading.Thread(target=_stream, daemon=True,
                                     args=(pipe, sink, prefix, lock, quiet_gloo))
                    for pipe, sink in ((self.proc.stdout, out), (self.proc.stderr, err))]
    for t in self.threads:
      t.start()
    # The moment it exits, taken by a thread blocked in wait(): the order of
    # two processes that die within one poll interval (a killed process and a
    # peer aborting because of it) is the order they really exited in.
    self.waiter = threading.Thread(target=self._wait, daemon=True)
    self.waiter.start()

  def _wait(self) -> None:
    self.proc.wait()
    self.ended = time.monotonic()

  def poll(self) -> int | None:
    code = self.proc.returncode
    if code is not None and self.ended is None:   # the waiter is about to stamp it
      self.waiter.join()
    return code


def _stream(pipe, sink: TextIO, prefix: str, lock: threading.Lock, quiet_gloo: bool):
  for raw in iter(pipe.readline, b""):
    if quiet_gloo and _GLOO_NOISE.match(raw):
      continue
    line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
    with lock:
      sink.write(prefix + line + "\n")
      sink.flush()
  pipe.close()


def _stop(procs: Sequence[_Process], wait: float = 5.0) -> None:
  """SIGTERM every process still running, then SIGKILL what is left after ``wait``."""
  alive = [p for p in procs if p.poll() is None]
  for p in alive:
    p.terminated = True
    p.proc.terminate()
  deadline = time.monotonic() + wait
  for p in alive:
    p.waiter.join(timeout=max(0.0, deadline - time.monotonic()))
    if p.waiter.is_alive():
      p.proc.kill()
      p.waiter.join()


def launch(command: Sequence[str], processes: int = 2, devices_per_process: int = 4, *,
           port: int | None = None, timeout: float | None = None,
           heartbeat_timeout: int = 10, init_timeout: int = 60,
           shutdown_timeout: int = 30, grace: float | None = None,
           quiet_gloo: bool = True, stdout: TextIO | None = None,
           stderr: TextIO | None = None, env: dict[str, str] | None = None) -> int:
  """Run ``command`` (a Python script and its arguments, or ``-m module ...``) as
  ``processes`` JAX processes of ``devices_per_process`` CPU devices each.

  Returns the exit status: 0 when every process exits 0; else the first failed
  process's code (128 + signal when killed); 124 when ``timeout`` expires.
  A report of what failed goes to ``stderr``.

  Args:
    command: ``["train.py", "--steps", "10"]`` or ``["-m", "pkg.mod", ...]``;
      run with this interpreter (``sys.executable``).
    port: the coordinator's port on 127.0.0.1; default a free one.
    timeout: seconds for the whole run; ``None`` for no limit.
    heartbeat_timeout: seconds without a heartbeat after which JAX's
      coordination service declares a process dead and stops the others.
    init_timeout: seconds ``jax.distributed.initialize`` waits for every
      process to connect.
    shutdown_timeout: seconds the exit barrier waits for every process.
    grace: after the first failure, seconds the others get to stop by
      themselves before they are terminated; default ``heartbeat_timeout + 20``.
    quiet_gloo: drop gloo's "Rank i is connected to n peer ranks" lines.
  """
  out = stdout or sys.stdout
  err = stderr or sys.stderr
  command = list(command)
  if processes < 1 or devices_per_process < 1:
    raise ValueError(f"gshard.launch: --processes ({processes}) and "
                     f"--devices-per-process ({devices_per_process}) must be >= 1.")
  if not command:
    raise ValueError("gshard.launch: give a script to run, e.g. "
                     "`python -m gshard.launch --processes 2 train.py`.")
  if command[0] != "-m" and not os.path.isfile(command[0]):
    raise FileNotFoundError(f"gshard.launch: no such script: {command[0]!r}")
  grace = heartbeat_timeout + 20.0 if grace is None else grace
  port = port or free_port()
  base = dict(os.environ if env is None else env)
  lock = threading.Lock()
  procs: list[_Process] = []
  with lock:
    err.write(f"gshard.launch: {processes} process{'es' if processes > 1 else ''} x "
              f"{devices_per_process} CPU device{'s' if devices_per_process > 1 else ''}, "
              f"coordinator 127.0.0.1:{port}: {shlex.join(command)}\n")
    err.flush()
  t0 = time.monotonic()
  first_failure: _Process | None = None
  timed_out = False
  try:
    for i in range(processes):
      procs.append(_Process(i, [sys.executable, *command],
                            process_env(base, i, processes, devices_per_process, port,
                                        heartbeat_timeout, init_timeout, shutdown_timeout),
                            out, err, lock, quiet_gloo))
    while True:
      codes = [p.poll() for p in procs]
      if first_failure is None:
        failed = [p for p, c in zip(procs, codes) if c not in (None, 0)]
        if failed:
          first_failure = min(failed, key=lambda p: p.ended)
      if all(c is not None for c in codes):
        break
      now = time.monotonic()
      if timeout is not None and now - t0 > timeout:
        timed_out = True
        break
      if first_failure is not None and now - first_failure.ended > grace:
        break
      time.sleep(0.05)
  except KeyboardInterrupt:
    _stop(procs)
    raise
  finally:
    _stop(procs)
    for p in procs:
      for t in p.threads:
        t.join(timeout=5)
  return _report(procs, first_failure, timed_out, timeout, grace, t0, err, lock)


def _report(procs, first_failure, timed_out, timeout, grace, t0, err, lock) -> int:
  lines = []
  n = len(procs)
  if timed_out:
    lines.append(f"gshard.launch: timed out after {timeout:g} s (--timeout); "
                 "terminated the processes still running.")
  for p in procs:
    code = p.proc.returncode
    at = p.ended - t0 if p.ended is not None else float("nan")
    if p.terminated:
      why = ("the run timed out" if timed_out else
             f"it was still running {grace:g} s after process {first_failure.index} failed")
      lines.append(f"gshard.launch: process {p.index}/{n} terminated at {at:.1f} s: {why}.")
    elif code != 0:
      after = ""
      if first_failure is not None and p is not first_failure:
        after = (f", {p.ended - first_failure.ended:.1f} s after process "
                 f"{first_failure.index} failed")
      lines.append(f"gshard.launch: process {p.index}/{n} {describe_exit(code)} at "
                   f"{at:.1f} s{after}.")
  if first_failure is not None:
    lines.append(f"gshard.launch: process {first_failure.index} failed first; its own "
                 f"output (prefixed [p{first_failure.index}]) above shows why, the others' "
                 "errors follow from it.")
  if lines:
    with lock:
      err.write("\n".join(lines) + "\n")
      err.flush()
  if timed_out:
    return 124
  if first_failure is None:
    return 0
  code = first_failure.proc.returncode
  return 128 - code if code < 0 else code


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m gshard.launch",
      description="Run a script as several JAX processes on this machine (loopback "
                  "coordinator, simulated CPU devices, gloo collectives). The script "
                  "calls gshard.distributed.initialize() first.",
      epilog="Example: python -m gshard.launch --processes 2 --devices-per-process 4 "
             "examples/train_gpt.py")
  parser.add_argument("--processes", "-n", type=int, default=2,
                      help="number of processes (default 2)")
  parser.add_argument("--devices-per-process", "-d", type=int, default=4,
                      help="simulated CPU devices in each process (default 4)")
  parser.add_argument("--port", type=int, default=0,
                      help="coordinator port on 127.0.0.1 (default: a free one)")
  parser.add_argument("--timeout", type=float, default=None,
                      help="seconds for the whole run, then everything is terminated "
                           "(exit 124; default: no limit)")
  parser.add_argument("--heartbeat-timeout", type=int, default=10,
                      help="seconds after which JAX declares a silent process dead "
                           "(default 10)")
  parser.add_argument("--init-timeout", type=int, default=60,
                      help="seconds jax.distributed.initialize waits for all processes "
                           "(default 60)")
  parser.add_argument("--grace", type=float, default=None,
                      help="after a process fails, seconds the others get to stop by "
                           "themselves (default heartbeat timeout + 20)")
  parser.add_argument("--gloo-log", action="store_true",
                      help="keep gloo's 'Rank i is connected to n peer ranks' lines")
  parser.add_argument("-m", dest="module", default=None,
                      help="run a module (as python -m does) instead of a script")
  parser.add_argument("command", nargs=argparse.REMAINDER,
                      help="script.py [args...] or -m module [args...]")
  args = parser.parse_args(argv)
  command = args.command
  if command and command[0] == "--":
    command = command[1:]
  if args.module:
    command = ["-m", args.module, *command]
  try:
    return launch(command, args.processes, args.devices_per_process, port=args.port or None,
                  timeout=args.timeout, heartbeat_timeout=args.heartbeat_timeout,
                  init_timeout=args.init_timeout, grace=args.grace,
                  quiet_gloo=not args.gloo_log)
  except (ValueError, FileNotFoundError) as e:
    parser.error(str(e))


if __name__ == "__main__":
  sys.exit(main())
