"""MoE weak scaling: gshard.partition vs XLA's GSPMD (``gshard.gspmd_jit``).

One GShard MoE layer (top-2 gating, random second expert, C = 2S/E: capacity
factor 1, the paper's)
and its SGD train step (gradients of the parameters and of the tokens, as
inside a model), with E = n experts on n simulated CPU devices and a fixed
number of tokens per device (one group of S tokens per device). Both systems
see the same annotations (gshard/moe/layer.py) and input shardings.

Weak scaling: the local dispatched tensor [E, G/n, C, M] has n * 1 * (2S/n) * M
= 2SM elements whatever n is (C = 2S/E = 2S/n), and each device holds one expert, so per-device
memory and all-to-all bytes should stay flat (all-to-all bytes grow only as
(n-1)/n).

Printed per n: collective bytes sent per device (parsed from each compiled
program's optimized HLO, benchmarks/hlo.py, ring formulas) with the kinds of
collectives, the analytic all-to-all volume 4 * (n-1)/n * local dispatched
bytes, the median step time and per-device memory (temp + arguments +
outputs, compiled.memory_analysis()), and the largest difference between
the two systems' outputs.

Run: ``.venv/bin/python benchmarks/moe.py [--devices 2,4,8] [--runs N]``
(``--devices 2,4,8,16,32`` simulates 32 devices; timing on simulated CPU
devices shares the host's cores, so step times grow with n regardless).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)


def _set_devices(n: int) -> None:
  """Simulated device count; must run before jax's backend starts."""
  flag = f"--xla_force_host_platform_device_count={n}"
  os.environ["XLA_FLAGS"] = " ".join(
      [*re.sub(r"--xla_force_host_platform_device_count=\S*", "",
               os.environ.get("XLA_FLAGS", "")).split(), flag])
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", default="2,4,8",
                      help="comma-separated device counts (= experts)")
  parser.add_argument("--runs", type=int, default=10, help="timed steps per system")
  parser.add_argument("--tokens", type=int, default=256, help="tokens per device (S)")
  parser.add_argument("--d-model", type=int, default=128)
  parser.add_argument("--d-hidden", type=int, default=512)
  return parser.parse_args(argv)


ARGS = _parse_args() if __name__ == "__main__" else None
if ARGS is not None:
  _set_devices(max(int(n) for n in ARGS.devices.split(",")))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks import run as bench  # noqa: E402  (resets XLA_FLAGS to 8 devices)
from gshard.moe import expert_capacity, moe_apply, moe_init, moe_specs  # noqa: E402

if ARGS is not None:   # benchmarks.run set 8 devices; the backend has not started
  _set_devices(max(int(n) for n in ARGS.devices.split(",")))

F32 = 4


def moe_step(lr: float = 0.1, capacity_factor: float = 1.0):
  """SGD step of one MoE layer; the token gradient is returned as in a model."""
  def loss(params, x, key):
    y, aux, _ = moe_apply(params, x, key=key, capacity_factor=capacity_factor)
    return jnp.mean((x + y) ** 2) + 1e-2 * aux

  def step(params, x, key):
    value, (grads, dx) = jax.value_and_grad(loss, argnums=(0, 1))(params, x, key)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads), dx, value
  return step


def moe_case(n: int, tokens: int, d_model: int, d_hidden: int) -> bench.Case:
  experts, groups = n, n
  params = moe_init(jax.random.PRNGKey(0), d_model, d_hidden, experts)
  x = jax.random.normal(jax.random.PRNGKey(1), (groups, tokens, d_model))
  capacity = expert_capacity(tokens, experts, capacity_factor=1.0)
  local = experts * (groups // n) * capacity * d_model * F32
  minimum = {f"4 all-to-alls of (n-1)/n x the local [E, G/n, C, M] = "
             f"[{experts}, {groups // n}, {capacity}, {d_model}] dispatched tensor":
             4 * (n - 1) / n * local}
  return bench.Case(
      "moe", f"MoE layer, E={experts} on {n} devices, S={tokens}, C={capacity}, "
      f"M={d_model}, H={d_hidden}", (n,), ("expert",), moe_step(),
      (params, x, jax.random.PRNGKey(2)), (moe_specs(), P("expert"), P()), minimum,
      "4·(n-1)/n·E·(G/n)·C·M·4")


def _kinds(cols) -> str:
  counts: dict[str, int] = {}
  for c in cols:
    counts[c.kind] = counts.get(c.kind, 0) + 1
  return " ".join(f"{k}x{v}" for k, v in sorted(counts.items())) or "-"


def _reading(seen) -> str:
  """A paragraph of ratios computed from the rows just measured."""
  vs_gspmd = [g.bytes_sent / b.bytes_sent for _, g, b, _ in seen]
  over = [g.bytes_sent - a for _, g, _, a in seen]
  mem = [g.memory / 2**20 for _, g, _, _ in seen]
  ns = [n for n, *_ in seen]
  return (f"Reading: gshard's bytes are {min(vs_gspmd):.3f}-{max(vs_gspmd):.3f}x GSPMD's "
          f"for n = {ns[0]}..{ns[-1]}; above the four analytic all-to-alls they send "
          f"{bench.fmt_bytes(min(over))}-{bench.fmt_bytes(max(over))} more (the small "
          "all-reduces of the gating statistics and the loss). Memory per device stays "
          f"between {min(mem):.2f} and {max(mem):.2f} MiB as experts grow with devices "
          "(weak scaling: each device holds one expert's weights). Step times on "
          "simulated devices share two CPU cores and are indicative only.")


def main() -> None:
  args = ARGS or _parse_args([])
  devices = [int(n) for n in args.devices.split(",")]
  print(f"MoE weak scaling on {jax.device_count()} simulated {jax.devices()[0].platform} "
        f"devices: E = n, {args.tokens} tokens per device, M={args.d_model}, "
        f"H={args.d_hidden}, top-2 random routing, C = 2S/E")
  lines = ["# MoE weak scaling", "",
           f"E = n experts on n simulated devices, {args.tokens} tokens per device, "
           f"M={args.d_model}, H={args.d_hidden}, top-2 random routing, C = 2S/E; one "
           "MoE layer's SGD train step, gshard.partition against gspmd_jit (XLA's "
           "GSPMD) with the same annotations, in one process. Bytes are read from each "
           "compiled program's optimized HLO; \"analytic all-to-all\" is the four "
           "all-to-alls of the paper's layout (dispatch and combine, forward and "
           "backward), each (n-1)/n of the local dispatched tensor [E, G/n, C, M]; "
           "memory is temp + argument + output of `memory_analysis()`; max abs diff "
           "compares the two systems' outputs.", "",
           f"Reproduce: `python benchmarks/moe.py --devices {args.devices}` (part of "
           "`make bench`).", "",
           "| n | system | bytes / device | analytic all-to-all | collectives | step ms "
           "| memory / device | max abs diff |", "|---:|---|---:|---:|---|---:|---:|---:|"]
  seen = []
  for n in devices:
    case = moe_case(n, args.tokens, args.d_model, args.d_hidden)
    g, b = bench.measure(case, args.runs, min_seconds=2.0)
    diff = bench.max_abs_diff(g.outputs, b.outputs)
    analytic = sum(case.minimum.values())
    seen.append((n, g, b, analytic))
    for r in (g, b):
      lines.append(f"| {n} | {r.system} | {bench.fmt_bytes(r.bytes_sent)} | "
                   f"{bench.fmt_bytes(analytic)} | {_kinds(r.collectives)} | "
                   f"{r.step_ms:.2f} | {bench.fmt_bytes(r.memory)} | {diff:.1e} |")
      print(lines[-1], flush=True)
  lines += ["", _reading(seen)]
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "docs", "benchmarks-moe.md")
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
