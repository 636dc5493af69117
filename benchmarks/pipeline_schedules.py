"""The schedules of ``pipeline.run(..., loss_fn=...)`` against their formulas.

The "Schedules" section of docs/benchmarks-pipeline.md (benchmarks/pipeline.py
appends it to its report; this module's ``main`` rewrites only that section,
and draws the README's schedule pictures, docs/img/schedule-*.png):

1. temporary memory (``compiled.memory_analysis()``) against M at a fixed batch
   for ``gpipe``'s table, ``1f1b`` (the published table, run per device) and
   1F1B's lockstep form, no remat, with the stash the plan allocates (slots x
   layers per stage x one layer's residuals on B/M rows);
2. per (schedule, K, M, v): the executed table's ticks and bubble against the
   formulas; matmul FLOPs per device counted from the per-device program (per
   device: the branch of its own action in each tick; GPipe's phases: each
   phase's conditional times the ticks that run it) against the plain loop's
   share; collective-permute bytes per step, gshard's record (each permute
   counted once per tick of the loop) and executed (only ticks where some
   stage sends in that direction).

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
from gshard.pipeline.plan import per_device, per_device_codes, per_device_kinds, plan  # noqa: E402
from gshard.spmd.inspect import format_bytes  # noqa: E402

HEADING = "## Schedules: 1F1B, interleaved, zero bubble"


def lower(sched, k, m, v, batch, remat=True, data=1):
  """``sched``: a name (its published table) or a Schedule; ``data`` > 1 adds a
  data axis the batch is split over."""
  num_layers = 2 * k * v
  stacked = pipeline.stack(layer_params(num_layers), repeats=v)
  lead = (None,) if v > 1 else ()

  def loss(stacked, x):
    return pipeline.run(layer_fn, stacked, x, num_microbatches=m, schedule=sched, repeats=v,
                        remat=remat, loss_fn=lambda lp, y, t: jnp.mean((y - t) ** 2),
                        loss_params=(), targets=x)
  mesh = (gshard.make_mesh((data, k), ("data", "stage")) if data > 1
          else gshard.make_mesh((k,), ("stage",)))
  step = gshard.partition(jax.grad(loss), mesh,
                          in_specs=(P(*lead, "stage"), P("data") if data > 1 else P()))
  return step.lower(stacked, jnp.ones((batch, D)))


def data_rows(quick: bool):
  """With a data axis (data=2, stage=4, M=8): the bytes the data-parallel
  gradient reduction sends per step, against one all-reduce of a stage's
  weights, and how many data-axis collectives run inside the tick loop."""
  rows, data, k, m, batch = [], 2, 4, 8, 64
  for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1)):
    low = lower(name, k, m, v, batch, data=data)
    on_data = [c for c in low.collectives() if "data" in c.axes]
    stage_weights = sum(a.size * 4 for a in jax.tree.leaves(layer_params(2 * k * v))) // k
    rows.append(dict(name=name, v=v, bytes=sum(c.bytes for c in on_data),
                     once=2 * (data - 1) / data * stage_weights,
                     in_loop=sum(1 for c in on_data if c.repeat > 1)))
  return rows


def memory_rows(quick: bool):
  rows, k, batch = [], 4, 256
  for m in (4, 8, 16) if quick else (4, 8, 16, 32):
    for name, lockstep in (("gpipe", False), ("1f1b", False), ("1f1b", True)):
      sched = pipeline.schedule(name, num_stages=k, num_microbatches=m, lockstep=lockstep)
      mem = lower(sched, k, m, 1, batch, remat=False).compile().memory_analysis()
      slots = plan(sched).slots["stash"]
      rows.append(dict(name=name + (" lockstep" if lockstep else ""), M=m,
                       temp=mem.temp_size_in_bytes, slots=slots,
                       peak=sched.peak_in_flight,
                       stash=slots * 2 * layer_residual_bytes(batch // m)))
  return rows


def device_flops(low, sched):
  """Matmul FLOPs of the busiest device: everything outside the tick loop,
  plus per tick the branch of the device's own action (per device), or each
  phase's conditional times the ticks that run it (phases)."""
  p = plan(sched)
  jaxpr = low.per_device_jaxpr()
  loops = [e for e in jaxpr.eqns
           if e.primitive.name == "scan" and e.params["length"] == sched.num_ticks]
  body = loops[0].params["jaxpr"].jaxpr
  conds = [e for e in body.eqns if e.primitive.name == "cond"]
  outside = dot_flops(jaxpr) - dot_flops(body) * sched.num_ticks
  if per_device(p):
    kinds = per_device_kinds(p)
    switch = max(conds, key=lambda e: len(e.params["branches"]))
    assert len(switch.params["branches"]) == len(kinds)
    cost = {c: dot_flops(b.jaxpr) for c, b in zip(kinds, switch.params["branches"])}
    codes = per_device_codes(p)
    return outside + max(sum(cost[c] for c in codes[:, s]) for s in range(p.num_stages))
  phases = [ph for ph in ("F", "H", "B", "W") if p.count(ph)]
  assert len(conds) == len(phases), (phases, len(conds))
  total = 0
  for ph, e in zip(phases, conds):
    total += max(dot_flops(b.jaxpr) for b in e.params["branches"]) * p.count(ph)
  return total + outside


def bubble_formula(name, k, m, v):
  if name == "zero_bubble":        # ZB-H1 (Qi et al.), M >= K: 3M+K-1 ticks
    return (k - 1) / (3 * m + k - 1)
  return (k - 1) / (v * m + k - 1)


def schedule_rows(quick: bool):
  rows, batch = [], 64
  configs = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1)]
  for k in (2, 4):
    for m in (k, 2 * k):
      for name, v in configs:
        sched = pipeline.schedule(name, num_stages=k, num_microbatches=m, repeats=v)
        low = lower(name, k, m, v, batch)
        p = plan(sched)
        flops = device_flops(low, sched)
        # the plain loop: per layer forward 2, recompute 2, backward 4 matmuls of
        # 2*B*D*H each (remat=True), shared by the K devices
        share = 2 * k * v * 8 * 2 * batch * D * H / k
        # per device each stage runs its own M*v actions: the share exactly;
        # phases (gpipe): every device in every tick of a phase, T/(M*v) of it
        want = 1.0 if per_device(p) else sched.num_ticks / (2 * m * v)
        mb = batch // m * D * 4
        record = sum(c.bytes for c in low.collectives() if c.kind == "ppermute")
        sends = int(p.f_into.any(1).sum() + p.b_into.any(1).sum())
        rows.append(dict(name=name, K=k, M=m, v=v, ticks=sched.num_ticks,
                         bubble=sched.bubble_fraction, formula=bubble_formula(name, k, m, v),
                         peak=sched.peak_in_flight, flops=flops, share=share, want=want,
                         mode="per device" if per_device(p) else "phases",
                         record=record, executed=sends * mb))
  return rows


def pictures(k: int = 4, m: int = 8) -> list[str]:
  """The README's schedule pictures (published tables, K=4, M=8)."""
  out = []
  for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1)):
    path = os.path.join(_ROOT, "docs", "img", f"schedule-{name}.png")
    out.append(pipeline.schedule(name, num_stages=k, num_microbatches=m, repeats=v).plot(path))
  return out


def report(quick: bool = False) -> list[str]:
  mem, rows, dp = memory_rows(quick), schedule_rows(quick), data_rows(quick)
  lines = [HEADING, "",
           "`pipeline.run(..., loss_fn=..., schedule=...)` runs the schedule's published "
           "table (`pipeline.schedule(name, K, M, v)`) in one `custom_vjp` forward. Where "
           "stages run different actions in a tick (1F1B's steady state), each device runs "
           "only its own action (*per device*: one `lax.switch` on its entry of the table); "
           "GPipe's table has one kind of action per tick and runs as *phases* on every stage. "
           "Reproduce: `python benchmarks/pipeline_schedules.py`.", "",
           "### Temporary memory against M (fixed batch 256, K=4, L=8, no remat)", "",
           "*stash* is what the plan allocates for the backward: slots x 2 layers per stage x "
           "one layer's residuals on B/M rows (`jax.vjp`, weights excluded). GPipe's table "
           "keeps every micro-batch's stash, M of B/M rows (the whole batch, whatever M); "
           "1F1B at most K = 4 micro-batches (its lockstep form, every tick one kind of "
           "action on all stages, 2K-1 = 7), so its stash shrinks as 1/M.", "",
           "| M | schedule | peak in flight | stash slots | stash | temp |",
           "|---:|---|---:|---:|---:|---:|"]
  for r in mem:
    lines.append(f"| {r['M']} | {r['name']} | {r['peak']} | {r['slots']} | "
                 f"{format_bytes(r['stash'])} | {format_bytes(r['temp'])} |")
  lines += ["", "### Ticks, bubble, FLOPs and permutes per step (batch 64, L=2Kv, remat)", "",
            "*bubble* is the executed table's idle share under unit costs (every action one "
            "tick), against `(K-1)/(vM+K-1)` (gpipe, 1f1b, interleaved) and ZB-H1's "
            "`(K-1)/(3M+K-1)` (zero bubble: B and W each one tick, `3M+K-1` ticks). *matmul "
            "FLOPs / device*: the busiest device's, counted from the per-device program; "
            "*share*: the plain loop's matmul FLOPs / K; *formula*: per device 1 (each device "
            "runs its own M*v forwards and backwards, nothing else: a bubble costs time, not "
            "FLOPs); phases `T/(2Mv)` (every device computes in every tick). *permutes, "
            "record*: gshard's count (each permute once per loop trip, two directions); "
            "*executed*: ticks where some stage sends, per direction, x one micro-batch.", "",
            "| schedule | K | M | v | mode | ticks | bubble | formula | peak in flight "
            "| matmul FLOPs / device | share | ratio | formula | permutes, record | executed |",
            "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(
        f"| {r['name']} | {r['K']} | {r['M']} | {r['v']} | {r['mode']} | {r['ticks']} | "
        f"{r['bubble']:.3f} | {r['formula']:.3f} | {r['peak']} | {r['flops'] / 1e6:.2f} M | "
        f"{r['share'] / 1e6:.2f} M | {r['flops'] / r['share']:.3f} | {r['want']:.3f} | "
        f"{format_bytes(r['record'])} | {format_bytes(r['executed'])} |")
  lines += ["", "### With a data axis (data=2, stage=4, M=8, batch 64, L=2Kv)", "",
            "Each action's weight gradient is a partial sum over `data`. *data bytes / "
            "step*: what every data-axis collective sends per device per step (gshard's "
            "record, loops counted per trip); *one all-reduce*: of a stage's weights, "
            "`2(d-1)/d` x their bytes; *in the tick loop*: data-axis collectives run per "
            "tick.", "",
            "| schedule | v | data bytes / step | one all-reduce | in the tick loop |",
            "|---|---:|---:|---:|---:|"]
  for r in dp:
    lines.append(f"| {r['name']} | {r['v']} | {format_bytes(r['bytes'])} | "
                 f"{format_bytes(r['once'])} | {r['in_loop']} |")
  by = {(r["name"], r["M"]): r["temp"] for r in mem}
  ms = sorted({r["M"] for r in mem})
  lo, hi = ms[0], ms[-1]
  worst = max(abs(r["flops"] / r["share"] - r["want"]) for r in rows)
  lines += ["", f"Reading: from M={lo} to M={hi} 1F1B's temporary memory falls "
            f"{by['1f1b', lo] / by['1f1b', hi]:.1f}x (GPipe's "
            f"{by['gpipe', lo] / by['gpipe', hi]:.1f}x: its stash is the whole batch whatever "
            f"M); its stash is K micro-batches, 4/7 of the lockstep form's once M >= 2K-1. At "
            f"M = K = {lo} both hold K and the per-device switch costs "
            f"{by['1f1b', lo] / by['1f1b lockstep', lo]:.2f}x the lockstep form's temp (the "
            "forward's stash slot and the backward's read of one live in one conditional). "
            "Every bubble is its formula; per device each stage computes exactly its share of "
            f"the plain loop's matmuls (largest deviation from the formula {worst:.1e}), where "
            "GPipe's phases compute in every tick. The permutes the record counts are two per "
            "tick; only the ticks where a stage sends run them. With a data axis the "
            f"gradients' reduction sends {min(r['bytes'] / r['once'] for r in dp):.2f}-"
            f"{max(r['bytes'] / r['once'] for r in dp):.2f}x one all-reduce of a stage's "
            f"weights, {max(r['in_loop'] for r in dp)} of its collectives inside the tick "
            "loop: each action's sum stays pending through its conditional and the running "
            "sums, and is summed once after the loop."]
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
  for picture in pictures():
    print(f"wrote {picture}")


if __name__ == "__main__":
  main(quick="--quick" in sys.argv)
