"""The schedules of ``pipeline.run(..., loss_fn=...)`` against their formulas.

The "Schedules" section of docs/benchmarks-pipeline.md (benchmarks/pipeline.py
appends it to its report; this module's ``main`` rewrites only that section):

1. temporary memory (``compiled.memory_analysis()``) against M at a fixed batch
   for ``gpipe``'s table and ``1f1b``, no remat, with the stash the plan
   allocates (slots x layers per stage x one layer's residuals on B/M rows);
2. per (schedule, K, M, v): the executed (lockstep) table's ticks and bubble
   against the formulas; matmul FLOPs per device counted from the per-device
   program (each phase's conditional times the ticks that run it) against
   the plain loop's share (every device runs every stage of a phase: the
   ratio is the phase ticks over M*v); collective-permute bytes per step,
   gshard's record (each permute counted once per tick of the loop) and
   executed (only ticks with an F or B phase send).

Run: ``.venv/bin/python benchmarks/pipeline_schedules.py [--quick]``.
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from benchmarks.pipeline import D, H, dot_flops, layer_fn, layer_params, \
    layer_residual_bytes  # noqa: E402  (sets XLA_FLAGS before jax)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import gshard  # noqa: E402
from gshard import pipeline  # noqa: E402
from gshard.pipeline.plan import plan  # noqa: E402
from gshard.spmd.inspect import format_bytes  # noqa: E402

HEADING = "## Schedules: 1F1B, interleaved, zero bubble"


def lower(name, k, m, v, batch, remat=True):
  num_layers = 2 * k * v
  stacked = pipeline.stack(layer_params(num_layers), repeats=v)
  lead = (None,) if v > 1 else ()

  def loss(stacked, x):
    return pipeline.run(layer_fn, stacked, x, num_microbatches=m, schedule=name, repeats=v,
                        remat=remat, loss_fn=lambda lp, y, t: jnp.mean((y - t) ** 2),
                        loss_params=(), targets=x)
  step = gshard.partition(jax.grad(loss), gshard.make_mesh((k,), ("stage",)),
                          in_specs=(P(*lead, "stage"), P()))
  return step.lower(stacked, jnp.ones((batch, D)))


def memory_rows(quick: bool):
  rows, k, batch = [], 4, 256
  for m in (4, 8, 16) if quick else (4, 8, 16, 32):
    for name in ("gpipe", "1f1b"):
      mem = lower(name, k, m, 1, batch, remat=False).compile().memory_analysis()
      slots = plan(pipeline.schedule(name, num_stages=k, num_microbatches=m,
                                     lockstep=True)).slots["stash"]
      rows.append(dict(name=name, M=m, temp=mem.temp_size_in_bytes, slots=slots,
                       stash=slots * 2 * layer_residual_bytes(batch // m)))
  return rows


def phase_flops(low, sched):
  """Matmul FLOPs per device: each phase's conditional in the tick loop times
  the ticks that run it, plus everything outside the loop."""
  p = plan(sched)
  jaxpr = low.per_device_jaxpr()
  loops = [e for e in jaxpr.eqns
           if e.primitive.name == "scan" and e.params["length"] == sched.num_ticks]
  body = loops[0].params["jaxpr"].jaxpr
  phases = [ph for ph in ("F", "H", "B", "W") if p.count(ph)]
  conds = [e for e in body.eqns if e.primitive.name == "cond"]
  assert len(conds) == len(phases), (phases, len(conds))
  total = 0
  for ph, e in zip(phases, conds):
    total += max(dot_flops(b.jaxpr) for b in e.params["branches"]) * p.count(ph)
  outside = dot_flops(jaxpr) - dot_flops(body) * sched.num_ticks
  return total + outside


def schedule_rows(quick: bool):
  rows, batch = [], 64
  configs = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1)]
  for k in (2, 4):
    for m in (k, 2 * k):
      for name, v in configs:
        sched = pipeline.schedule(name, num_stages=k, num_microbatches=m, repeats=v,
                                  lockstep=True)
        low = lower(name, k, m, v, batch)
        p = plan(sched)
        flops = phase_flops(low, sched)
        # the plain loop: per layer forward 2, recompute 2, backward 4 matmuls of
        # 2*B*D*H each (remat=True), shared by the K devices
        share = 2 * k * v * 8 * 2 * batch * D * H / k
        if name == "zero_bubble":
          formula = 2 * (k - 1) / (3 * m + 2 * k - 2)
        else:
          formula = (k - 1) / (v * m + k - 1)
        mb = batch // m * D * 4
        record = sum(c.bytes for c in low.collectives() if c.kind == "ppermute")
        rows.append(dict(name=name, K=k, M=m, v=v, ticks=sched.num_ticks,
                         bubble=sched.bubble_fraction, formula=formula,
                         peak=sched.peak_in_flight, flops=flops, share=share,
                         # per layer and micro-batch, in 2*rows*D*H units: F 2 matmuls;
                         # B 6 (recompute, input and weight grads) or, split, 4 and W 2
                         want=(2 * p.count("F") + (4 if sched.split else 6) * p.count("B")
                               + 2 * p.count("W")) / (8 * m * v),
                         record=record, executed=(p.count("F") + p.count("B")) * mb,
                         f_ticks=p.count("F"), b_ticks=p.count("B"), w_ticks=p.count("W")))
  return rows


def report(quick: bool = False) -> list[str]:
  mem, rows = memory_rows(quick), schedule_rows(quick)
  lines = [HEADING, "",
           "`pipeline.run(..., loss_fn=..., schedule=...)` runs the schedule's lockstep table "
           "(`pipeline.schedule(name, K, M, v, lockstep=True)`: every tick one kind of action "
           "on all stages) in one `custom_vjp` forward. Reproduce: "
           "`python benchmarks/pipeline_schedules.py`.", "",
           "### Temporary memory against M (fixed batch 256, K=4, L=8, no remat)", "",
           "*stash* is what the plan allocates for the backward: slots x 2 layers per stage x "
           "one layer's residuals on B/M rows (`jax.vjp`, weights excluded). GPipe's table "
           "keeps every micro-batch's stash, M of B/M rows (the whole batch, whatever M); "
           "lockstep 1F1B at most 2K-1 = 7, so its stash shrinks as 1/M.", "",
           "| M | gpipe temp | gpipe stash slots | gpipe stash | 1f1b temp | 1f1b stash slots "
           "| 1f1b stash |", "|---:|---:|---:|---:|---:|---:|---:|"]
  by = {(r["name"], r["M"]): r for r in mem}
  for m in sorted({r["M"] for r in mem}):
    g, o = by["gpipe", m], by["1f1b", m]
    lines.append(f"| {m} | {format_bytes(g['temp'])} | {g['slots']} | {format_bytes(g['stash'])} "
                 f"| {format_bytes(o['temp'])} | {o['slots']} | {format_bytes(o['stash'])} |")
  lines += ["", "### Ticks, bubble, FLOPs and permutes per step (batch 64, L=2Kv, remat)", "",
            "*bubble* is the executed table's idle share under unit costs, against "
            "`(K-1)/(vM+K-1)` (gpipe, 1f1b, interleaved) and `2(K-1)/(3M+2K-2)` (lockstep "
            "zero bubble: `3M+2K-2` ticks). *F/B/W ticks*: ticks running each phase. *matmul "
            "FLOPs / device*: counted from the per-device program, each phase's conditional "
            "times its ticks; *share*: the plain loop's matmul FLOPs / K (every device "
            "computes its stage in every tick of a phase, so the ratio is the phase ticks over "
            "M*v; *formula*: `(2F + 6B)/(8Mv)` in phase ticks, split `(2F + 4B + 2W)/(8Mv)`). *permutes, record*: gshard's count (each permute once per loop trip); "
            "*executed*: (F ticks + B ticks) x one micro-batch.", "",
            "| schedule | K | M | v | ticks | F/B/W ticks | bubble | formula | peak in flight "
            "| matmul FLOPs / device | share | ratio | formula | permutes, record | executed |",
            "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(
        f"| {r['name']} | {r['K']} | {r['M']} | {r['v']} | {r['ticks']} | "
        f"{r['f_ticks']}/{r['b_ticks']}/{r['w_ticks']} | {r['bubble']:.3f} | "
        f"{r['formula']:.3f} | {r['peak']} | {r['flops'] / 1e6:.2f} M | "
        f"{r['share'] / 1e6:.2f} M | {r['flops'] / r['share']:.3f} | {r['want']:.3f} | "
        f"{format_bytes(r['record'])} | {format_bytes(r['executed'])} |")
  return lines


def main(quick: bool = False) -> None:
  lines = report(quick)
  print("\n".join(lines))
  if quick:
    return
  path = os.path.join(_ROOT, "docs", "benchmarks-pipeline.md")
  with open(path) as f:
    text = f.read()
  head = text.split(HEADING)[0].rstrip("\n")
  with open(path, "w") as f:
    f.write(head + "\n\n" + "\n".join(lines) + "\n")
  print(f"wrote {path}")


if __name__ == "__main__":
  main(quick="--quick" in sys.argv)
