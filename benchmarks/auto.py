"""``gshard.auto_shard`` against hand layouts and pure data parallel.

``make bench`` (or ``.venv/bin/python benchmarks/auto.py``) runs, on 8
simulated CPU devices, the solver on an MLP train step (a large batch, then
large weights, then large weights under a memory limit), the GPT of
examples/models.py without its annotations (no limit, then a limit), and a
Switch MoE layer. For each it reports the bytes one device sends (gshard's
partitioned program's collectives) and the memory per device (the compiled
program's ``memory_analysis()``: temp + arguments + outputs - aliased) of the
plan, of the hand layout and of pure data parallel (parameters replicated,
batch split over every mesh axis), measured the same way
(``plan.evaluate``), and the search time. Writes docs/benchmarks-auto.md
unless ``--no-doc``.
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
for p in (_ROOT, os.path.join(_ROOT, "tests")):
  if p not in sys.path:
    sys.path.insert(0, p)

import argparse  # noqa: E402
import datetime  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import gshard  # noqa: E402
from examples import models  # noqa: E402
from gshard.spmd.inspect import format_bytes  # noqa: E402
from test_auto import mlp_args, mlp_step, moe_step  # noqa: E402

S = jax.ShapeDtypeStruct
DOC = os.path.join(_ROOT, "docs", "benchmarks-auto.md")


def _replicated(tree):
  return jax.tree.map(lambda _: P(), tree)


def cases():
  """(name, mesh, step, args, memory limit, hand in_specs, data-parallel in_specs)."""
  m8 = gshard.make_mesh((8,), ("d",))
  for batch, d, h, limit in [(4096, 64, 256, None), (16, 512, 2048, None),
                             (2048, 512, 1024, 10 * 2**20)]:
    args = mlp_args(batch, d, h)
    hand = ({"w1": P(None, "d"), "w2": P("d", None)}, P(), P())
    yield (f"MLP B={batch} D={d} H={h}", m8, mlp_step, args, limit, hand,
           (_replicated(args[0]), P("d"), P("d")))
  m24 = gshard.make_mesh((2, 4), ("data", "model"))
  params = jax.eval_shape(lambda: models.gpt_init(jax.random.key(0), vocab=512, d_model=256,
                                                  n_heads=8, n_layers=2, d_ff=1024))
  tokens = S((16, 64), jnp.int32)
  step = models.sgd_step(lambda p, a, b: models.gpt_loss(p, a, b, annotate=False))
  for limit in (None, 14 * 2**20, 14.5 * 2**20):
    yield ("GPT 2 layers, D=256, V=512, B=16 T=64", m24, step, (params, tokens, tokens),
           limit, (models.gpt_specs(params), P("data"), P("data")),
           (_replicated(params), P(("data", "model")), P(("data", "model"))))
  e, mdim, hdim = 8, 64, 256
  args = ({"wg": S((mdim, e), jnp.float32), "wi": S((e, mdim, hdim), jnp.float32),
           "wo": S((e, hdim, mdim), jnp.float32)}, S((8, 32, mdim), jnp.float32))
  yield ("Switch MoE E=8 M=64 H=256, 8x32 tokens", m8, moe_step, args, None,
         ({"wg": P(), "wi": P("d"), "wo": P("d")}, P("d")), (_replicated(args[0]), P("d")))


def _mem(c):
  return format_bytes(c.compiled_memory) if c.compiled_memory is not None else "-"


def run():
  rows, plans = [], []
  for name, mesh, step, args, limit, hand, dp in cases():
    shape = ", ".join(f"{a}={n}" for a, n in mesh.shape.items())
    try:
      plan = gshard.auto_shard(step, mesh, memory_limit=limit)(*args)   # default options
    except (ValueError, TimeoutError) as e:   # no layout fits / out of time: the result
      rows.append((name, f"({shape})", format_bytes(limit),
                   "no fit" if isinstance(e, ValueError) else "out of time", "-", "-", "-",
                   "-", "-", "-", "-"))
      plans.append((name, limit, str(e)))
      continue
    h, d = plan.evaluate(hand), plan.evaluate(dp)
    rows.append((name, f"({shape})", format_bytes(limit) if limit else "none",
                 format_bytes(plan.cost.bytes), _mem(plan.cost), format_bytes(h.bytes), _mem(h),
                 format_bytes(d.bytes), _mem(d), f"{plan.search_seconds:.1f} s",
                 " / ".join(f"{plan.seconds.get(k, 0.0):.1f}"
                            for k in ("solve", "realize", "check", "runner_ups"))))
    plans.append((name, limit, str(plan)))
    print(rows[-1], flush=True)
  return rows, plans


def write_doc(rows, plans) -> None:
  head = ("model", "mesh", "memory limit", "plan bytes", "plan memory", "hand bytes",
          "hand memory", "DP bytes", "DP memory", "search",
          "of which solve / realize / check / runner-ups (s)")
  lines = ["# auto_shard benchmark", "",
           f"Written by `benchmarks/auto.py` on {datetime.date.today()} (jax "
           f"{jax.__version__}, 8 simulated CPU devices).", "",
           "Bytes: what one device sends (the partitioned program's collectives, "
           "`lowered.collectives()`); memory: the compiled program's "
           "`memory_analysis()` (temp + arguments + outputs - aliased) per device. "
           "*Hand*: the layouts of examples/models.py (Megatron MLP, the GPT's "
           "`gpt_specs` and its annotations' axes, experts split on E); *DP*: parameters "
           "replicated, the batch split over every mesh axis. Search: the whole "
           "`auto_shard` call (trace, build, solve, runner-ups, realize, compile check) "
           "on a shared 2-core machine; under a memory limit the solve, realize and "
           "check columns add up every solve (a plan whose compiled memory exceeds the "
           "limit is followed by the plans at the model's least memory, then budgets "
           "stepped up from the one that fits).", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  lines += ["", "## The plans", ""]
  for name, limit, text in plans:
    lim = f", limit {format_bytes(limit)}" if limit else ""
    lines += [f"### {name}{lim}", "", "```", text, "```", ""]
  with open(DOC, "w") as f:
    f.write("\n".join(lines))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--no-doc", action="store_true", help="do not write the doc")
  a = ap.parse_args()
  rows, plans = run()
  if not a.no_doc:
    write_doc(rows, plans)
    print(f"wrote {DOC}")


if __name__ == "__main__":
  main()
