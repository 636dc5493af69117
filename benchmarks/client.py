"""gshard vs XLA's GSPMD on client code: Flax Linen models written the way the
public Flax examples write them, annotated the way a Flax user annotates them.

``.venv/bin/python benchmarks/client.py`` runs, in one process on 8 simulated
CPU devices, each case below side by side (benchmarks/run.py's ``measure``:
bytes from the compiled HLO, memory, gshard's own time, XLA compile time, and
step times of the two systems interleaved) and writes docs/benchmarks-client.md.

The code is not written for gshard:

- ``LM``: a decoder-only language model after flax/examples/lm1b: ``nn.Embed``
  tokens and learned positions, pre-LN blocks of ``nn.SelfAttention`` with
  ``nn.make_causal_mask`` and a GELU MLP, an untied logits ``nn.Dense``; the
  parameters carry logical axis names (``nn.with_logical_partitioning``), the
  activations ``nn.with_logical_constraint``; a ``flax.training.train_state
  .TrainState`` with ``optax.chain(clip_by_global_norm, adamw)`` on a
  warm-up cosine schedule (the step counter is ``state.step``), a
  ``jax.value_and_grad`` train step. One model, three layouts, chosen by the
  logical axis rules and the state's specs only:

    lm_megatron  mesh data=2 x model=4: batch over data; heads, MLP hidden and
                 vocab over model (``nn.logical_to_mesh(nn.get_partition_spec
                 (abstract_state))``, the Flax guide's recipe)
    lm_fsdp      mesh data=8: batch over data; every parameter (and Adam
                 moment) split on its largest dim divisible by 8, the JAX
                 FSDP recipe (a ``tree_map`` over the state)
    lm_dp        mesh data=8: batch over data, state replicated
    lm_accum     lm_fsdp's layout, the gradient accumulated over 2 micro-batches
                 (``lm_accum_train_step``: the batch reshaped to [2, B/2], a
                 ``lax.scan`` summing losses and gradients, as MaxText does)

- ``ResNet``: flax/examples/imagenet's ResNet (``ResNetBlock`` with projection
  shortcuts, a 7x7/2 stem, BatchNorm in train mode with ``batch_stats``
  mutable, SGD with Nesterov momentum on a cosine schedule, L2 weight penalty,
  accuracy metric), with three ``nn.with_logical_constraint`` lines added:

    resnet       mesh data=2 x model=4: batch over data everywhere; the image
                 and the stem (7x7/2 conv, BatchNorm, 3x3/2 max pool) split
                 spatially, H over model (few channels, large images: the
                 GSPMD paper's spatial partitioning); from the first stage
                 on, output channels over model (every kernel's last dim,
                 BatchNorm scale/bias/mean/var and momentum buffers alike)

Both systems get the same functions, the same logical rules (under
``jax.set_mesh`` and ``nn.logical_axis_rules``, flax emits
``jax.lax.with_sharding_constraint``) and the same in_specs: gshard through
``gshard.partition(step, mesh, in_specs=...)``, GSPMD through ``jax.jit`` with
the same ``in_shardings`` (``gshard.gspmd_jit``).

Options: ``--runs N`` (at least N timed steps per system, default 25),
``--seconds S`` (about S seconds of interleaved timing per case, default 12),
``--only NAME``, ``--no-doc``, ``--verbose`` (list every collective),
``--no-rerun`` (do not measure a step-time MISS a second time).
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from benchmarks import run as R  # noqa: E402  (first: sets XLA_FLAGS for 8 devices)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import gshard  # noqa: E402


# -- the language model (after flax/examples/lm1b) --------------------------------

@dataclasses.dataclass(frozen=True)
class LMConfig:
  vocab: int = 512
  d_model: int = 128
  heads: int = 4
  d_ff: int = 512
  layers: int = 2
  max_len: int = 64


def _init(init, names):
  return nn.with_logical_partitioning(init, names)


class MlpBlock(nn.Module):
  cfg: LMConfig

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(self.cfg.d_ff, kernel_init=_init(nn.initializers.xavier_uniform(),
                                                  ("embed", "mlp")),
                 bias_init=_init(nn.initializers.zeros_init(), ("mlp",)))(x)
    h = nn.with_logical_constraint(nn.gelu(h), ("batch", "length", "mlp"))
    return nn.Dense(self.cfg.d_model, kernel_init=_init(nn.initializers.xavier_uniform(),
                                                        ("mlp", "embed")),
                    bias_init=_init(nn.initializers.zeros_init(), ("embed",)))(h)


class DecoderBlock(nn.Module):
  cfg: LMConfig

  @nn.compact
  def __call__(self, x, mask):
    ln = functools.partial(nn.LayerNorm, scale_init=_init(nn.initializers.ones, ("embed",)),
                           bias_init=_init(nn.initializers.zeros_init(), ("embed",)))
    # DenseGeneral calls kernel_init with the kernel flattened to 2-D ([D, heads*kv]
    # for q/k/v, [heads*kv, D] for the output) and checks it again under apply, so
    # the logical names are those of the flat kernel: the heads lead the fused dim
    y = nn.SelfAttention(
        num_heads=self.cfg.heads, use_bias=False, deterministic=True,
        kernel_init=_init(nn.initializers.xavier_uniform(), ("embed", "heads")),
        out_kernel_init=_init(nn.initializers.xavier_uniform(), ("heads", "embed")),
    )(ln()(x), mask=mask)
    x = nn.with_logical_constraint(x + y, ("batch", "length", "embed"))
    x = x + MlpBlock(self.cfg)(ln()(x))
    return nn.with_logical_constraint(x, ("batch", "length", "embed"))


class LM(nn.Module):
  cfg: LMConfig

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg
    x = nn.Embed(cfg.vocab, cfg.d_model, embedding_init=_init(
        nn.initializers.normal(1.0), ("vocab", "embed")))(tokens)
    pos = nn.Embed(cfg.max_len, cfg.d_model, embedding_init=_init(
        nn.initializers.normal(0.02), ("position", "embed")), name="pos_embed")
    x = x + pos(jnp.arange(tokens.shape[1]))[None]
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    mask = nn.make_causal_mask(tokens)
    for _ in range(cfg.layers):
      x = DecoderBlock(cfg)(x, mask)
    x = nn.LayerNorm()(x)
    logits = nn.Dense(cfg.vocab, use_bias=False, kernel_init=_init(
        nn.initializers.xavier_uniform(), ("embed", "vocab")), name="logits")(x)
    return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))


def lm_train_step(state, batch):
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["inputs"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return loss.mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  state = state.apply_gradients(grads=grads)
  return state, {"loss": loss, "lr": LM_SCHEDULE(state.step)}


def lm_accum_train_step(state, batch, microbatches: int = 2):
  """``lm_train_step`` with gradient accumulation as MaxText writes it: the
  batch reshaped into micro-batches, a ``lax.scan`` adding their losses and
  gradients, the mean applied once."""
  def loss_fn(params, mb):
    logits = state.apply_fn({"params": params}, mb["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, mb["targets"]).mean()

  mbs = jax.tree.map(lambda x: x.reshape((microbatches, -1) + x.shape[1:]), batch)

  def body(acc, mb):
    return jax.tree.map(jnp.add, acc, jax.value_and_grad(loss_fn)(state.params, mb)), None
  zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, state.params))
  (loss, grads), _ = jax.lax.scan(body, zeros, mbs)
  state = state.apply_gradients(grads=jax.tree.map(lambda g: g / microbatches, grads))
  return state, {"loss": loss / microbatches, "lr": LM_SCHEDULE(state.step)}


LM_SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-3, warmup_steps=10,
                                                 decay_steps=1000)

MEGATRON_RULES = (("batch", "data"), ("length", None), ("embed", None), ("heads", "model"),
                  ("mlp", "model"), ("vocab", "model"), ("position", None))
DATA_RULES = (("batch", "data"),)        # FSDP and DP: only the batch is annotated


def largest_dim_spec(x, axis="data", size=8):
  """FSDP: split an array on its largest dim that ``size`` divides (ties: the
  first), over ``axis``; scalars and arrays with no such dim are replicated."""
  dims = [d for d in range(np.ndim(x)) if x.shape[d] % size == 0]
  if not dims:
    return P()
  d = max(dims, key=lambda i: x.shape[i])
  return P(*([None] * d + [axis]))


def _lm_state(cfg: LMConfig, rng):
  model = LM(cfg)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(LM_SCHEDULE, weight_decay=0.1))

  def create(rng):
    variables = model.init(rng, jnp.ones((1, cfg.max_len), jnp.int32))
    return train_state.TrainState.create(apply_fn=model.apply,
                                         params=variables["params"], tx=tx)
  boxed = create(rng)                       # LogicallyPartitioned leaves
  return nn.unbox(boxed), nn.get_partition_spec(boxed)


def lm_cases(batch=16, cfg=LMConfig()) -> list[tuple[R.Case, tuple]]:
  """The same LM under three layouts: (Case, logical rules) each."""
  rng = np.random.default_rng(0)
  toks = rng.integers(0, cfg.vocab, (batch, cfg.max_len + 1)).astype(np.int32)
  data = {"inputs": toks[:, :-1], "targets": toks[:, 1:]}
  state, logical = _lm_state(cfg, jax.random.PRNGKey(0))
  size = (f"L={cfg.layers}, D={cfg.d_model}, heads={cfg.heads}, F={cfg.d_ff}, "
          f"V={cfg.vocab}, T={cfg.max_len}, B={batch}")
  with nn.logical_axis_rules(MEGATRON_RULES):
    megatron = nn.logical_to_mesh(logical)
  fsdp = jax.tree.map(largest_dim_spec, state)
  dp = jax.tree.map(lambda _: P(), state)
  return [
      (R.Case("lm_megatron", f"Flax LM ({size}), Megatron: heads, MLP hidden, vocab "
              "over model, batch over data, mesh data=2 x model=4", (2, 4),
              ("data", "model"), lm_train_step, (state, data), (megatron, P("data")),
              {}, ""), MEGATRON_RULES),
      (R.Case("lm_fsdp", f"Flax LM ({size}), FSDP: every parameter and Adam moment "
              "split on its largest dim over 8, batch over 8, mesh data=8", (8,), ("data",),
              lm_train_step, (state, data), (fsdp, P("data")), {}, ""), DATA_RULES),
      (R.Case("lm_dp", f"Flax LM ({size}), data parallel: state replicated, batch "
              "over 8, mesh data=8", (8,), ("data",), lm_train_step, (state, data),
              (dp, P("data")), {}, ""), DATA_RULES),
      (R.Case("lm_accum", f"Flax LM ({size}), FSDP as lm_fsdp, gradients accumulated "
              "over 2 micro-batches (the batch reshaped, a scan), mesh data=8", (8,),
              ("data",), lm_accum_train_step, (state, data), (fsdp, P("data")), {}, ""),
       DATA_RULES),
  ]


# -- the ResNet (after flax/examples/imagenet/models.py) -------------------------

ModuleDef = Any


class ResNetBlock(nn.Module):
  filters: int
  conv: ModuleDef
  norm: ModuleDef
  act: Callable
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    residual = x
    y = self.conv(self.filters, (3, 3), self.strides)(x)
    y = self.norm()(y)
    y = self.act(y)
    y = self.conv(self.filters, (3, 3))(y)
    y = self.norm(scale_init=nn.initializers.zeros_init())(y)
    if residual.shape != y.shape:
      residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
      residual = self.norm(name="norm_proj")(residual)
    y = self.act(residual + y)
    return nn.with_logical_constraint(y, ("batch", None, None, "channels"))   # added


class ResNet(nn.Module):
  stage_sizes: Sequence[int]
  num_classes: int
  num_filters: int = 64
  dtype: Any = jnp.float32
  act: Callable = nn.relu

  @nn.compact
  def __call__(self, x, train: bool = True):
    conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                             epsilon=1e-5, dtype=self.dtype)
    x = nn.with_logical_constraint(x, ("batch", "height", None, None))       # added
    x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
    x = norm(name="bn_init")(x)
    x = nn.relu(x)
    x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    x = nn.with_logical_constraint(x, ("batch", "height", None, None))       # added
    for i, block_size in enumerate(self.stage_sizes):
      for j in range(block_size):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        x = ResNetBlock(self.num_filters * 2 ** i, strides=strides, conv=conv, norm=norm,
                        act=self.act)(x)
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
    return jnp.asarray(x, self.dtype)


class ResNetState(train_state.TrainState):
  batch_stats: Any


def resnet_train_step(state, batch):
  """flax/examples/imagenet/train.py's train_step (jit, not pmap: no pmean)."""
  def loss_fn(params):
    logits, new_model_state = state.apply_fn(
        {"params": params, "batch_stats": state.batch_stats}, batch["image"],
        mutable=["batch_stats"])
    one_hot = jax.nn.one_hot(batch["label"], num_classes=10)
    loss = jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot))
    weight_l2 = sum(jnp.sum(x ** 2) for x in jax.tree_util.tree_leaves(params) if x.ndim > 1)
    return loss + 1e-4 * 0.5 * weight_l2, (new_model_state, logits)

  (loss, (new_model_state, logits)), grads = jax.value_and_grad(
      loss_fn, has_aux=True)(state.params)
  metrics = {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"]),
             "learning_rate": RESNET_SCHEDULE(state.step)}
  state = state.apply_gradients(grads=grads, batch_stats=new_model_state["batch_stats"])
  return state, metrics


RESNET_SCHEDULE = optax.cosine_decay_schedule(0.1, decay_steps=1000)
RESNET_RULES = (("batch", "data"), ("height", "model"), ("channels", "model"))


def resnet_specs(state, stem=("conv_init", "bn_init")):
  """Output channels (last dim) over model, except in the stem (replicated: the
  stem is split spatially); the step counter and the Dense head replicated."""
  def spec(path, x):
    names = {getattr(k, "key", getattr(k, "name", None)) for k in path}
    if np.ndim(x) == 0 or names & set(stem) or x.shape[-1] % 4:
      return P()
    return P(*([None] * (np.ndim(x) - 1) + ["model"]))
  return jax.tree_util.tree_map_with_path(spec, state)


def resnet_case(batch=16, size=64, stages=(1, 1, 1), filters=16) -> tuple[R.Case, tuple]:
  model = ResNet(stage_sizes=stages, num_classes=10, num_filters=filters)
  rng = np.random.default_rng(0)
  image = rng.standard_normal((batch, size, size, 3)).astype(np.float32)
  label = (np.arange(batch) % 10).astype(np.int32)
  variables = model.init(jax.random.PRNGKey(0), image[:1])
  tx = optax.sgd(RESNET_SCHEDULE, momentum=0.9, nesterov=True)
  state = ResNetState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                             batch_stats=variables["batch_stats"])
  specs = resnet_specs(state)
  return (R.Case("resnet", f"Flax ResNet (imagenet example's blocks, stages {list(stages)}, "
                 f"{filters} filters, BatchNorm, SGD Nesterov, B={batch}, {size}x{size}), "
                 "batch over data; image and stem H over model, then output channels "
                 "over model, mesh data=2 x model=4", (2, 4), ("data", "model"),
                 resnet_train_step, (state, {"image": image, "label": label}),
                 (specs, P("data")), {}, ""), RESNET_RULES)


# -- measuring (run.py's measure under the Flax user's contexts) -----------------

def measure(case: R.Case, rules, runs: int,
            seconds: float) -> tuple[R.Result, R.Result, list[str]]:
  """run.py's ``measure`` inside ``jax.set_mesh`` and ``nn.logical_axis_rules``
  (flax's logical constraints are no-ops without them), then the warnings
  gshard gives (safe paths, padding) for the same step, lowered once more."""
  mesh = gshard.make_mesh(case.mesh_shape, case.mesh_names)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    g, b = R.measure(case, runs, min_seconds=seconds)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      gshard.partition(case.step, mesh, in_specs=case.in_specs).lower(*case.args)
  notes = sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0]}"
                  for w in caught if issubclass(w.category, gshard.PartitionWarning)})
  return g, b, notes


def table(rows) -> str:
  """run.py's table without its analytic-minimum column (none here), with the
  step-time ratio gshard / GSPMD on the gshard line."""
  lines = R.table([row[:4] for row in rows]).splitlines()
  out = []
  for i, line in enumerate(lines):
    cells = line.split("|")[1:-1]
    del cells[3]
    if i == 0:
      cells.insert(4, " step ratio gshard/GSPMD ")
    elif i == 1:
      cells.insert(4, "---:")
    else:
      case, g, b = rows[(i - 2) // 2][:3]
      cells.insert(4, f" {g.step_ms / b.step_ms:.3f}x " if i % 2 == 0 else " ")
    out.append("|" + "|".join(cells) + "|")
  return "\n".join(out)


def verdicts(rows) -> list[tuple[str, str, bool, str]]:
  """run.py's bars; a step-time MISS measured twice says both numbers and is
  MET only when the second measurement meets the bar."""
  out = []
  for case, g, b, d, first, _ in rows:
    for model, bar, met, nums in R.bars([(case, g, b, d)]):
      if bar.startswith("step time"):
        bar = "step-time ratio <= 1.1"
        if first is not None:
          r0 = first[0].step_ms / first[1].step_ms
          nums += (f"; first run {first[0].step_ms:.2f} vs {first[1].step_ms:.2f} ms "
                   f"({r0:.3f}x)")
      out.append((model, bar, met, nums))
  return out


def _ratio(g: R.Result, b: R.Result) -> float:
  return g.step_ms / b.step_ms


def write_doc(path: str, rows, runs: int, seconds: float, load: tuple[float, float]) -> None:
  out = ["# Benchmarks on client code: Flax Linen models, gshard vs XLA GSPMD", "",
         "Generated by `benchmarks/client.py`; rerun it rather than editing the measured "
         "sections.", "",
         "The models are written the way the public Flax examples write them (the LM "
         "after flax/examples/lm1b, the ResNet after flax/examples/imagenet), with "
         "`nn.with_logical_partitioning` on parameters, `nn.with_logical_constraint` on a "
         "few activations, a `flax.training.train_state.TrainState` and optax; nothing in "
         "them is written for gshard. Both systems partition the very same train step "
         "under the same `jax.set_mesh` and `nn.logical_axis_rules` (flax turns the "
         "logical constraints into `jax.lax.with_sharding_constraint`) with the same "
         "`in_specs`: `gshard.partition(step, mesh, in_specs=...)` against "
         "`jax.jit(step, in_shardings=...)` (XLA's GSPMD).", "",
         f"- Measured: {datetime.date.today().isoformat()}, commit {R.commit()}",
         f"- Machine: {R.machine()}. Load average (1 min) {load[0]:.1f} at the start, "
         f"{load[1]:.1f} at the end of the run (other processes shared the cores).",
         "- **Step times on simulated CPU devices are indicative only**: the 8 "
         "\"devices\" share the host's cores and collectives are memory copies. Bytes and "
         "memory are properties of the compiled programs and carry over.",
         f"- Step time: median (IQR) of at least {runs} steps per system, more for fast "
         f"cases (about {seconds:.0f} s of timing each: "
         + ", ".join(f"{c.name} {len(g.step_s)}" for c, g, *_ in rows) +
         "), after warm-up, gshard and GSPMD interleaved, inputs pre-placed with the same "
         "shardings. A case whose ratio misses the bar is measured a second time "
         "(compiled and timed again) and the second measurement is the one shown.",
         "- Bytes: collective bytes one device sends, from each compiled program's "
         "optimized HLO with the ring formulas (benchmarks/hlo.py; a collective "
         "inside a loop once per iteration: lm_accum's scan). Memory: temp + "
         "argument + output of `compiled.memory_analysis()`. Own overhead: gshard's "
         "trace + propagate + partition set-up + lower; for GSPMD jax's trace + lower. "
         "XLA compile: `lowered.compile()`.", "",
         "## Cases", ""]
  for case, *_ in rows:
    out.append(f"- **{case.name}**: {case.title}.")
  out += ["", "Layouts, as the user writes them (benchmarks/client.py):", "",
          "- `lm_megatron`: `nn.logical_axis_rules` batch->data, heads->model, "
          "mlp->model, vocab->model (embedding rows, logits columns); the state's specs are "
          "`nn.logical_to_mesh(nn.get_partition_spec(state))`, so the Adam moments follow "
          "their parameters.",
          "- `lm_fsdp`: rules batch->data only (activations split on the batch, all other "
          "dims replicated); every leaf of the state (parameters, both Adam moments) split "
          "on its largest dim divisible by 8 over the one mesh axis.",
          "- `lm_dp`: rules batch->data only; every leaf of the state replicated.",
          "- `resnet`: rules batch->data, height->model, channels->model. The image and "
          "the stem's output carry `(batch, height, None, None)`: the 7x7/2 stem conv, its "
          "BatchNorm and the 3x3/2 max pool run split spatially (halos between "
          "neighbours); each block's output carries `(batch, None, None, channels)`, and "
          "every kernel after the stem has its output channels (last dim) over model, as "
          "have the BatchNorm scales, biases, running means and variances and the momentum "
          "buffers; the stem's kernel and BatchNorm and the Dense head are replicated.",
          "", "## Results", "", table(rows), "",
          "Correctness check (max |gshard - GSPMD| over all outputs of one step, the new "
          "state and the metrics): " +
          ", ".join(f"{row[0].name} {row[3]:.1e}" for row in rows) + ".", "",
          "## Bars", "", "| case | bar | met | numbers |", "|---|---|---|---|"]
  for model, bar, met, nums in verdicts(rows):
    out.append(f"| {model} | {bar} | {'MET' if met else '**MISS**'} | {nums} |")
  warned = [(row[0].name, n) for row in rows for n in row[5]]
  out += ["", "gshard warnings while partitioning (safe paths, padding): " +
          ("; ".join(f"{name}: {n}" for name, n in warned) if warned else "none") + ".",
          "", "## Collectives in the compiled programs", "",
          "Every collective of each optimized HLO module: kind, group size n, operand "
          "bytes, bytes sent per device, operand shapes (per device), XLA's op_name.", ""]
  for case, g, b, *_ in rows:
    for r in (g, b):
      out += [f"{case.name} / {r.system}: {len(r.collectives)} collectives, "
              f"{R.fmt_bytes(r.bytes_sent)} sent per device", "", "```"]
      out += R.collective_listing(r) or ["    (none)"]
      out += ["```", ""]
  from benchmarks.client_notes import NOTES
  out += ["## Analysis", "", NOTES.strip(), ""]
  with open(path, "w") as f:
    f.write("\n".join(out))


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--runs", type=int, default=25)
  ap.add_argument("--no-doc", action="store_true")
  ap.add_argument("--only", default=None)
  ap.add_argument("--verbose", action="store_true", help="list every collective")
  ap.add_argument("--no-rerun", action="store_true")
  ap.add_argument("--seconds", type=float, default=12.0,
                  help="about this many seconds of interleaved timing per case")
  args = ap.parse_args(argv)
  assert jax.device_count() == 8, jax.devices()
  cases = [*lm_cases(), resnet_case()]
  if args.only:
    cases = [(c, r) for c, r in cases if c.name == args.only]
  rows = []
  load0 = os.getloadavg()[0]
  for case, rules in cases:
    t0 = time.perf_counter()
    print(f"== {case.title}", flush=True)
    g, b, notes = measure(case, rules, args.runs, args.seconds)
    first = None
    if _ratio(g, b) > 1.10 and not args.no_rerun:
      print(f"   step ratio {_ratio(g, b):.3f}x > 1.1: measuring again", flush=True)
      first = (g, b)
      g, b, notes = measure(case, rules, args.runs, args.seconds)
    diff = R.max_abs_diff(g.outputs, b.outputs)
    rows.append((case, g, b, diff, first, notes))
    print(f"   done in {time.perf_counter() - t0:.1f} s; step {g.step_ms:.2f} vs "
          f"{b.step_ms:.2f} ms ({_ratio(g, b):.3f}x); bytes {R.fmt_bytes(g.bytes_sent)} vs "
          f"{R.fmt_bytes(b.bytes_sent)}; max |gshard - GSPMD| = {diff:.1e}", flush=True)
    for n in notes:
      print(f"   {n}")
    if args.verbose:
      for r in (g, b):
        print(f"   {r.system}:")
        print("\n".join(R.collective_listing(r)))
  print()
  print(f"load average (1 min): {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end "
        f"on {os.cpu_count()} cores")
  print(table(rows))
  print()
  for model, bar, met, nums in verdicts(rows):
    print(f"{'MET ' if met else 'MISS'}  {model:<12} {bar:<32} {nums}")
  if not args.no_doc and not args.only:
    path = os.path.join(_ROOT, "docs", "benchmarks-client.md")
    write_doc(path, rows, args.runs, args.seconds, (load0, os.getloadavg()[0]))
    print(f"\nwrote {os.path.relpath(path, os.getcwd())}")


if __name__ == "__main__":
  main()
