"""GPipe inside the partitioned program: its structure against the formulas.

Step time of a pipeline on simulated CPU devices is not meaningful (the
devices share the host's cores), so this measures structure, read from the
per-device program gshard builds and from XLA's compiled program:

1. bubble and per-device FLOPs against M and K: the schedule's bubble
   ``(K-1)/(M+K-1)``; the matmul FLOPs each device runs (counted from the
   per-device jaxpr, scans times their length) against its share of the plain
   loop, whose ratio must be ``T/M = 1/(1 - bubble)``;
2. ticks and collective permutes: the tick loop's trip count ``M*v + K - 1``,
   the bytes of one permute (XLA's instruction) against one local micro-batch
   ``(B/M/data) * D * 4``, the permute bytes per step ``2 * T`` times that
   (gshard's record), the data-parallel gradient reduction;
3. temporary memory with and without remat (``memory_analysis()``) against
   the activations each keeps: without remat every layer's residuals of every
   tick (``T * S * r``), with remat the stage inputs of every tick plus one
   tick's recompute (``T * a + S * r``); ``r`` is one layer's residuals on one
   micro-batch (from ``jax.vjp``), ``a`` one micro-batch's activation;
4. the weights each device holds (argument bytes) against 1/K of the stack;
5. gshard's own time for a 64-layer pipeline lowered for TPU pods of 64 to
   2048 devices (AbstractMesh (data, stage=16, model)).

The model: residual MLP layers ``h + gelu(h @ w1) @ w2`` (D=64, H=256), an
SGD step on the mean square of the output. Writes docs/benchmarks-pipeline.md.

Run: ``.venv/bin/python benchmarks/pipeline.py [--quick]`` (part of ``make bench``).
"""

from __future__ import annotations

import math
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)
_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.extend.core import jaxprs_in_params  # noqa: E402
from jax.sharding import AbstractMesh, AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import gshard  # noqa: E402
from benchmarks import hlo  # noqa: E402
from gshard import pipeline  # noqa: E402
from gshard.pipeline.costs import jaxpr_counts  # noqa: E402
from gshard.spmd.inspect import format_bytes  # noqa: E402

D, H = 64, 256


def layer_fn(p, h):
  return h + jax.nn.gelu(h @ p["w1"]) @ p["w2"]


def layer_params(num_layers):
  keys = jax.random.split(jax.random.PRNGKey(0), num_layers)
  return [{"w1": jax.random.normal(k, (D, H)) / D ** 0.5,
           "w2": jax.random.normal(jax.random.fold_in(k, 1), (H, D)) / H ** 0.5 / 4}
          for k in keys]


def train_step(m, **kw):
  def loss(stacked, x):
    return jnp.mean(pipeline.run(layer_fn, stacked, x, num_microbatches=m, **kw) ** 2)

  def step(stacked, x):
    value, grads = jax.value_and_grad(loss)(stacked, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, stacked, grads), value
  return step


def lower(mesh_shape, names, num_layers, m, batch, **kw):
  mesh = gshard.make_mesh(mesh_shape, names)
  stacked = pipeline.stack(layer_params(num_layers), repeats=kw.get("repeats", 1))
  lead = (None,) if kw.get("repeats", 1) > 1 else ()
  data = P("data") if "data" in names else P()
  step = gshard.partition(train_step(m, **kw), mesh, in_specs=(P(*lead, "stage"), data))
  return step.lower(stacked, jnp.ones((batch, D))), stacked


def dot_flops(jaxpr) -> int:
  """Matmul FLOPs of a jaxpr: 2 * prod(lhs) * prod(rhs free) each; scans x length."""
  total = 0
  for e in jaxpr.eqns:
    if e.primitive.name == "dot_general":
      (_, rc), (_, rb) = e.params["dimension_numbers"]
      rhs = e.invars[1].aval.shape
      free = [n for i, n in enumerate(rhs) if i not in rc and i not in rb]
      total += 2 * math.prod(e.invars[0].aval.shape) * math.prod(free)
    for sub in jaxprs_in_params(e.params):
      total += dot_flops(sub) * (e.params["length"] if e.primitive.name == "scan" else 1)
  return total


def layer_residual_bytes(rows: int) -> int:
  """Bytes jax keeps from one layer's forward for its backward, on ``rows``
  rows, weights excluded."""
  p = layer_params(1)[0]
  res = jax.eval_shape(lambda p, h: jax.vjp(layer_fn, p, h)[1], p,
                       jax.ShapeDtypeStruct((rows, D), jnp.float32))
  weights = sum(a.size * 4 for a in jax.tree.leaves(p))
  return sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(res)) - weights


# -- 1. bubble and FLOPs ------------------------------------------------------------

def bubble_rows(quick: bool):
  rows = []
  for k in (2, 4) if quick else (2, 4, 8):
    for m in (k, 2 * k, 4 * k) if quick else (k, 2 * k, 4 * k, 8 * k):
      batch, num_layers = 64, 2 * k
      sched = pipeline.schedule("gpipe", num_stages=k, num_microbatches=m)
      low, _ = lower((k,), ("stage",), num_layers, m, batch)
      jaxpr = low.per_device_jaxpr()
      measured = dot_flops(jaxpr)
      # the plain loop's matmuls, remat included (forward, recompute, backward:
      # 8 matmuls of 2*B*D*H per layer), shared by K devices
      share = num_layers * 8 * 2 * batch * D * H / k
      ticks = m + k - 1
      rows.append(dict(K=k, M=m, bubble=sched.bubble_fraction,
                       formula=(k - 1) / (m + k - 1), flops=measured,
                       all_flops=jaxpr_counts(jaxpr)[0], share=share,
                       ratio=measured / share, expected=ticks / m))
  return rows


# -- 2. ticks and permutes ------------------------------------------------------------

def permute_rows(quick: bool):
  rows = []
  mesh_shape, names, data, k, batch = (2, 4), ("data", "stage"), 2, 4, 64
  for v in (1, 2):
    for m in (4, 8) if quick else (4, 8, 16):
      num_layers = 8 * v
      low, stacked = lower(mesh_shape, names, num_layers, m, batch, repeats=v)
      jaxpr = low.per_device_jaxpr()
      lengths = sorted(e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan")
      ticks = m * v + k - 1
      compiled = low.compile()
      perms = [c for c in hlo.collectives(compiled.as_text(), 8)
               if c.kind == "collective-permute"]
      mb_bytes = batch // m // data * D * 4
      own = [c for c in low.collectives() if c.kind == "ppermute"]
      dp = sum(c.bytes for c in low.collectives() if c.kind == "psum" and c.axes == ("data",))
      stage_weights = sum(a.size * 4 for a in jax.tree.leaves(stacked)) // k
      rows.append(dict(v=v, M=m, K=k, ticks=max(lengths), formula=ticks,
                       hlo_permutes=len(perms), permute_bytes=[p.operand_bytes for p in perms],
                       mb_bytes=mb_bytes, step_bytes=sum(c.bytes for c in own),
                       step_formula=2 * ticks * mb_bytes, dp_bytes=dp,
                       dp_once=2 * (data - 1) / data * stage_weights))
  return rows


# -- 3./4. memory ---------------------------------------------------------------------

def memory_rows(quick: bool):
  rows = []
  k, num_layers, batch = 4, 8, 256
  for m in (4, 8) if quick else (4, 8, 16):
    temp, args = {}, 0
    for remat in (True, False):
      low, stacked = lower((k,), ("stage",), num_layers, m, batch, remat=remat)
      mem = low.compile().memory_analysis()
      temp[remat] = mem.temp_size_in_bytes
      args = mem.argument_size_in_bytes
    ticks, slots, rows_mb = m + k - 1, num_layers // k, batch // m
    r, a = layer_residual_bytes(rows_mb), rows_mb * D * 4
    stack_bytes = sum(x.size * 4 for x in jax.tree.leaves(stacked))
    rows.append(dict(M=m, T=ticks, S=slots, r=r, a=a, remat=temp[True],
                     no_remat=temp[False], f_remat=ticks * a + slots * r,
                     f_no_remat=ticks * slots * r, weights=args - batch * D * 4,
                     stack=stack_bytes, K=k))
  return rows


# -- 5. pod lowering ---------------------------------------------------------------------

def pod_rows(quick: bool):
  rows = []
  num_layers, batch, m = 64, 512, 32

  def pod_layer(p, h):
    u = gshard.shard(jax.nn.gelu(h @ p["w1"]), P("data", "model"))
    return h + u @ p["w2"]

  def make_step():   # a new function each time: jax's trace cache does not hide the trace
    def step(stacked, x):
      def loss(s, x):
        return jnp.mean(pipeline.run(pod_layer, s, x, num_microbatches=m) ** 2)
      value, grads = jax.value_and_grad(loss)(stacked, x)
      return jax.tree.map(lambda p, g: p - 0.1 * g, stacked, grads), value
    return step

  stacked = {"w1": jax.ShapeDtypeStruct((num_layers, 256, 1024), jnp.float32),
             "w2": jax.ShapeDtypeStruct((num_layers, 1024, 256), jnp.float32)}
  x = jax.ShapeDtypeStruct((batch, 256), jnp.float32)
  specs = ({"w1": P("stage", None, "model"), "w2": P("stage", "model", None)}, P("data"))
  for shape in ((2, 16, 2), (16, 16, 8)) if quick else \
      ((2, 16, 2), (4, 16, 4), (8, 16, 8), (16, 16, 8)):
    best = None
    for _ in range(2):
      mesh = AbstractMesh(shape, ("data", "stage", "model"), axis_types=(AxisType.Auto,) * 3)
      t0 = time.perf_counter()
      low = gshard.partition(make_step(), mesh, in_specs=specs).lower(stacked, x,
                                                                       platform="tpu")
      total = time.perf_counter() - t0
      t = low.timings
      run = dict(devices=math.prod(shape), mesh="x".join(map(str, shape)), trace=t["trace"],
                 propagate=t["propagate"], lower=t["lower"] + t["partition_setup"],
                 total=total, kib=len(low.as_text()) / 1024)
      best = run if best is None or run["total"] < best["total"] else best
    rows.append(best)
  return rows


# -- the report ---------------------------------------------------------------------------

def report(quick: bool = False) -> list[str]:
  b, p, mem, pod = bubble_rows(quick), permute_rows(quick), memory_rows(quick), pod_rows(quick)
  lines = ["# Pipeline parallelism: structure against the formulas", "",
           "GPipe (`gshard.pipeline.run`) as one loop inside the partitioned program. "
           "Step time on simulated CPU devices is meaningless (the devices share the "
           "host's cores), so this reports structure counted from the programs gshard "
           "builds. Model: residual MLP layers `h + gelu(h @ w1) @ w2` (D=64, H=256), an "
           "SGD step on the mean square of the output, remat on unless noted.", "",
           "Reproduce: `python benchmarks/pipeline.py` (part of `make bench`).", "",
           "## Bubble and FLOPs per device", "",
           "Mesh (stage=K), L=2K layers, batch 64. *bubble* is the GPipe schedule's idle "
           "share (`pipeline.schedule`), against `(K-1)/(M+K-1)`. *matmul FLOPs* are "
           "counted from the per-device program (scans times their length); *share* is the "
           "plain loop's matmul FLOPs (forward, recompute, backward) divided by K. Every "
           "device computes in every tick (bubble ticks on a real micro-batch, discarded), "
           "so the ratio is `T/M = 1/(1-bubble)`.", "",
           "| K | M | bubble | (K-1)/(M+K-1) | matmul FLOPs / device | all FLOPs / device "
           "| share of the plain loop | ratio | T/M |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in b:
    lines.append(f"| {r['K']} | {r['M']} | {r['bubble']:.3f} | {r['formula']:.3f} | "
                 f"{r['flops'] / 1e6:.2f} M | {r['all_flops'] / 1e6:.2f} M | "
                 f"{r['share'] / 1e6:.2f} M | {r['ratio']:.3f} | {r['expected']:.3f} |")
  lines += ["", "## Ticks and collective permutes", "",
            "Mesh (data=2, stage=4), batch 64, L=8 per pass (16 with repeats=2). *ticks* "
            "is the trip count of the tick loop in the per-device program; XLA's optimized "
            "HLO has two collective permutes (the shift and, in the backward loop, its "
            "transpose), each of one local micro-batch `(B/M/data)*D*4` bytes; per step "
            "they send `2*T` of those (gshard's record, trip counts applied). The last "
            "column is the data-parallel gradient reduction of the stage's weights, against "
            "one all-reduce per step (see the reading below).", "",
            "| repeats | M | ticks | M*v+K-1 | HLO permutes | bytes each | (B/M/data)*D*4 "
            "| permute bytes / step | 2*T*that | data psum / step | once per step |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in p:
    each = "/".join(str(x) for x in sorted(set(r["permute_bytes"])))
    lines.append(f"| {r['v']} | {r['M']} | {r['ticks']} | {r['formula']} | "
                 f"{r['hlo_permutes']} | {each} | {r['mb_bytes']} | "
                 f"{format_bytes(r['step_bytes'])} | {format_bytes(r['step_formula'])} | "
                 f"{format_bytes(r['dp_bytes'])} | {format_bytes(r['dp_once'])} |")
  lines += ["", "## Temporary memory with and without remat", "",
            "Mesh (stage=4), L=8 (S=2 layers per stage), batch 256. `r` is one layer's "
            "residuals on one micro-batch (from `jax.vjp`, weights excluded), `a` one "
            "micro-batch's activation. Without remat every tick keeps every layer's "
            "residuals (`T*S*r`); with remat only the stage inputs (`T*a`) plus one tick's "
            "recompute (`S*r`). Both programs also hold the same gradient and I/O buffers, so "
            "the *difference* of the measured temp sizes is compared with the difference of "
            "the formulas.", "",
            "| M | T | r | a | temp, remat | temp, no remat | T*a+S*r | T*S*r "
            "| measured difference | formula difference | weights / device | stack / K |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in mem:
    lines.append(f"| {r['M']} | {r['T']} | {format_bytes(r['r'])} | {format_bytes(r['a'])} | "
                 f"{format_bytes(r['remat'])} | {format_bytes(r['no_remat'])} | "
                 f"{format_bytes(r['f_remat'])} | {format_bytes(r['f_no_remat'])} | "
                 f"{format_bytes(r['no_remat'] - r['remat'])} | "
                 f"{format_bytes(r['f_no_remat'] - r['f_remat'])} | "
                 f"{format_bytes(r['weights'])} | {format_bytes(r['stack'] / r['K'])} |")
  lines += ["", "## gshard's own time for a pod", "",
            "64 layers (D=256, H=1024, the hidden dim over `model`), 16 stages, 32 "
            "micro-batches, batch 512, lowered for TPU from an AbstractMesh (best of two).",
            "", "| devices | mesh (data x stage x model) | trace s | propagate s "
            "| partition + lower s | total s | StableHLO KiB |",
            "|---:|---|---:|---:|---:|---:|---:|"]
  for r in pod:
    lines.append(f"| {r['devices']} | {r['mesh']} | {r['trace']:.2f} | {r['propagate']:.2f} | "
                 f"{r['lower']:.2f} | {r['total']:.2f} | {r['kib']:.0f} |")
  lines += ["", reading(b, p, mem, pod)]
  return lines


def reading(b, p, mem, pod) -> str:
  """A paragraph computed from the rows just measured."""
  bubble_ok = all(abs(r["bubble"] - r["formula"]) < 1e-12 for r in b)
  flops_ok = all(abs(r["ratio"] - r["expected"]) < 1e-9 for r in b)
  ticks_ok = all(r["ticks"] == r["formula"] for r in p)
  bytes_ok = all(set(r["permute_bytes"]) == {r["mb_bytes"]} and
                 r["step_bytes"] == r["step_formula"] for r in p)
  dp1 = [r["dp_bytes"] / r["dp_once"] for r in p if r["v"] == 1]
  dpv = [r["dp_bytes"] / r["dp_once"] for r in p if r["v"] > 1]
  mem_err = [(r["no_remat"] - r["remat"]) / (r["f_no_remat"] - r["f_remat"]) for r in mem]
  weights_ok = all(r["weights"] == r["stack"] // r["K"] for r in mem)
  times = [r["total"] for r in pod]
  return (
      "Reading: the bubble is " + ("exactly" if bubble_ok else "NOT") + " (K-1)/(M+K-1) "
      "and the matmul FLOPs per device are " + ("exactly" if flops_ok else "NOT") +
      " T/M times the device's share of the plain loop: the bubble costs compute, not "
      "only time, because every device runs every tick. The tick loop runs "
      + ("exactly" if ticks_ok else "NOT") + " M*repeats+K-1 ticks and the permutes "
      "carry " + ("exactly" if bytes_ok else "NOT") + " one local micro-batch each way per "
      f"tick. Remat cuts temporary memory by {min(r['no_remat'] / r['remat'] for r in mem):.1f}-"
      f"{max(r['no_remat'] / r['remat'] for r in mem):.1f}x; the measured saving is "
      f"{min(mem_err):.2f}-{max(mem_err):.2f}x the formula's. Each device's weights are "
      + ("exactly" if weights_ok else "NOT") + " 1/K of the stack. gshard's own time for "
      f"the 64-layer pod pipeline is {min(times):.2f}-{max(times):.2f} s from "
      f"{pod[0]['devices']} to {pod[-1]['devices']} devices (flat: one SPMD program). "
      f"The data-parallel gradient reduction sends {_span(dp1)}x the bytes of one "
      f"all-reduce of the stage's weights per step with one pass, {_span(dpv)}x with "
      "repeats: the weight gradients' accumulators stay pending sums across the backward "
      "ticks (with repeats, through the select that picks a repeat's weights) and are "
      "reduced once, after them.")


def _span(xs) -> str:
  return f"{min(xs):.2f}-{max(xs):.2f}" if xs else "-"


def main(quick: bool = False) -> None:
  from benchmarks import pipeline_schedules
  lines = report(quick) + [""] + pipeline_schedules.report(quick)
  print("\n".join(lines))
  if not quick:
    path = os.path.join(_ROOT, "docs", "benchmarks-pipeline.md")
    with open(path, "w") as f:
      f.write("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
  main(quick="--quick" in sys.argv)
