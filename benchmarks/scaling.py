"""gshard's own time against the number of devices and the model depth.

Lowers the GPT-style Transformer train step (SGD) for abstract meshes of 8,
256 and 2048 devices and a 16x16x8 mesh (no devices needed: AbstractMesh +
ShapeDtypeStructs, lowered for TPU), with 2..64 layers written as a Python loop
(unrolled) and with ``lax.scan`` over stacked layers. Reports trace,
propagate, partition and lower seconds, and the StableHLO size.

Run: ``.venv/bin/python benchmarks/scaling.py [--quick]``.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AbstractMesh, AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import gshard  # noqa: E402
from examples import models  # noqa: E402

MESHES = {8: ((2, 4), ("data", "model")), 256: ((32, 8), ("data", "model")),
          2048: ((64, 32), ("data", "model")),
          "16x16x8": ((16, 16, 8), ("data", "seq", "model"))}


def lower_once(mesh_key, n_layers: int, scan: bool) -> dict:
  shape, names = MESHES[mesh_key]
  mesh = AbstractMesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
  kw = dict(vocab=1024, d_model=256, n_heads=32, d_ff=1024, n_layers=n_layers)
  if scan:
    params = jax.eval_shape(lambda: models.gpt_scan_init(jax.random.PRNGKey(0), **kw))
    specs, loss = models.gpt_scan_specs(params), models.gpt_scan_loss
  else:
    params = jax.eval_shape(lambda: models.gpt_init(jax.random.PRNGKey(0), **kw))
    specs, loss = models.gpt_specs(params), models.gpt_loss
  tokens = jax.ShapeDtypeStruct((512, 128), jnp.int32)
  step = gshard.partition(models.sgd_step(loss), mesh,
                          in_specs=(specs, P("data"), P("data")))
  t0 = time.perf_counter()
  lowered = step.lower(params, tokens, tokens, platform="tpu")
  total = time.perf_counter() - t0
  t = lowered.timings
  return {"devices": mesh.size, "mesh": "x".join(map(str, shape)), "layers": n_layers,
          "scan": scan, "trace": t["trace"], "propagate": t["propagate"],
          "partition+lower": t["lower"] + t["partition_setup"], "total": total,
          "hlo_kb": len(lowered.as_text()) / 1024}


def best_of(n: int, *args) -> dict:
  """The run with the lowest total of ``n`` (the first pays jax's warm-up)."""
  return min((lower_once(*args) for _ in range(n)), key=lambda r: r["total"])


def main(quick: bool = False) -> list[dict]:
  lower_once(8, 2, False)   # warm up jax's caches
  rows = []
  for mesh_key in MESHES:
    rows.append(best_of(2, mesh_key, 2, False))
  for layers in ((2, 8) if quick else (2, 8, 16, 32, 64)):
    for scan in (False, True):
      rows.append(best_of(1 if layers > 16 else 2, 2048, layers, scan))
  lines = ["# gshard's own time against devices and depth", "",
           "gshard's own time for one new input signature of the GPT train step "
           "(D=256, the layers given, SGD): jax trace, propagation, and partition + "
           "lower (the per-device program is emitted while jax lowers the shard_map), "
           "for an AbstractMesh lowered for TPU from this machine; best of two runs "
           "(one above 16 layers). \"scan\" stacks the layers and runs them with "
           "`lax.scan`; otherwise they are unrolled. StableHLO KiB is the size of the "
           "lowered module's text.", "",
           "Reproduce: `python benchmarks/scaling.py` (part of `make bench`).", "",
           "| devices | mesh | layers | scan | trace s | propagate s | partition + lower s "
           "| total s | StableHLO KiB |", "|---:|---|---:|---|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['devices']} | {r['mesh']} | {r['layers']} | "
                 f"{'yes' if r['scan'] else 'no'} | {r['trace']:.2f} | "
                 f"{r['propagate']:.2f} | {r['partition+lower']:.2f} | {r['total']:.2f} | "
                 f"{r['hlo_kb']:.0f} |")
  lines += ["", _reading(rows)]
  print("\n".join(lines))
  if not quick:
    write_fragment("benchmarks-scaling.md", lines)
  return rows


def _reading(rows) -> str:
  """A paragraph computed from the rows just measured."""
  flat = [r["total"] for r in rows if r["layers"] == 2 and not r["scan"]]
  unrolled = sorted((r["layers"], r["total"]) for r in rows if not r["scan"])
  scanned = [r["total"] for r in rows if r["scan"]]
  (l0, t0), (l1, t1) = unrolled[0], unrolled[-1]
  return (f"Reading: at 2 layers the total is {min(flat):.2f}-{max(flat):.2f} s from "
          f"{min(r['devices'] for r in rows)} to {max(r['devices'] for r in rows)} devices "
          "(flat in the number of devices: one SPMD program). Unrolled, it grows with "
          f"depth ({t0:.2f} s at {l0} layers, {t1:.2f} s at {l1}, "
          f"{t1 / t0 / (l1 / l0):.2f}x linear); scanned, it stays "
          f"{min(scanned):.2f}-{max(scanned):.2f} s whatever the depth.")


def write_fragment(name: str, lines: list[str]) -> None:
  """A generated table that ``benchmarks/run.py`` includes in docs/benchmarks.md."""
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "docs", name)
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
  print(f"wrote {path}")


if __name__ == "__main__":
  main(quick="--quick" in sys.argv)
