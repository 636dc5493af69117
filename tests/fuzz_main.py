"""``make fuzz``: thousands of random programs through gshard and GSPMD.

Usage::

  python tests/fuzz_main.py [--examples N] [--seed S] [--out fuzz-failures.txt]
                            [--no-gspmd] [--time-limit SECONDS]
  python tests/fuzz_main.py --replay S-K     # one program: its repro and outcome

Program ``K`` of run ``S`` is ``fuzzgen.from_seed("S-K")``: a failure is
reproduced from its id alone. Prints the seed first, progress as it goes, and
at the end the counts of every outcome class for gshard and, side by side,
GSPMD (``gshard.gspmd_jit``; when jit refuses uneven ``in_shardings`` the
same intent is retried as sharding constraints on the arguments, and both are
counted). Failing programs (gshard or GSPMD) are written to ``--out`` as
self-contained repro scripts.
"""

from __future__ import annotations

import os
import re
import sys

_FLAG = "--xla_force_host_platform_device_count=8"
os.environ["XLA_FLAGS"] = " ".join(
    [*re.sub(r"--xla_force_host_platform_device_count=\S*", "",
             os.environ.get("XLA_FLAGS", "")).split(), _FLAG])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")   # XLA's rematerialization notes
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import collections  # noqa: E402
import multiprocessing  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402

import fuzzcheck  # noqa: E402
import fuzzgen  # noqa: E402


def describe(r: fuzzcheck.Result, which: str) -> str:
  o = getattr(r, which)
  lines = [f"{which}: {o.status} {o.detail} {o.where}".rstrip()]
  lines += [f"    {m}" for m in o.mismatches]
  if o.fallback is not None:
    lines.append(f"  with in_specs as constraints: {o.fallback.key}")
    lines += [f"    {m}" for m in o.fallback.mismatches]
  return "\n".join(lines)


def gspmd_key(o: fuzzcheck.Outcome) -> str:
  if o.status == "refuse" and o.fallback is not None:
    return "refuse -> " + o.fallback.key
  return o.key


def failed(o: fuzzcheck.Outcome | None) -> bool:
  if o is None:
    return False
  if o.fallback is not None:
    return o.fallback.status not in ("pass", "reference")
  return o.status not in ("pass", "reference")


# -- a worker process: XLA may abort the process (a CHECK failure) ----------------

def _worker(conn) -> None:
  warnings.filterwarnings("ignore", category=UserWarning)
  done = 0
  while True:
    msg = conn.recv()
    if msg is None:
      return
    pid, gspmd = msg
    try:
      prog = fuzzgen.from_seed(pid)
    except Exception as e:  # noqa: BLE001
      conn.send(("generror", f"{type(e).__name__}: {e}"))
      continue
    r = fuzzcheck.check(prog, gspmd=gspmd,
                        on_stage=lambda name, o: conn.send(("stage", name, o)))
    conn.send(("done", r, dict(fuzzcheck.SCALE_FALLBACKS)))
    done += 1
    if done % 100 == 0:
      jax.clear_caches()


class Worker:
  """A spawned process running :func:`fuzzcheck.check`, restarted when it dies."""

  def __init__(self, timeout: float):
    self.timeout = timeout
    self.proc = None

  def _start(self):
    ctx = multiprocessing.get_context("spawn")
    self.conn, child = ctx.Pipe()
    self.proc = ctx.Process(target=_worker, args=(child,), daemon=True)
    self.proc.start()

  def _kill(self):
    if self.proc is not None:
      self.proc.kill()
      self.proc.join()
      self.proc = None

  def close(self):
    if self.proc is not None:
      try:
        self.conn.send(None)
      except OSError:
        pass
      self.proc.join(timeout=10)
      self._kill()

  def run(self, pid: str, gspmd: bool):
    """("done", Result, fallbacks) | ("generror", msg) | ("died", stage outcomes, why)."""
    if self.proc is None:
      self._start()
    self.conn.send((pid, gspmd))
    stages = {}
    while True:
      if not self.conn.poll(self.timeout):
        self._kill()
        return ("died", stages, f"timeout after {self.timeout:.0f}s")
      try:
        msg = self.conn.recv()
      except (EOFError, OSError):
        self.proc.join()
        code = self.proc.exitcode
        self.proc = None
        return ("died", stages, f"process died (exit code {code}; an XLA CHECK failure "
                "aborts it)")
      if msg[0] == "stage":
        stages[msg[1]] = msg[2]
        continue
      return msg


def check_isolated(worker: Worker, pid: str, gspmd: bool):
  """(Result or None, generator error or None, scale fallbacks)."""
  msg = worker.run(pid, gspmd)
  if msg[0] == "done":
    return msg[1], None, msg[2]
  if msg[0] == "generror":
    return None, msg[1], {}
  _, stages, why = msg
  prog = fuzzgen.from_seed(pid)
  if "reference" not in stages and not why.startswith("timeout"):
    # jax.jit of the program on one device took the process down: XLA's own
    # crash, before gshard or GSPMD ran (counted with the invalid programs)
    return None, f"the one-device jax.jit died: {why}", {}
  died = fuzzcheck.Outcome("crash", f"Abort: {why}", "xla (process died)")
  if "gshard" in stages:        # gshard finished: GSPMD took the process down
    return fuzzcheck.Result(prog, None, stages["gshard"], died), None, {}
  if gspmd:                     # rerun without GSPMD to see whether gshard did it
    r, err, fb = check_isolated(worker, pid, False)
    if r is not None and r.gshard is not None:
      r.gspmd = fuzzcheck.Outcome("crash", "Abort: not run (the process died before "
                                  "GSPMD ran)", "?")
    return r, err, fb
  return fuzzcheck.Result(prog, None, died, None), None, {}


def op_head(line: str) -> str:
  """A short name for the operation a program line performs (for grouping)."""
  expr = line.split(" = ", 1)[1]
  m = re.match(r"(\w+)\.at\[(.*)\]\.(\w+)\(", expr)
  if m:
    return f".at[{'scalar' if ',' not in m.group(2) and not re.search(r'[x(]', m.group(2)) else 'idx'}].{m.group(3)}"
  if re.fullmatch(r"(\w+) \* jnp\.sum\(\1\)", expr):
    return "x * jnp.sum(x)"
  m = re.match(r"([\w.]+)\(", expr)
  if m:
    head = m.group(1)
    head = re.sub(r"^[vux]\d+\.", ".", head)
    if head == "jnp.pad":
      head += "[" + re.search(r"mode='(\w+)'", expr).group(1) + "]"
    if head in ("jnp.argmax", "jnp.argmin", "jnp.max", "jnp.min", "jnp.sum"):
      head += "[axis=None]" if "axis=None" in expr else ""
    return head
  m = re.match(r"\w+(\[.*\]|\.T\[.*\])$", expr)
  if m:
    return "x[...]" if ".T[" not in expr else "x.T[i, j]"
  m = re.match(r"[\w.]+ (\S+) [\w.]+$", expr) or re.match(r"([-~])\w+$", expr)
  if m:
    return "operator " + m.group(1)
  m = re.match(r"\w+\.(\w+)\(", expr)
  return m.group(1) if m else expr[:30]


def localize_file(path: str, limit: int) -> None:
  """Localize the gshard failures recorded in a failures file; group by op."""
  ids = []
  for line in open(path):
    m = re.match(r"# ==== (\S+) \[\w+\] gshard: (\w+)", line)
    if m and m.group(2) in ("wrong", "crash"):
      ids.append(m.group(1))
  groups = collections.defaultdict(list)
  for pid in ids[:limit]:
    prog = fuzzgen.from_seed(pid)
    r = fuzzcheck.check(prog, gspmd=False)
    if r.gshard is None or r.gshard.status == "pass":
      print(f"{pid}: does not fail now")
      continue
    found = fuzzcheck.localize(prog, log=lambda s: None, outcome=r.gshard)
    if found is None:
      key = f"(no single line) {r.gshard.key}"
    else:
      k, line, mode, o = found
      key = f"{op_head(line)} [{mode}] {o.key}"
    groups[key].append(pid)
    print(f"{pid}: {key}" + (f"   <- {found[1]}" if found else ""), flush=True)
  print("\nfirst divergent op, by class:")
  for key, pids in sorted(groups.items(), key=lambda kv: -len(kv[1])):
    print(f"  {len(pids):4d}  {key}   e.g. {' '.join(pids[:3])}")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--examples", type=int,
                  default=int(os.environ.get("FUZZ_EXAMPLES", "2000")))
  ap.add_argument("--seed", type=int, default=None)
  ap.add_argument("--out", default=os.environ.get("FUZZ_OUT", "fuzz-failures.txt"))
  ap.add_argument("--no-gspmd", action="store_true")
  ap.add_argument("--time-limit", type=float,
                  default=float(os.environ.get("FUZZ_TIME_LIMIT", "0")) or None)
  ap.add_argument("--replay", default=None, help="run one program, e.g. 1234-17")
  ap.add_argument("--localize", action="store_true",
                  help="with --replay: find the first line whose values differ")
  ap.add_argument("--localize-file", default=None, metavar="FAILURES",
                  help="localize every gshard failure of a failures file, grouped")
  ap.add_argument("--limit", type=int, default=10 ** 9)
  ap.add_argument("--timeout", type=float, default=600.0,
                  help="seconds one program may take before it counts as a crash")
  args = ap.parse_args(argv)
  warnings.filterwarnings("ignore", category=UserWarning)

  if args.localize_file:
    localize_file(args.localize_file, args.limit)
    return 0

  if args.replay:
    prog = fuzzgen.from_seed(args.replay)
    print(prog.repro())
    r = fuzzcheck.check(prog, gspmd=not args.no_gspmd)
    if r.single_error:
      print("one device failed (generator bug):", r.single_error)
      return 2
    print(describe(r, "gshard"))
    if r.gspmd:
      print(describe(r, "gspmd"))
    if args.localize and failed(r.gshard):
      fuzzcheck.localize(prog, outcome=r.gshard)
    return int(failed(r.gshard))

  seed = args.seed if args.seed is not None else random.SystemRandom().randint(0, 10 ** 6)
  print(f"fuzz seed {seed}: {args.examples} programs "
        f"(replay one with: python tests/fuzz_main.py --replay {seed}-K)", flush=True)
  g_counts, x_counts = collections.Counter(), collections.Counter()
  g_status, x_status = collections.Counter(), collections.Counter()
  modes = collections.Counter()
  warned = invalid = 0
  scale_fallbacks = {}
  safe_prims = collections.Counter()
  worker = Worker(args.timeout)
  t0 = time.time()
  n = 0
  with open(args.out, "w") as out:
    out.write(f"# fuzz seed {seed}\n")
    for k in range(args.examples):
      if args.time_limit and time.time() - t0 > args.time_limit:
        print(f"time limit reached after {n} programs")
        break
      pid = f"{seed}-{k}"
      r, gen_error, fallbacks = check_isolated(worker, pid, not args.no_gspmd)
      n += 1
      scale_fallbacks.update(fallbacks)
      if gen_error:
        invalid += 1
        print(f"{pid}: generator error {gen_error}")
        if gen_error.startswith("the one-device"):
          out.write(f"\n# ==== {pid}: {gen_error}\n")
          out.write(fuzzgen.from_seed(pid).repro())
        continue
      prog = r.prog
      if r.single_error:
        invalid += 1
        out.write(f"\n# ==== {pid}: one device failed (generator bug): {r.single_error}\n")
        out.write(prog.repro())
        continue
      modes[prog.mode] += 1
      g_counts[r.gshard.key] += 1
      g_status[r.gshard.status] += 1
      warned += r.gshard.warned
      safe_prims.update(r.gshard.safe_path)
      if r.gspmd is not None:
        x_counts[gspmd_key(r.gspmd)] += 1
        x_status[r.gspmd.status] += 1
        if r.gspmd.fallback is not None:
          x_status["refuse->" + r.gspmd.fallback.status] += 1
        eff = r.gspmd.fallback or r.gspmd
        x_status["eff:" + eff.status] += 1
      g_bad, x_bad = failed(r.gshard), failed(r.gspmd)
      if g_bad or x_bad:
        out.write(f"\n# ==== {pid} [{prog.mode}] gshard: {r.gshard.key}"
                  + (f" | gspmd: {gspmd_key(r.gspmd)}" if r.gspmd else "") + "\n")
        for line in (describe(r, "gshard") + ("\n" + describe(r, "gspmd") if r.gspmd
                                               else "")).splitlines():
          out.write(f"# {line}\n")
        out.write(f"# features: {' '.join(sorted(prog.features))}\n")
        out.write(prog.repro())
        out.flush()
      if g_bad:
        print(f"{pid} [{prog.mode}] gshard {r.gshard.key}", flush=True)
      if (k + 1) % 50 == 0:
        el = time.time() - t0
        print(f"... {k + 1} programs, {el:.0f}s; gshard fail "
              f"{g_status['wrong'] + g_status['crash']}", flush=True)
  worker.close()
  el = time.time() - t0

  def pct(a):
    return f"{a:5d} ({100 * a / max(n - invalid, 1):5.1f}%)"
  print()
  print(f"fuzz seed {seed}: {n} programs in {el:.0f}s ({modes['value']} value, "
        f"{modes['grad']} grad), {invalid} invalid (generator)")
  print(f"{'':24}{'gshard':>16}{'gspmd':>16}")
  print(f"{'pass':24}{pct(g_status['pass']):>16}{pct(x_status['pass']):>16}")
  print(f"{'wrong value':24}{pct(g_status['wrong']):>16}{pct(x_status['wrong']):>16}")
  print(f"{'crash':24}{pct(g_status['crash']):>16}{pct(x_status['crash']):>16}")
  print(f"{'gspmd refuses':24}{'':>16}{pct(x_status['refuse']):>16}")
  for s in ("pass", "wrong", "crash"):
    print(f"{'  then, as constraints: ' + s:24}{'':>16}"
          f"{pct(x_status['refuse->' + s]):>16}")
  print(f"{'safe path (warned)':24}{pct(warned):>16}")
  print(f"{'one-device jit wrong':24}{pct(g_status['reference']):>16}"
        f"{pct(x_status['eff:reference']):>16}")
  print(f"{'checker error (oracle)':24}{pct(g_status['checker']):>16}"
        f"{pct(x_status['eff:checker']):>16}")
  g_fail = g_status["wrong"] + g_status["crash"]
  x_fail = x_status["eff:wrong"] + x_status["eff:crash"]
  print(f"{'failing (wrong+crash)':24}{pct(g_fail):>16}{pct(x_fail):>16}")
  print("\ngshard classes:")
  for key, c in g_counts.most_common():
    print(f"  {c:5d}  {key}")
  if x_counts:
    print("\ngspmd classes:")
    for key, c in x_counts.most_common():
      print(f"  {c:5d}  {key}")
  if safe_prims:
    print("\nsafe path taken (programs), by primitive:")
    for key, c in safe_prims.most_common():
      print(f"  {c:5d}  {key}")
  if scale_fallbacks:
    print("\nscale rules missing (conservative fallback):", scale_fallbacks)
  print(f"\nfailing repros: {args.out}; seed {seed}")
  return 1 if g_fail else 0


if __name__ == "__main__":
  sys.exit(main())
