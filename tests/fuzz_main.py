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
    return o.fallback.status != "pass"
  return o.status != "pass"


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
  args = ap.parse_args(argv)
  warnings.filterwarnings("ignore", category=UserWarning)

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
    return int(failed(r.gshard))

  seed = args.seed if args.seed is not None else random.SystemRandom().randint(0, 10 ** 6)
  print(f"fuzz seed {seed}: {args.examples} programs "
        f"(replay one with: python tests/fuzz_main.py --replay {seed}-K)", flush=True)
  g_counts, x_counts = collections.Counter(), collections.Counter()
  g_status, x_status = collections.Counter(), collections.Counter()
  modes = collections.Counter()
  warned = invalid = 0
  t0 = time.time()
  n = 0
  with open(args.out, "w") as out:
    out.write(f"# fuzz seed {seed}\n")
    for k in range(args.examples):
      if args.time_limit and time.time() - t0 > args.time_limit:
        print(f"time limit reached after {n} programs")
        break
      pid = f"{seed}-{k}"
      try:
        prog = fuzzgen.from_seed(pid)
      except Exception as e:  # noqa: BLE001
        invalid += 1
        print(f"{pid}: generator error {type(e).__name__}: {e}")
        continue
      r = fuzzcheck.check(prog, gspmd=not args.no_gspmd)
      n += 1
      if r.single_error:
        invalid += 1
        out.write(f"\n# ==== {pid}: one device failed (generator bug): {r.single_error}\n")
        out.write(prog.repro())
        continue
      modes[prog.mode] += 1
      g_counts[r.gshard.key] += 1
      g_status[r.gshard.status] += 1
      warned += r.gshard.warned
      if r.gspmd is not None:
        x_counts[gspmd_key(r.gspmd)] += 1
        x_status[r.gspmd.status] += 1
        if r.gspmd.fallback is not None:
          x_status["refuse->" + r.gspmd.fallback.status] += 1
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
      if (k + 1) % 100 == 0:
        jax.clear_caches()
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
  g_fail = g_status["wrong"] + g_status["crash"]
  x_fail = sum(1 for k_, v in x_counts.items() for _ in range(v)
               if not (k_ == "pass" or k_ == "refuse -> pass"))
  print(f"{'failing (any)':24}{pct(g_fail):>16}{pct(x_fail):>16}")
  print("\ngshard classes:")
  for key, c in g_counts.most_common():
    print(f"  {c:5d}  {key}")
  if x_counts:
    print("\ngspmd classes:")
    for key, c in x_counts.most_common():
      print(f"  {c:5d}  {key}")
  if fuzzcheck.SCALE_FALLBACKS:
    print("\nscale rules missing (conservative fallback):", dict(fuzzcheck.SCALE_FALLBACKS))
  print(f"\nfailing repros: {args.out}; seed {seed}")
  return 1 if g_fail else 0


if __name__ == "__main__":
  sys.exit(main())
