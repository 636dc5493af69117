"""gshard.partition vs XLA's GSPMD (``gshard.gspmd_jit``), same annotations.

``make bench`` (or ``.venv/bin/python benchmarks/run.py``) runs, in one process
on 8 simulated CPU devices, for each model: gshard's partitioner and jax.jit
with the same annotations as sharding constraints and the same input
shardings. It prints a table and writes docs/benchmarks.md.

Measured per model and system:
  bytes     collective bytes sent per device, parsed from the compiled
            program's optimized HLO (benchmarks/hlo.py, ring formulas)
  minimum   the analytic minimum for the layout (formulas below / in the doc)
  step      median wall time of a train step (after warm-up, block_until_ready)
  memory    per device: temp + argument + output bytes (compiled.memory_analysis())
  overhead  gshard: trace + propagate + partition set-up + lower (the per-device
            program is emitted while lowering); GSPMD: jax trace + lower
  compile   XLA compile time of the lowered program (lowered.compile())

Options: ``--runs N`` at least N timed steps per system (default 25; fast models get
more, about 8 s of timing), ``--no-doc`` to
leave docs/benchmarks.md alone, ``--only NAME`` one model.
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
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import gshard  # noqa: E402
from gshard.spmd.inspect import format_bytes  # noqa: E402
from benchmarks import hlo  # noqa: E402
from examples import models as M  # noqa: E402

F32 = 4


def ar(n: int, s: float) -> float:
  """Ring all-reduce: bytes one device sends for S bytes over n devices."""
  return 2 * (n - 1) / n * s if n > 1 else 0.0


# -- the models ------------------------------------------------------------------

@dataclasses.dataclass
class Case:
  name: str
  title: str
  mesh_shape: tuple[int, ...]
  mesh_names: tuple[str, ...]
  step: Callable
  args: tuple
  in_specs: tuple
  minimum: dict[str, float]      # component -> bytes per device
  minimum_formula: str


def mlp_case(batch=128, d_model=256, d_hidden=1024, dp=2, mp=4) -> Case:
  params = M.mlp_init(jax.random.PRNGKey(0), d_model, d_hidden)
  x = jax.random.normal(jax.random.PRNGKey(1), (batch, d_model))
  y = jax.random.normal(jax.random.PRNGKey(2), (batch, d_model))
  minimum = {
      "forward all-reduce of the [B/dp, D] MLP output over model":
          ar(mp, batch // dp * d_model * F32),
      "all-reduce over data of the local gradients of w1, w2 (2·D·H/mp)":
          ar(dp, 2 * d_model * d_hidden // mp * F32),
      "all-reduce over data of the scalar loss": ar(dp, F32),
  }
  formula = ("2(mp-1)/mp·(B/dp·D·4) + 2(dp-1)/dp·(2·D·H/mp·4) + 2(dp-1)/dp·4. "
             "No backward activation all-reduce: x is data, its gradient is not "
             "computed.")
  if mp == 1:
    minimum = {"all-reduce over data of the gradients of w1, w2 (2·D·H)":
               ar(dp, 2 * d_model * d_hidden * F32),
               "all-reduce over data of the scalar loss": ar(dp, F32)}
    return Case("dp_mlp", f"Data-parallel MLP (B={batch}, D={d_model}, H={d_hidden}), "
                f"mesh data={dp}", (dp,), ("data",), M.sgd_step(M.mlp_loss),
                (params, x, y), ({"w1": P(), "w2": P()}, P("data"), P("data")),
                minimum, "2(n-1)/n·(2·D·H·4) + 2(n-1)/n·4 (gradients and loss, "
                "one all-reduce each over data)")
  return Case("mlp", f"Megatron MLP (B={batch}, D={d_model}, H={d_hidden}), "
              f"mesh data={dp} x model={mp}", (dp, mp), ("data", "model"),
              M.sgd_step(M.mlp_loss), (params, x, y),
              (M.MLP_SPECS, P("data"), P("data")), minimum, formula)


def gpt_case(batch=16, seq=128, d_model=256, n_heads=8, d_ff=1024, vocab=1024,
             n_layers=2, dp=2, mp=4) -> Case:
  params = M.gpt_init(jax.random.PRNGKey(0), vocab=vocab, d_model=d_model,
                      n_heads=n_heads, n_layers=n_layers, d_ff=d_ff)
  tok = jax.random.randint(jax.random.PRNGKey(1), (batch, seq), 0, vocab)
  tgt = jax.random.randint(jax.random.PRNGKey(2), (batch, seq), 0, vocab)
  act = batch // dp * seq * d_model * F32
  stat = batch // dp * seq * F32
  local_params = (vocab * d_model // mp
                  + n_layers * (4 * d_model * d_model // mp + 2 * d_model * d_ff // mp
                                + 2 * d_model)
                  + d_model) * F32
  minimum = {
      f"{4 * n_layers} all-reduces over model of the [B/dp,T,D] activation "
      "(per layer: attention and MLP outputs forward, their input gradients "
      "backward)": 4 * n_layers * ar(mp, act),
      "1 more of them for the tied logits matmul (its input gradient, "
      "backward)": ar(mp, act),
      "the tied embedding's lookup forward: an all-to-all over model moves the "
      "vocab-split table [V/mp, D] to a feature split [V, D/mp], each device looks "
      "up its features, an all-gather over model completes the [B/dp,T,D] "
      "activation. A vocab-parallel masked lookup all-reduces that activation "
      "instead (twice the all-gather's bytes, more than both together); "
      "all-gathering the table would send less but hold it whole on every device":
          (mp - 1) / mp * (vocab * d_model // mp * F32) + (mp - 1) / mp * act,
      "vocab-parallel cross-entropy: all-reduce over model of 3 [B/dp,T] "
      "statistics, the max and the sum of exp forward and the log-softmax "
      "cotangent's sum over the vocabulary backward (autodiff computes it; "
      "Megatron-LM's hand-written backward knows it is -1/N)":
          3 * ar(mp, stat),
      "all-reduce over data of every local parameter-gradient shard once":
          ar(dp, local_params),
      "the target logit, gathered from vocab-split log-probabilities, is a "
      "partial sum over model; kept one through the mean: all-reduce of the "
      "scalar loss over data x model (all-reducing the [B/dp,T] target logits "
      "over model first would cost a fourth statistic)":
          ar(dp * mp, F32),
  }
  formula = ("(4L+1)·2(mp-1)/mp·(B/dp·T·D·4) + (mp-1)/mp·(V·D/mp·4 + B/dp·T·D·4) + "
             "3·2(mp-1)/mp·(B/dp·T·4) + "
             "2(dp-1)/dp·4·(V·D/mp + L·(4·D²/mp + 2·D·F/mp + 2·D) + D) + "
             "2(dp·mp-1)/(dp·mp)·4")
  params_specs = M.gpt_specs(params)
  return Case("gpt", f"GPT Transformer (L={n_layers}, D={d_model}, heads={n_heads}, "
              f"F={d_ff}, V={vocab}, T={seq}, B={batch}), mesh data={dp} x model={mp}",
              (dp, mp), ("data", "model"), M.sgd_step(M.gpt_loss),
              (params, tok, tgt), (params_specs, P("data"), P("data")), minimum, formula)


def moe_case(n=8, group=256, d_model=128, d_hidden=512) -> Case:
  """GShard's MoE layer with the paper's three annotations only: inputs split
  on G, gating weights replicated, the dispatched tensor split on E."""
  from gshard.moe import expert_capacity, moe_init, top2_gating
  params = moe_init(jax.random.PRNGKey(0), d_model, d_hidden, n)
  x = jax.random.normal(jax.random.PRNGKey(1), (n, group, d_model))
  key = jax.random.PRNGKey(2)

  def layer(params, x):
    x = gshard.split(x, 0, "expert")
    wg = gshard.replicate(params["wg"])
    g = top2_gating(jnp.einsum("GSM,ME->GSE", x, wg), capacity_factor=1.0, key=key)
    dispatch, combine = g.dispatch_mask.astype(x.dtype), g.combine_weights.astype(x.dtype)
    d = gshard.split(jnp.einsum("GSEC,GSM->EGCM", dispatch, x), 0, "expert")
    h = jax.nn.relu(jnp.einsum("EGCM,EMH->EGCH", d, params["wi"]))
    e = jnp.einsum("EGCH,EHM->EGCM", h, params["wo"])
    return jnp.einsum("GSEC,EGCM->GSM", combine, e), g.aux_loss

  def step(params, x):
    def loss(p, x):
      y, aux = layer(p, x)
      return jnp.mean((x + y) ** 2) + 1e-2 * aux
    v, (gp, gx) = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, gp), gx, v

  cap = expert_capacity(group, n, capacity_factor=1.0)
  dispatched = n * (n // n) * cap * d_model * F32       # [E, G/n, C, M] per device
  minimum = {
      "4 all-to-alls of the dispatched [E, G/n, C, M] block (dispatch and combine, "
      "forward and backward)": 4 * (n - 1) / n * dispatched,
      "all-reduce over expert of the replicated gating weights' gradient [M, E]":
          ar(n, d_model * n * F32),
      "all-reduce over expert of the loss (the auxiliary loss added to it first)":
          ar(n, F32),
  }
  formula = "4·(n-1)/n·(E·(G/n)·C·M·4) + 2(n-1)/n·(M·E·4) + 2(n-1)/n·4"
  specs = ({"wg": P(), "wi": P("expert"), "wo": P("expert")}, P("expert"))
  return Case("moe", f"GShard MoE layer, top-2, paper annotations only (E=G={n}, S={group}, "
              f"M={d_model}, H={d_hidden}, C={cap}), mesh expert={n}", (n,), ("expert",),
              step, (params, x), specs, minimum, formula)


def resnet_case(batch=16, size=16, width=32) -> Case:
  """A Flax Linen ResNet (BatchNorm, SGD with momentum via optax) with the
  batch split over data and every kernel's output channels over model."""
  import flax.linen as nn
  import optax

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      y = nn.relu(nn.BatchNorm(use_running_average=False)(nn.Conv(width, (3, 3))(x)))
      y = nn.BatchNorm(use_running_average=False)(nn.Conv(width, (3, 3))(y))
      return nn.relu(x + y)

  class ResNet(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.BatchNorm(use_running_average=False)(nn.Conv(width, (3, 3))(x)))
      for _ in range(2):
        x = Block()(x)
      return nn.Dense(10)(x.mean(axis=(1, 2)))

  model = ResNet()
  x = np.random.default_rng(0).standard_normal((batch, size, size, 3)).astype(np.float32)
  labels = np.arange(batch) % 10
  v = model.init(jax.random.PRNGKey(0), x)
  opt = optax.sgd(0.1, momentum=0.9)

  def step(params, stats, opt_state, x, labels):
    def loss(p):
      logits, upd = model.apply({"params": p, "batch_stats": stats}, x,
                                mutable=["batch_stats"])
      return (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(),
              upd["batch_stats"])
    (value, stats), g = jax.value_and_grad(loss, has_aux=True)(params)
    u, opt_state = opt.update(g, opt_state, params)
    return optax.apply_updates(params, u), stats, opt_state, value

  def channels(a):
    return P(*([None] * (a.ndim - 1) + ["model"])) if a.shape[-1] % 4 == 0 else P()
  ch = jax.tree.map(channels, v["params"])
  opt_state = opt.init(v["params"])
  opt_specs = jax.tree.map(lambda a: channels(a) if a.ndim else P(), opt_state)
  stats_specs = jax.tree.map(channels, v["batch_stats"])
  return Case("resnet", f"Flax ResNet (3 conv blocks of {width} channels, BatchNorm, "
              f"optax SGD momentum, B={batch}, {size}x{size}), batch over data, output "
              "channels over model, mesh data=2 x model=4", (2, 4), ("data", "model"), step,
              (v["params"], v["batch_stats"], opt_state, x, labels),
              (ch, stats_specs, opt_specs, P("data"), P("data")), {}, "")


# -- measuring -------------------------------------------------------------------

@dataclasses.dataclass
class Result:
  system: str
  bytes_sent: float
  collectives: list
  step_s: list[float]
  memory: int
  mem_parts: dict
  overhead: dict[str, float]
  compile_s: float
  outputs: object = None
  same_as_gspmd: bool = False     # the same compiled instructions as GSPMD's

  @property
  def step_ms(self) -> float:
    return 1e3 * statistics.median(self.step_s)

  @property
  def step_iqr_ms(self) -> tuple[float, float]:
    q = statistics.quantiles(self.step_s, n=4)
    return 1e3 * q[0], 1e3 * q[2]


def _memory(compiled) -> tuple[int, dict]:
  m = compiled.memory_analysis()
  parts = {k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
           for k in ("temp", "argument", "output", "alias")}
  return parts["temp"] + parts["argument"] + parts["output"], parts


def _block(tree):
  return jax.block_until_ready(tree)


def measure(case: Case, runs: int, min_seconds: float = 8.0) -> tuple[Result, Result]:
  mesh = gshard.make_mesh(case.mesh_shape, case.mesh_names)
  n = int(np.prod(case.mesh_shape))
  # warm jax's caches for the nested jits of jnp helpers (log_softmax, where ...)
  # so that neither system pays for them in its overhead; through a wrapper, so
  # that the trace of case.step itself is not cached for gshard's make_jaxpr
  jax.make_jaxpr(lambda *a: case.step(*a))(*case.args)

  # gshard
  part = gshard.partition(case.step, mesh, in_specs=case.in_specs)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    low = part.lower(*case.args)
  t0 = time.perf_counter()
  g_compiled = low.compile()
  g_compile = time.perf_counter() - t0
  g_hlo = g_compiled.as_text()
  g_cols = hlo.collectives(g_hlo, n)
  g_mem, g_parts = _memory(g_compiled)
  g_over = dict(low.timings)

  # GSPMD
  base = gshard.gspmd_jit(case.step, mesh, in_specs=case.in_specs)
  t0 = time.perf_counter()
  traced = base.trace(*case.args)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  b_compiled = lowered.compile()
  b_compile = time.perf_counter() - t2
  b_hlo = b_compiled.as_text()
  b_cols = hlo.collectives(b_hlo, n)
  b_mem, b_parts = _memory(b_compiled)
  b_over = {"trace": t1 - t0, "lower": t2 - t1}

  # same placed inputs for both
  in_sh = [NamedSharding(mesh, s.to_spec()) for s in low.in_shardings]
  leaves, tree = jax.tree_util.tree_flatten(case.args)
  placed = jax.tree_util.tree_unflatten(
      tree, [jax.device_put(x, s) for x, s in zip(leaves, in_sh)])
  g_out = _block(part(*placed))     # first calls: jit compiles, warm-up
  b_out = _block(base(*placed))
  t0 = time.perf_counter()
  for _ in range(3):
    _block(part(*placed))
    _block(base(*placed))
  # at least `runs` steps each, and about min_seconds of timing for fast models
  # (a median over many short steps is far less sensitive to a busy machine)
  pair = (time.perf_counter() - t0) / 3
  runs = max(runs, min(1000, int(min_seconds / max(pair, 1e-6))))
  g_times, b_times = [], []
  for _ in range(runs):             # interleaved, so drift hits both alike
    t0 = time.perf_counter()
    _block(part(*placed))
    g_times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    _block(base(*placed))
    b_times.append(time.perf_counter() - t0)
  return (Result("gshard", sum(c.total for c in g_cols), g_cols, g_times, g_mem,
                 g_parts, g_over, g_compile, g_out, hlo.same_program(g_hlo, b_hlo, n)),
          Result("GSPMD", sum(c.total for c in b_cols), b_cols, b_times, b_mem,
                 b_parts, b_over, b_compile, b_out))


def max_abs_diff(a, b) -> float:
  diffs = jax.tree.map(lambda u, v: float(jnp.max(jnp.abs(jnp.asarray(u) -
                                                          jnp.asarray(v)))), a, b)
  return max(jax.tree.leaves(diffs))


# -- reporting -------------------------------------------------------------------

def fmt_bytes(n: float) -> str:
  return format_bytes(n, digits=2)


def gshard_overhead(r: Result) -> float:
  return sum(r.overhead.get(k, 0.0) for k in ("trace", "propagate", "partition_setup",
                                               "lower"))


def table(rows: list[tuple[Case, Result, Result, float]]) -> str:
  head = ("| model | system | bytes sent / device | vs analytic min | step ms, "
          "median (IQR) | memory / device | own overhead s | XLA compile s |")
  sep = "|---|---|---:|---:|---:|---:|---:|---:|"
  lines = [head, sep]
  for case, g, b, _ in rows:
    mn = sum(case.minimum.values())
    for r in (g, b):
      if r.system == "gshard":
        o = r.overhead
        over = (f"{gshard_overhead(r):.2f} (trace {o.get('trace', 0):.2f}, prop "
                f"{o.get('propagate', 0):.2f}, setup {o.get('partition_setup', 0):.3f}, "
                f"lower {o.get('lower', 0):.2f})")
      else:
        over = (f"{sum(r.overhead.values()):.2f} (jax trace {r.overhead['trace']:.2f}, "
                f"lower {r.overhead['lower']:.2f})")
      ratio = f"{r.bytes_sent / mn:.4f}x" if mn else "none stated"
      lo, hi = r.step_iqr_ms
      lines.append(f"| {case.name} | {r.system} | {fmt_bytes(r.bytes_sent)} | "
                   f"{ratio} | {r.step_ms:.2f} ({lo:.2f}-{hi:.2f}) | "
                   f"{fmt_bytes(r.memory)} | {over} | "
                   f"{r.compile_s:.2f} |")
  return "\n".join(lines)


def bars(rows) -> list[tuple[str, str, bool, str]]:
  """(model, bar, met, numbers)."""
  out = []
  for case, g, b, _ in rows:
    mn = sum(case.minimum.values())
    out.append((case.name, "bytes <= GSPMD", g.bytes_sent <= b.bytes_sent + 0.5,
                f"{fmt_bytes(g.bytes_sent)} vs {fmt_bytes(b.bytes_sent)} "
                f"({g.bytes_sent / b.bytes_sent:.3f}x)" if b.bytes_sent else
                f"{fmt_bytes(g.bytes_sent)} vs 0 B"))
    if case.name in ("mlp", "gpt", "moe"):
      d = g.bytes_sent - mn
      out.append((case.name, "bytes = analytic minimum", abs(d) < 0.5,
                  f"{fmt_bytes(g.bytes_sent)} vs {fmt_bytes(mn)} "
                  f"({'+' if d >= 0 else '-'}{fmt_bytes(abs(d))}, "
                  f"{100 * d / mn:+.2f}%)"))
    ratio = g.step_ms / b.step_ms
    out.append((case.name, "step time within 10% of GSPMD", ratio <= 1.10,
                f"{g.step_ms:.2f} ms vs {b.step_ms:.2f} ms ({ratio:.3f}x)"
                + ("; the same compiled program as GSPMD's" if g.same_as_gspmd else "")))
    out.append((case.name, "own overhead < XLA compile", gshard_overhead(g) < g.compile_s,
                f"{gshard_overhead(g):.2f} s vs {g.compile_s:.2f} s"))
  return out


def collective_listing(r: Result) -> list[str]:
  lines = []
  for c in r.collectives:
    shapes = ", ".join(c.operands)
    if len(shapes) > 60:
      shapes = shapes[:57] + "..."
    lines.append(f"    {c.kind:<18} n={c.group_size}  in {fmt_bytes(c.operand_bytes):>10}"
                 f"  sent {fmt_bytes(c.bytes_sent):>10}"
                 + (f" x{c.executions} (a loop)" if c.executions > 1 else "")
                 + f"  ({shapes})  {c.op_name[:70]}")
  return lines


def machine() -> str:
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    cpu = names[0] if names else cpu
  except OSError:
    pass
  return (f"{os.cpu_count()} CPU cores ({cpu}), {jax.device_count()} simulated CPU "
          f"devices (--xla_force_host_platform_device_count=8), jax {jax.__version__}, "
          f"Python {platform.python_version()}")


def commit() -> str:
  try:
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT,
                         capture_output=True, text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=_ROOT,
                           capture_output=True, text=True).stdout.strip()
    return sha + (" + uncommitted changes" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def write_doc(path: str, rows, runs: int, load: tuple[float, float]) -> None:
  from benchmarks.notes import NOTES
  out = ["# Benchmarks: gshard.partition vs XLA GSPMD", "",
         "Generated by `make bench` (benchmarks/run.py); do not edit the measured "
         "sections by hand, rerun instead. The analysis at the end is written by hand "
         "(benchmarks/notes.py) and refers to the listings above it.", "",
         f"- Measured: {datetime.date.today().isoformat()}, commit {commit()}",
         f"- Machine: {machine()}. Load average (1 min) {load[0]:.1f} at the start, "
         f"{load[1]:.1f} at the end of the run: anything above ~2 means other "
         "processes shared the cores during the timings.",
         "- **Step times on simulated CPU devices are indicative only**: the 8 "
         "\"devices\" share the host's cores and collectives are memory copies, so "
         "times say little about a real accelerator mesh. Bytes and memory are "
         "properties of the compiled programs and do carry over.",
         f"- Step time: median of at least {runs} runs per system (more for fast "
         "models, about 8 s of timing each: "
         + ", ".join(f"{c.name} {len(g.step_s)}" for c, g, _, _ in rows) +
         ") after warm-up, each "
         "`block_until_ready`, gshard and GSPMD interleaved; inputs pre-placed with "
         "the same shardings for both; the public callables are timed "
         "(`gshard.partition(...)(*args)` and the `jax.jit` function).",
         "- Both systems get the same model code, the same annotations (gshard: "
         "`annotate_p`; GSPMD: `gshard.gspmd_jit`, which turns them into "
         "`jax.lax.with_sharding_constraint`) and the same `in_specs`; outputs are "
         "left to each system (`out_specs=None`).",
         "- Bytes: collective bytes one device sends, parsed from each compiled "
         "program's optimized HLO (`compiled.as_text()`) with the ring formulas "
         "(bytes one device sends: all-reduce 2(n-1)/n·S, all-gather (n-1)/n·S_out, "
         "reduce-scatter (n-1)/n·S_in, all-to-all (n-1)/n·S, collective-permute S); "
         "tuple-merged collectives counted per operand; a collective inside a "
         "loop once per iteration.",
         "- Memory: per device, temp + argument + output bytes of "
         "`compiled.memory_analysis()`.",
         "- Overhead: gshard's own time for one new input signature: trace + "
         "propagate + partition (the interpreter emitting the per-device program) + "
         "lower (jax's StableHLO lowering), from `Lowered.timings`. For GSPMD the "
         "corresponding jax trace + lower is shown. XLA compile: `lowered.compile()`.",
         "", "## Results", "", table(rows), "",
         "Correctness check (max |gshard - GSPMD| over all outputs of one step): " +
         ", ".join(f"{c.name} {d:.1e}" for c, _, _, d in rows) + ".", "",
         "## Bars", "", "| model | bar | met | numbers |", "|---|---|---|---|"]
  for model, bar, met, nums in bars(rows):
    out.append(f"| {model} | {bar} | {'yes' if met else '**no**'} | {nums} |")
  out += ["", "## Analytic minima", ""]
  for case, _, _, _ in rows:
    out.append(f"### {case.name}: {case.title}")
    out.append("")
    if not case.minimum:
      out += ["No analytic minimum is derived for this model: compared with GSPMD only.", ""]
      continue
    out.append(f"Formula: {case.minimum_formula}")
    out.append("")
    for k, v in case.minimum.items():
      out.append(f"- {k}: {fmt_bytes(v)}")
    out.append(f"- **total: {fmt_bytes(sum(case.minimum.values()))}** "
               f"({sum(case.minimum.values()):.0f} B)")
    out.append("")
  out += ["## Collectives in the compiled programs", "",
          "Every collective instruction of each optimized HLO module: kind, group "
          "size n, operand bytes (all operands of a tuple-merged collective), bytes "
          "sent per device, operand shapes (per device), XLA's op_name.", ""]
  for case, g, b, _ in rows:
    for r in (g, b):
      out.append(f"{case.name} / {r.system}: {len(r.collectives)} collectives, "
                 f"{fmt_bytes(r.bytes_sent)} sent per device")
      out.append("")
      out.append("```")
      out += collective_listing(r) or ["    (none)"]
      out.append("```")
      out.append("")
  for name, title in (("benchmarks-moe.md", "MoE weak scaling (benchmarks/moe.py)"),
                      ("benchmarks-scaling.md", "gshard's own time against devices and "
                       "depth (benchmarks/scaling.py)"),
                      ("benchmarks-first-step.md", "Time to the first step against GSPMD "
                       "(benchmarks/first_step.py)")):
    frag = os.path.join(os.path.dirname(path), name)
    if os.path.exists(frag):
      with open(frag) as f:
        body = f.read().strip().splitlines()
      if body and body[0].startswith("# "):      # the fragment's own title
        body = body[1:]
      out += [f"## {title}", ""] + body + [""]
  out += ["## Analysis", "", NOTES.strip(), ""]
  with open(path, "w") as f:
    f.write("\n".join(out))


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--runs", type=int, default=25)
  ap.add_argument("--no-doc", action="store_true")
  ap.add_argument("--only", default=None)
  ap.add_argument("--verbose", action="store_true", help="list every collective")
  args = ap.parse_args(argv)
  assert jax.device_count() == 8, jax.devices()
  cases = [mlp_case(), gpt_case(), mlp_case(dp=8, mp=1), moe_case(), resnet_case()]
  if args.only:
    cases = [c for c in cases if c.name == args.only]
  rows = []
  load0 = os.getloadavg()[0]
  for case in cases:
    t0 = time.perf_counter()
    print(f"== {case.title}", flush=True)
    g, b = measure(case, args.runs)
    diff = max_abs_diff(g.outputs, b.outputs)
    rows.append((case, g, b, diff))
    print(f"   done in {time.perf_counter() - t0:.1f} s; max |gshard - GSPMD| = "
          f"{diff:.1e}", flush=True)
    if args.verbose:
      for r in (g, b):
        print(f"   {r.system}:")
        print("\n".join(collective_listing(r)))
  print()
  print(f"load average (1 min): {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end "
        f"on {os.cpu_count()} cores")
  print(table(rows))
  print()
  for model, bar, met, nums in bars(rows):
    print(f"{'MET ' if met else 'MISS'}  {model:<7} {bar:<32} {nums}")
  if not args.no_doc and not args.only:
    path = os.path.join(_ROOT, "docs", "benchmarks.md")
    write_doc(path, rows, args.runs, (load0, os.getloadavg()[0]))
    print(f"\nwrote {os.path.relpath(path, os.getcwd())}")


if __name__ == "__main__":
  main()
