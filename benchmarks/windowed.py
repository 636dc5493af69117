"""Windowed einsum: gshard without it, gshard with it, XLA's GSPMD, side by side.

A Megatron sequence-parallel MLP block on ``model`` = 8 simulated CPU devices:

  x f32[B, T@model, D]  ->  x . W1       f32[B, T, F@model]  (x gathered over T)
                        ->  h = gelu(...)
                        ->  y = h . W2     f32[B, T@model, D]  (reduce-scattered)

with ``W1 [D, F@model]``, ``W2 [F@model, D]``; ``x . W1`` and ``y`` are annotated
(``gshard.shard``), as Megatron lays them out. Two programs: the forward
block, and an SGD train step of it (``jax.value_and_grad`` of ``sum(y^2)``:
the backward has the gather of ``dy`` for ``dh``, the contracted gathers of
``x`` and ``dy`` for ``dW1`` and ``dW2``, and the reduce-scatter of ``dx``).

Three systems, one process, the same annotations and ``in_specs``:

  gshard off   gshard.partition(...)
  gshard on    gshard.partition(..., windowed_einsum=0)
  GSPMD        gshard.gspmd_jit(...): jax.jit with the annotations as
               with_sharding_constraint (XLA's CPU partitioner has no windowed
               einsum option)

Per system: bytes sent per device (gshard: its record, which counts a loop
body once per trip; GSPMD: its compiled HLO, benchmarks/hlo.py, ring formulas),
the collectives, the compiled program's temp memory and all its memory
(``memory_analysis()``: temp + arguments + outputs), and the median step time
(the three take turns call by call, the order rotating; each call
``block_until_ready``). Writes docs/benchmarks-windowed.md unless ``--no-doc``.

Run: ``.venv/bin/python benchmarks/windowed.py [--runs N] [--no-doc]``
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

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import collections  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import gshard  # noqa: E402
from benchmarks import hlo  # noqa: E402

DOC = os.path.join(_ROOT, "docs", "benchmarks-windowed.md")
SYSTEMS = ("gshard off", "gshard on", "GSPMD")
F32 = 4


def block(params, x):
  """The MLP block, Megatron's sequence-parallel layout annotated."""
  h = gshard.shard(jnp.einsum("btd,df->btf", x, params["w1"]), P(None, None, "model"))
  h = jax.nn.gelu(h)
  y = jnp.einsum("btf,fd->btd", h, params["w2"])
  return gshard.shard(y, P(None, "model", None))


def train_step(params, x):
  """SGD on ``sum(y^2)``: new parameters, the loss and the input's gradient."""
  def loss(params, x):
    return jnp.sum(block(params, x) ** 2)
  value, (g, dx) = jax.value_and_grad(loss, (0, 1))(params, x)
  params = jax.tree.map(lambda p, g: p - 1e-4 * g, params, g)
  return params, value, dx


PARAM_SPECS = {"w1": P(None, "model"), "w2": P("model", None)}
X_SPEC = P(None, "model", None)
PROGRAMS = {
    "forward": (block, (PARAM_SPECS, X_SPEC), X_SPEC),
    "train step": (train_step, (PARAM_SPECS, X_SPEC), (PARAM_SPECS, P(), X_SPEC)),
}


def systems(fn, m, in_specs, out_specs) -> dict:
  return {"gshard off": gshard.partition(fn, m, in_specs=in_specs, out_specs=out_specs),
          "gshard on": gshard.partition(fn, m, in_specs=in_specs, out_specs=out_specs,
                                        windowed_einsum=0),
          "GSPMD": gshard.gspmd_jit(fn, m, in_specs=in_specs, out_specs=out_specs)}


def describe(name: str, fn, args, m) -> dict:
  """Bytes, collectives and memory of one system's compiled program."""
  lowered = fn.lower(*args)
  compiled = lowered.compile()
  mem = compiled.memory_analysis()
  text = compiled.as_text()
  hlo_cols = hlo.collectives(text, m.devices.size)
  out = dict(temp=mem.temp_size_in_bytes,
             total=mem.temp_size_in_bytes + mem.argument_size_in_bytes
             + mem.output_size_in_bytes,
             hlo_bytes=sum(c.total for c in hlo_cols))
  if name.startswith("gshard"):
    cols = lowered.collectives()
    out["bytes"] = sum(c.bytes for c in cols)
    out["kinds"] = collections.Counter(c.kind for c in cols)
    out["rings"] = sum(1 for c in cols if "windowed einsum" in c.role)
  else:
    out["bytes"] = out["hlo_bytes"]
    out["kinds"] = collections.Counter(c.kind.replace("-", "_") for c in hlo_cols)
    out["rings"] = 0
  return out


def timed(fn, args) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0


def run(batch: int, seq: int, d_model: int, d_ff: int, runs: int) -> dict:
  m = gshard.make_mesh((8,), ("model",))
  rng = np.random.default_rng(0)
  params = {"w1": rng.standard_normal((d_model, d_ff)).astype(np.float32) / np.sqrt(d_model),
            "w2": rng.standard_normal((d_ff, d_model)).astype(np.float32) / np.sqrt(d_ff)}
  x = rng.standard_normal((batch, seq, d_model)).astype(np.float32)
  params = jax.tree.map(lambda p, s: jax.device_put(p, NamedSharding(m, s)), params,
                        PARAM_SPECS)
  x = jax.device_put(x, NamedSharding(m, X_SPEC))
  results = {}
  for prog, (fn, in_specs, out_specs) in PROGRAMS.items():
    fns = systems(fn, m, in_specs, out_specs)
    args = (params, x)
    outs = {name: f(*args) for name, f in fns.items()}      # compile, and check
    ref = jax.jit(fn)(*args)
    for name, o in outs.items():
      for a, b in zip(jax.tree.leaves(o), jax.tree.leaves(ref)):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=2e-4,
                                   atol=2e-4 * max(1.0, float(np.max(np.abs(b)))),
                                   err_msg=f"{prog} {name}")
    info = {name: describe(name, f, args, m) for name, f in fns.items()}
    times = {name: [] for name in fns}
    for _ in range(2):
      for f in fns.values():
        timed(f, args)
    order = list(fns)
    for r in range(runs):
      for name in order[r % 3:] + order[:r % 3]:
        times[name].append(timed(fns[name], args))
    for name in fns:
      info[name]["ms"] = 1e3 * statistics.median(times[name])
      lo, _, hi = statistics.quantiles(times[name], n=4)
      info[name]["iqr"] = (1e3 * lo, 1e3 * hi)
    results[prog] = info
  return dict(results=results, batch=batch, seq=seq, d_model=d_model, d_ff=d_ff, runs=runs,
              gathered_x=batch * seq * d_model * F32)


def kib(n: float) -> str:
  return f"{n / 1024:,.1f} KiB"


def table(r: dict) -> list[str]:
  rows = ["| program | system | bytes sent / device | collectives | temp memory | "
          "all memory | step ms, median (IQR) |", "|---|---|---:|---|---:|---:|---:|"]
  for prog, info in r["results"].items():
    for name in SYSTEMS:
      i = info[name]
      kinds = ", ".join(f"{k} x{v}" for k, v in sorted(i["kinds"].items()))
      lo, hi = i["iqr"]
      rows.append(f"| {prog} | {name} | {kib(i['bytes'])} | {kinds} | {kib(i['temp'])} | "
                  f"{kib(i['total'])} | {i['ms']:.1f} ({lo:.1f}-{hi:.1f}) |")
  return rows


def _commit() -> str:
  try:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT, text=True,
                         capture_output=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=_ROOT, text=True,
                           capture_output=True, check=True).stdout.strip()
    return rev + (" + uncommitted changes" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def write_doc(r: dict, load: tuple[float, float]) -> None:
  fwd, step = r["results"]["forward"], r["results"]["train step"]
  lines = [
      "# Benchmark: windowed einsum",
      "",
      "Generated by `make bench` (benchmarks/windowed.py); rerun instead of editing.",
      "",
      "## What",
      "",
      f"A Megatron sequence-parallel MLP block, B={r['batch']}, T={r['seq']}, "
      f"D={r['d_model']}, F={r['d_ff']}, f32, on `model` = 8 simulated CPU devices: "
      "`x [B, T@model, D]`, `x . W1` annotated `[B, T, F@model]`, `h = gelu(x . W1)`, "
      "`y = h . W2` annotated `[B, T@model, D]`, `W1 [D, F@model]`, `W2 [F@model, D]`. "
      "The forward block and an SGD train step of it (loss `sum(y^2)`, the input's "
      "gradient returned too), each run three ways in one process with the same "
      "annotations: gshard without windowed einsum, gshard with "
      "`windowed_einsum=0`, and XLA's GSPMD (`gshard.gspmd_jit`).",
      "",
      "## How to reproduce",
      "",
      "```",
      "make bench                                 # all benchmarks",
      ".venv/bin/python benchmarks/windowed.py    # this one (--no-doc: print only)",
      "```",
      "",
      "## Results",
      "",
      f"- Measured: {datetime.date.today().isoformat()}, commit {_commit()}",
      f"- Machine: {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
      f"8 simulated CPU devices, jax {jax.__version__}, Python {platform.python_version()}. "
      f"Load average (1 min) {load[0]:.1f} at the start, {load[1]:.1f} at the end.",
      f"- {r['runs']} timed calls per system and program, interleaved.",
      "",
      *table(r),
      "",
      "Bytes: gshard's record (a ring's ppermutes, one per step; a loop body's "
      "counted per trip); GSPMD's from its compiled HLO by the ring formulas. "
      "Checked against gshard's own compiled HLO (a collective in a loop counted "
      "once per trip, benchmarks/hlo.py): train step off "
      f"{kib(step['gshard off']['hlo_bytes'])}, on "
      f"{kib(step['gshard on']['hlo_bytes'])}, as recorded. "
      "Memory: `compiled.memory_analysis()`, temp = buffers that are neither "
      "arguments nor outputs; all = temp + arguments + outputs.",
      "",
      "## Reading",
      "",
      f"- Forward: the gathered `x` is {kib(r['gathered_x'])} per device. With the "
      f"ring, temp memory goes from {kib(fwd['gshard off']['temp'])} to "
      f"{kib(fwd['gshard on']['temp'])} "
      f"({fwd['gshard on']['temp'] / fwd['gshard off']['temp']:.2f}x) for the same bytes "
      f"({kib(fwd['gshard off']['bytes'])} vs {kib(fwd['gshard on']['bytes'])}): the "
      "all-gather of `x` and the reduce-scatter of `y` each became n-1 = 7 "
      "collective-permutes of one block, and neither `x` gathered nor `y`'s full "
      f"partial sum is ever held. GSPMD: {kib(fwd['GSPMD']['bytes'])}, temp "
      f"{kib(fwd['GSPMD']['temp'])}.",
      f"- Train step: temp {kib(step['gshard off']['temp'])} off, "
      f"{kib(step['gshard on']['temp'])} on "
      f"({step['gshard on']['temp'] / step['gshard off']['temp']:.2f}x), GSPMD "
      f"{kib(step['GSPMD']['temp'])}; bytes {kib(step['gshard off']['bytes'])} off, "
      f"{kib(step['gshard on']['bytes'])} on. Without the ring one gather of `x` "
      "serves `x . W1` and `dW1 = x^T dh`, and one gather of `dy` serves "
      "`dh = dy . W2^T` and `dW2 = h^T dy` (the gathered values stay alive in "
      "between); with it, each of the four dots runs its own ring (the two weight "
      "gradients as loops that add the steps' partial products), so `x` and `dy` "
      "are each sent twice, as Megatron re-gathers `x` in the backward to save "
      "the memory. That is the trade: more bytes for less memory wherever a "
      "gathered value has several readers; per dot the bytes are the same.",
      "- Step time: on simulated CPU devices (8 devices sharing "
      f"{os.cpu_count()} cores) collectives are memory copies and nothing overlaps, "
      "so the ring's n steps cost their own dispatch and slicing; the numbers say "
      "what the ring costs here, not what it gains on an accelerator, where its "
      "point is to overlap each step's permute with the previous step's matmul.",
      "",
  ]
  with open(DOC, "w") as f:
    f.write("\n".join(lines))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--seq", type=int, default=512)
  ap.add_argument("--d-model", type=int, default=256)
  ap.add_argument("--d-ff", type=int, default=1024)
  ap.add_argument("--runs", type=int, default=20, help="timed calls per system")
  ap.add_argument("--no-doc", action="store_true")
  args = ap.parse_args()
  load0 = os.getloadavg()[0]
  r = run(args.batch, args.seq, args.d_model, args.d_ff, args.runs)
  load1 = os.getloadavg()[0]
  print("\n".join(table(r)))
  for prog, info in r["results"].items():
    print(prog, "rings (ppermutes of windowed einsums):", info["gshard on"]["rings"],
          " gshard off recorded vs HLO bytes:", info["gshard off"]["bytes"],
          info["gshard off"]["hlo_bytes"])
  if not args.no_doc:
    write_doc(r, (load0, load1))
    print(f"wrote {os.path.relpath(DOC, _ROOT)}")


if __name__ == "__main__":
  main()
