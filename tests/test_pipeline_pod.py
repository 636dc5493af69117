"""A 64-layer pipelined train step lowered for a 2048-chip TPU pod, on this machine.

AbstractMesh (data=16, stage=16, model=8): 16 stages of 4 Megatron layers,
the batch over data, each layer's hidden dim over model, 32 micro-batches.
Checked: the module is a 2048-way SPMD program with the tick loop kept as a
loop and collective permutes between stages, each device's weights are one
stage's block (4 layers, a model shard), nothing took the safe path or
gathers over stage, and gshard's own time (trace, propagate, partition,
lower) does not grow with the number of devices (64 vs 2048, same program).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

import gshard
from gshard import pipeline

pytestmark = pytest.mark.filterwarnings("error::gshard.PartitionWarning")

D, H, L, B, M = 256, 1024, 64, 512, 32
SPECS = {"w1": P("stage", None, "model"), "w2": P("stage", "model", None)}


def layer(p, h):
  u = gshard.shard(jax.nn.gelu(h @ p["w1"]), P("data", "model"))
  return h + u @ p["w2"]


def make_step():
  def loss(stacked, x):
    return jnp.mean(pipeline.run(layer, stacked, x, num_microbatches=M) ** 2)

  def step(stacked, x):
    value, grads = jax.value_and_grad(loss)(stacked, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, stacked, grads), value
  return step


def lower(shape):
  m = AbstractMesh(shape, ("data", "stage", "model"), axis_types=(AxisType.Auto,) * 3)
  stacked = {"w1": jax.ShapeDtypeStruct((L, D, H), jnp.float32),
             "w2": jax.ShapeDtypeStruct((L, H, D), jnp.float32)}
  x = jax.ShapeDtypeStruct((B, D), jnp.float32)
  step = gshard.partition(make_step(), m, in_specs=(SPECS, P("data")))
  return step.lower(stacked, x, platform="tpu")


def test_64_layers_over_16_stages_lower_for_2048_tpu_devices():
  low = lower((16, 16, 8))
  text = low.as_text()
  assert "mhlo.num_partitions = 2048" in text
  for a, n in (("data", 16), ("stage", 16), ("model", 8)):
    assert f'"{a}"={n}' in text
  assert "stablehlo.while" in text and "stablehlo.collective_permute" in text
  # a device's weights: its stage's 4 layers, its model shard of the hidden dim
  assert f"tensor<4x{D}x{H // 8}xf32>" in text and f"tensor<4x{H // 8}x{D}xf32>" in text
  assert not low.fallbacks
  cols = low.collectives()
  assert not [c for c in cols if c.kind == "all_gather"]
  permutes = [c for c in cols if c.kind == "ppermute"]
  ticks = M + 16 - 1
  rows = B // M // 16
  assert [(c.axes, c.bytes) for c in permutes] == [(("stage",), ticks * rows * D * 4)] * 2
  assert {c.axes for c in cols if c.kind == "psum"} == {("data",), ("model",), ("stage",)}


def test_own_time_is_flat_in_the_number_of_devices():
  own = {}
  for shape in ((2, 16, 2), (16, 16, 8)):
    runs = []
    for _ in range(2):
      low = lower(shape)
      runs.append(sum(low.timings.values()))
    own[shape] = min(runs)
  assert own[(16, 16, 8)] < 2.5 * own[(2, 16, 2)] + 0.5, own
