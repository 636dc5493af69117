"""Gradient accumulation: gshard against XLA's GSPMD, by micro-batch count.

An MLP SGD step (``tanh(x @ w1) @ w2``, squared error) whose gradient is
accumulated over K micro-batches, in three forms: as MaxText writes it (the
batch reshaped to ``[K, B/K, D]``, a ``lax.scan`` adding the micro-batches'
gradients; ``scan``), as a ``lax.fori_loop`` reading micro-batch ``i`` with
``lax.dynamic_slice_in_dim(x, i * B/K, B/K)`` (``fori``), and as a Python
loop over ``x[k*B/K:(k+1)*B/K]`` (``python``, unrolled); one update with
their mean. The batch is split over ``data`` = 8
simulated CPU devices, the weights replicated (data parallel); nothing else
is annotated. K runs from 1 (no accumulation) to 32, below, at and above the
device count.

Per K and system, in one process, the same function and ``in_specs``
(gshard: ``gshard.partition``; GSPMD: ``gshard.gspmd_jit``):

- bytes sent per device over one step, from the compiled HLO (benchmarks/
  hlo.py: ring formulas, a collective inside the loop once per iteration);
- rows: the rows of each micro-batch one device computes, read from the
  compiled HLO (the first dot's operand in the loop body): B/K/8 is data
  parallel, B/K every device computing every row;
- memory (``memory_analysis()``: temp + arguments + outputs) and the median
  step time (the systems alternate call by call).

The analytic minimum of bytes for a data-parallel step: the gradient's
all-reduce (2 (n-1)/n of both weights), plus moving the rows where K is no
multiple of n (each device's block once: x and y) or the scan's all-to-all
of them where it is ((n-1)/n of the block).

Run: ``.venv/bin/python benchmarks/accumulate.py [--runs N] [--no-doc]``
(part of ``make bench``); writes docs/benchmarks-accumulate.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import time

os.environ["XLA_FLAGS"] = " ".join(
    [*re.sub(r"--xla_force_host_platform_device_count=\S*", "",
             os.environ.get("XLA_FLAGS", "")).split(),
     "--xla_force_host_platform_device_count=8"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import gshard  # noqa: E402
from benchmarks import hlo  # noqa: E402

B, D, H, N = 512, 256, 1024, 8
COUNTS = (1, 2, 4, 8, 16, 32)
DOC = os.path.join(_ROOT, "docs", "benchmarks-accumulate.md")


FORMS = ("scan", "fori", "python")


def accumulate(count: int, form: str = "scan"):
  def loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

  def step(p, x, y):
    zeros = jax.tree.map(jnp.zeros_like, p)
    if form == "scan":
      xs, ys = x.reshape(count, -1, D), y.reshape(count, -1, D)

      def body(g, xy):
        return jax.tree.map(jnp.add, g, jax.grad(loss)(p, *xy)), None
      g, _ = jax.lax.scan(body, zeros, (xs, ys))
    elif form == "python":
      rows, g = B // count, zeros
      for k in range(count):
        xy = [a[k * rows:(k + 1) * rows] for a in (x, y)]
        g = jax.tree.map(jnp.add, g, jax.grad(loss)(p, *xy))
    else:
      rows = B // count

      def body(i, g):
        xy = [jax.lax.dynamic_slice_in_dim(a, i * rows, rows) for a in (x, y)]
        return jax.tree.map(jnp.add, g, jax.grad(loss)(p, *xy))
      g = jax.lax.fori_loop(0, count, body, zeros)
    return jax.tree.map(lambda w, g: w - 0.1 * g / count, p, g)
  return step


def _rows(text: str) -> int:
  """Rows of a micro-batch one device computes: the leading dim of the
  first dot's first operand inside the loop body (the whole program's
  first dot where there is no loop)."""
  body = re.search(r"body=%?([\w.\-]+)", text)
  comps = re.split(r"\n(?=\S)", text)
  scope = [c for c in comps if body and c.split(" ", 1)[0].lstrip("%") == body.group(1)]
  called = set(re.findall(r"calls=%?([\w.\-]+)", scope[0])) if scope else set()
  for c in ([c for c in comps if c.split(" ", 1)[0].lstrip("%") in called] + scope
            if scope else comps):
    for line in c.splitlines():
      m = re.search(r"= f32\[[\d,]*\]\S* dot\(%?([\w.\-]+)", line)
      if m:
        shape = re.search(rf"%?{re.escape(m.group(1))} = f32\[(\d+)", c) or re.search(
            rf"%?{re.escape(m.group(1))} = f32\[(\d+)", text)
        if shape:
          return int(shape.group(1))
  return -1


def minimum(count: int) -> float:
  grads = 2 * (N - 1) / N * 2 * D * H * 4
  block = 2 * B // N * D * 4                     # x and y, one device's rows
  if count == 1 or count % N == 0 and count > 1 and B // count % N == 0:
    return grads + (0 if count == 1 else (N - 1) / N * block)
  return grads + block


def measure(count: int, runs: int, form: str = "scan") -> dict:
  mesh = gshard.make_mesh((N,), ("data",))
  rng = np.random.default_rng(0)
  p = {"w1": rng.standard_normal((D, H)).astype(np.float32) / 16,
       "w2": rng.standard_normal((H, D)).astype(np.float32) / 32}
  x = rng.standard_normal((B, D)).astype(np.float32)
  y = rng.standard_normal((B, D)).astype(np.float32)
  specs = (P(), P("data"), P("data"))
  rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  placed = (jax.tree.map(lambda a: jax.device_put(a, rep), p),
            jax.device_put(x, split), jax.device_put(y, split))
  step = accumulate(count, form)
  systems = {"gshard": gshard.partition(step, mesh, in_specs=specs),
             "GSPMD": gshard.gspmd_jit(step, mesh, in_specs=specs)}
  out = {}
  for name, fn in systems.items():
    compiled = fn.lower(*placed).compile()
    text = compiled.as_text()
    mem = compiled.memory_analysis()
    out[name] = dict(bytes=hlo.bytes_sent(text, N), rows=_rows(text),
                     memory=mem.temp_size_in_bytes + mem.argument_size_in_bytes
                     + mem.output_size_in_bytes, times=[],
                     value=jax.block_until_ready(fn(*placed)))
  for _ in range(3):
    for fn in systems.values():
      jax.block_until_ready(fn(*placed))
  for _ in range(runs):
    for name, fn in systems.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*placed))
      out[name]["times"].append(time.perf_counter() - t0)
  diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(
      jax.tree.leaves(out["gshard"]["value"]), jax.tree.leaves(out["GSPMD"]["value"])))
  return dict(count=count, form=form, minimum=minimum(count), diff=diff, **{
      name: dict(r, step_ms=1e3 * float(np.median(r["times"]))) for name, r in out.items()})


def table(rows) -> list[str]:
  lines = ["| form | K | rows per micro-batch | system | bytes / device / step | vs minimum "
           "| rows one device computes | memory / device | step ms (median) |",
           "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
  for r in rows:
    for name in ("gshard", "GSPMD"):
      s = r[name]
      lines.append(f"| {r['form']} | {r['count']} | {B // r['count']} | {name} | "
                   f"{s['bytes'] / 1024:,.1f} KiB "
                   f"| {s['bytes'] / r['minimum']:.2f}x | {s['rows']} | "
                   f"{s['memory'] / 2**20:.2f} MiB | {s['step_ms']:.2f} |")
  return lines


def _commit() -> str:
  try:
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT,
                         capture_output=True, text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           cwd=_ROOT, capture_output=True, text=True).stdout.strip()
    return sha + (" + uncommitted changes" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def _other_gspmd(rows, form: str) -> str:
  """What GSPMD does with ``form``, from the measured rows."""
  fori = [r for r in rows if r["form"] == form and r["count"] > 1]
  return ("it sends " + ", ".join(f"K={r['count']} {r['GSPMD']['bytes'] / r['minimum']:.2f}x"
                                for r in fori)
          + " the minimum and computes " + ", ".join(
              f"{r['GSPMD']['rows'] // max(1, r['gshard']['rows'])}x" for r in fori)
          + " gshard's rows; its step takes " + ", ".join(
              f"{r['GSPMD']['step_ms'] / r['gshard']['step_ms']:.2f}x" for r in fori)
          + " gshard's")


def write_doc(rows, runs: int, load) -> None:
  scans = [r for r in rows if r["form"] == "scan"]
  dp = [r for r in rows if r["gshard"]["rows"] == B // r["count"] // N]
  lo = min(r["gshard"]["bytes"] / r["minimum"] for r in rows)
  hi = max(r["gshard"]["bytes"] / r["minimum"] for r in rows)
  vs_min = f"{lo:.2f}x the minimum" + (f" to {hi:.2f}x" if f"{hi:.2f}" != f"{lo:.2f}" else
                                        " for every K")
  lines = [
      "# Gradient accumulation: gshard vs XLA GSPMD", "",
      "Generated by `benchmarks/accumulate.py`; rerun it rather than editing the "
      "measured sections.", "",
      f"An MLP SGD step (B={B}, D={D}, H={H}, f32) with its gradient accumulated over "
      "K micro-batches in three forms: `scan`, as MaxText writes it (the batch "
      "reshaped to [K, B/K, D], a `lax.scan` adding the gradients); `fori`, a "
      "`lax.fori_loop` reading micro-batch i as `lax.dynamic_slice_in_dim(x, i * B/K, "
      "B/K)`; and `python`, a Python loop over `x[k*B/K:(k+1)*B/K]`. The batch is split over `data` = 8 simulated CPU devices, the weights "
      "replicated, nothing else annotated. Both systems get the same function and "
      "`in_specs`.", "",
      f"- Measured: {datetime.date.today().isoformat()}, commit {_commit()}",
      f"- Machine: {os.cpu_count()} CPU cores, 8 simulated CPU devices, jax "
      f"{jax.__version__}. Load average (1 min) {load[0]:.1f} at the start, "
      f"{load[1]:.1f} at the end.",
      "- Bytes: per device over one step, from each compiled program's HLO "
      "(benchmarks/hlo.py; a collective inside the loop counted once per "
      "iteration). Minimum: the gradient's all-reduce, plus each device's block "
      "of x and y moved once (the ppermute rounds) where K is no multiple of 8, "
      "or 7/8 of it (an all-to-all) where it is.",
      "- Rows one device computes: the leading dim of the first dot's operand in "
      "the compiled loop body; B/K/8 is data parallel, B/K is every device "
      "computing the whole micro-batch.",
      f"- Step time: median of {runs} calls per system, the two alternating; on "
      "simulated devices sharing the host's cores it says little about a real mesh.",
      "", *table(rows), "",
      "Largest difference between the two systems' new weights: "
      + ", ".join(f"{r['form']} K={r['count']} {r['diff']:.1e}" for r in rows) + ".", "",
      "## Reading", "",
      f"- gshard computes each micro-batch data parallel for every K and form "
      f"({len(dp)} of {len(rows)} rows of the table), and sends {vs_min}.",
      "- The `fori` and `python` forms are read from the reshaped batch: gshard "
      "rewrites the loop that slices micro-batch i at i * B/K into a scan over "
      "it, and the static slices into its micro-batches (docs/design.md, "
      "\"Micro-batches keep their split\"). GSPMD, `fori`: " + _other_gspmd(rows, "fori")
      + ". GSPMD, `python`: " + _other_gspmd(rows, "python") + ".",
      "- `scan`, fewer micro-batches than devices (K=2, 4): the reshape moves each device's "
      "rows to where the micro-batches split over `data` want them (K ppermutes), "
      "and the gradient's sum stays pending round the loop: one all-reduce after "
      "it. GSPMD splits each micro-batch over 8/K devices only: it all-gathers "
      "within groups, computes K times the rows, and all-reduces the gradient "
      "inside the loop, once per micro-batch.",
      "- `scan`, at least as many (K=8..32): the reshape is free (the micro-batch dim "
      "takes `data`); the scan moves the split to the rows with one all-to-all "
      "instead of gathering the micro-batches. GSPMD gathers them and every "
      "device computes every row: it sends fewer bytes than the gradient's "
      "all-reduce (" + ", ".join(
          f"K={r['count']} {r['GSPMD']['bytes'] / r['gshard']['bytes']:.2f}x gshard's"
          for r in scans if r["count"] >= N) + ") for "
      + ", ".join(f"{r['GSPMD']['rows'] // max(1, r['gshard']['rows'])}x" for r in scans
                  if r["count"] >= N)
      + " the rows, and its step takes " + ", ".join(
          f"{r['GSPMD']['step_ms'] / r['gshard']['step_ms']:.2f}x" for r in scans
          if r["count"] >= N) + " gshard's. This is the one place gshard spends "
      "bytes to save compute: it keeps the data parallelism the in_specs ask for "
      "(docs/design.md, \"Micro-batches keep their split\").",
      "",
  ]
  with open(DOC, "w") as f:
    f.write("\n".join(lines))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--runs", type=int, default=20)
  ap.add_argument("--no-doc", action="store_true")
  args = ap.parse_args()
  assert jax.device_count() == N, jax.devices()
  load0 = os.getloadavg()[0]
  rows = []
  for form in FORMS:
    for count in COUNTS:
      rows.append(measure(count, args.runs, form))
      r, g, x = rows[-1], rows[-1]["gshard"], rows[-1]["GSPMD"]
      print(f"{form} K={count}: gshard {g['bytes']:.0f} B, rows {g['rows']}, "
            f"{g['step_ms']:.2f} ms; GSPMD {x['bytes']:.0f} B, rows {x['rows']}, "
            f"{x['step_ms']:.2f} ms; min {r['minimum']:.0f}", flush=True)
  print("\n".join(table(rows)))
  if not args.no_doc:
    write_doc(rows, args.runs, (load0, os.getloadavg()[0]))
    print(f"wrote {os.path.relpath(DOC, _ROOT)}")


if __name__ == "__main__":
  main()
