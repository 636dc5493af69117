"""The structure of a pipelined train step, read from the program gshard builds.

On simulated CPU devices step time means nothing, so these tests count what
the per-device program does: its tick loops (``M*repeats + K - 1`` ticks, the
forward scan and its transpose), its collective permutes (one forward shift
and one reverse shift per tick, each one micro-batch's activation, by
gshard's own record and in XLA's optimized HLO, with the expected device
pairs), no all-gather over the stage axis, the weights each device holds (1/K
of the stack), the FLOPs per device (every tick runs every layer slot) and
temporary memory with and without remat.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import gshard
from gshard import pipeline
from gshard.pipeline.costs import jaxpr_counts
from helpers_partition import hlo_collectives, mesh

D, H = 16, 64


def layer_fn(p, h):
  return h + jax.nn.gelu(h @ p["w1"]) @ p["w2"]


def stack(num_layers, repeats=1, balance=None):
  layers = [{"w1": jnp.full((D, H), 0.01 * (i + 1)), "w2": jnp.full((H, D), 0.01)}
            for i in range(num_layers)]
  return pipeline.stack(layers, repeats=repeats, balance=balance)


def train_step(m, **kw):
  def loss(stacked, x):
    return jnp.mean(pipeline.run(layer_fn, stacked, x, num_microbatches=m, **kw) ** 2)

  def step(stacked, x):
    value, grads = jax.value_and_grad(loss)(stacked, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, stacked, grads), value
  return step


def lowered(mesh_args, num_layers, m, batch, **kw):
  stacked = stack(num_layers, kw.get("repeats", 1), kw.get("balance"))
  lead = (None,) if kw.get("repeats", 1) > 1 else ()
  data = P("data") if "data" in mesh_args[1] else P()
  step = gshard.partition(train_step(m, **kw), mesh(*mesh_args),
                          in_specs=(P(*lead, "stage"), data))
  return step.lower(stacked, jnp.ones((batch, D))), stacked


def scan_lengths(jaxpr) -> list[int]:
  return sorted(e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan")


CONFIGS = [
    # mesh, L, M, batch, kw, K, data shards
    (((4,), ("stage",)), 8, 4, 16, {}, 4, 1),
    (((2, 4), ("data", "stage")), 8, 8, 32, {}, 4, 2),
    (((4, 2), ("data", "stage")), 4, 8, 64, {}, 2, 4),
    (((2, 4), ("data", "stage")), 16, 8, 32, {"repeats": 2}, 4, 2),
    (((4,), ("stage",)), 8, 4, 16, {"balance": [1, 3, 3, 1]}, 4, 1),
]
IDS = ["K4M4", "K4M8 data2", "K2M8 data4", "K4M8 v2 data2", "K4M4 balance"]


@pytest.fixture(scope="module", params=list(zip(CONFIGS, IDS)), ids=IDS)
def config(request):
  (mesh_args, num_layers, m, batch, kw, k, data), _ = request.param
  low, stacked = lowered(mesh_args, num_layers, m, batch, **kw)
  return dict(mesh_args=mesh_args, L=num_layers, M=m, B=batch, kw=kw, K=k, data=data,
              v=kw.get("repeats", 1), low=low, stacked=stacked,
              hlo=hlo_collectives(low.compile().as_text(), mesh(*mesh_args)))


def ticks(c) -> int:
  return c["M"] * c["v"] + c["K"] - 1


def test_the_tick_loops_run_m_times_repeats_plus_k_minus_1_ticks(config):
  c = config
  jaxpr = c["low"].per_device_jaxpr()
  # the forward tick scan and its transpose (jax may hoist short loop-invariant scans
  # over the layer slots out of them)
  lengths = scan_lengths(jaxpr)
  assert [n for n in lengths if n >= ticks(c)] == [ticks(c), ticks(c)], lengths
  assert pipeline.schedule("gpipe", num_stages=c["K"], num_microbatches=c["M"],
                           repeats=c["v"]).num_ticks == 2 * ticks(c)


def test_one_forward_permute_and_its_transpose_per_tick(config):
  c = config
  mb_bytes = c["B"] // c["M"] // c["data"] * D * 4     # one micro-batch's activation
  permutes = [x for x in c["low"].collectives() if x.kind == "ppermute"]
  assert len(permutes) == 2
  assert all(x.axes == ("stage",) for x in permutes)
  assert [x.bytes for x in permutes] == [ticks(c) * mb_bytes] * 2
  assert sorted(x.role for x in permutes)[0].startswith("rows shifted by -1 along dim 0")
  # in XLA's program: two collective permutes of one local micro-batch each
  hlo = [x for x in c["hlo"] if x.kind == "collective-permute"]
  assert len(hlo) == 2
  assert all(x.nbytes == mb_bytes for x in hlo)
  k, devices = c["K"], mesh(*c["mesh_args"]).devices
  stage_dim = c["mesh_args"][1].index("stage")
  lines = np.moveaxis(devices, stage_dim, -1).reshape(-1, k)
  ring = c["v"] > 1
  forward = {(int(line[s].id), int(line[(s + 1) % k].id)) for line in lines
             for s in range(k) if ring or s + 1 < k}
  backward = {(b, a) for a, b in forward}
  assert sorted(set(x.groups) for x in hlo) == sorted([forward, backward])


def test_no_all_gather_and_only_the_expected_reductions(config):
  c = config
  assert "all-gather" not in {x.kind for x in c["hlo"]}
  assert not any(x.kind == "all_gather" for x in c["low"].collectives())
  reductions = {(x.kind, x.axes) for x in c["low"].collectives() if x.kind != "ppermute"}
  expected = {("psum", ("stage",))}     # the last stage's outputs, once after the loop
  if c["data"] > 1:
    expected.add(("psum", ("data",)))   # the data-parallel gradient sums and the loss
  assert reductions == expected
  (out,) = [x for x in c["low"].collectives() if x.axes == ("stage",) and x.kind == "psum"]
  assert out.bytes == 2 * (c["K"] - 1) * (c["B"] // c["data"] * D * 4) // c["K"]


def test_each_device_holds_one_kth_of_the_stack(config):
  c = config
  sizes = dict(zip(c["mesh_args"][1], c["mesh_args"][0]))
  stack_bytes = sum(a.size * 4 for a in jax.tree.leaves(c["stacked"]))
  stack_shardings = c["low"].in_shardings[:len(jax.tree.leaves(c["stacked"]))]
  local = sum(math.prod(s.local_shape(a.shape, sizes)) * 4
              for s, a in zip(stack_shardings, jax.tree.leaves(c["stacked"])))
  assert local * c["K"] == stack_bytes
  x_bytes = c["B"] * D * 4 // c["data"]
  mem = c["low"].compile().memory_analysis()
  assert mem.argument_size_in_bytes == local + x_bytes


def dot_flops(jaxpr) -> int:
  """FLOPs of the matmuls of a jaxpr (``2 * prod(batch, free, contracting)`` each),
  a scan's body times its length, other inner jaxprs once."""
  total = 0
  for e in jaxpr.eqns:
    if e.primitive.name == "dot_general":
      (lc, rc), (lb, _) = e.params["dimension_numbers"]
      lhs, rhs = e.invars[0].aval.shape, e.invars[1].aval.shape
      free = [n for i, n in enumerate(rhs) if i not in rc and i not in e.params[
          "dimension_numbers"][1][1]]
      total += 2 * math.prod(lhs) * math.prod(free)
    for sub in jax.extend.core.jaxprs_in_params(e.params):
      total += dot_flops(sub) * (e.params["length"] if e.primitive.name == "scan" else 1)
  return total


def test_flops_per_device_are_every_tick_times_every_layer_slot(config):
  """Each tick runs all S layer slots of a stage on one micro-batch, bubbles
  included: forward, its recompute (remat) and the backward (an input and a
  weight gradient per matmul), so the matmul FLOPs per device are exactly
  ``T * S * 8 * (2 * rows * D * H)``: ``T / (M * repeats)`` times the device's
  share of the plain loop's ``4 * 2 * B * D * H`` per layer (plus recompute)."""
  c = config
  slots = max(c["kw"]["balance"]) if "balance" in c["kw"] else c["L"] // (c["K"] * c["v"])
  rows = c["B"] // c["M"] // c["data"]
  jaxpr = c["low"].per_device_jaxpr()
  matmul = 2 * rows * D * H
  assert dot_flops(jaxpr) == ticks(c) * slots * 8 * matmul
  total, _ = jaxpr_counts(jaxpr)    # every primitive, by gshard.pipeline.costs' rules
  assert dot_flops(jaxpr) < total < 2 * dot_flops(jaxpr)


def test_remat_keeps_boundary_activations_only():
  """With remat a stage keeps its tick inputs; without, every layer's activations
  (T ticks x S slots x the per-layer residuals of a micro-batch)."""
  mesh_args, num_layers, m, batch = ((4,), ("stage",)), 8, 4, 256
  temp = {}
  for remat in (True, False):
    low, _ = lowered(mesh_args, num_layers, m, batch, remat=remat)
    temp[remat] = low.compile().memory_analysis().temp_size_in_bytes
  t, rows, slots = m + 3, batch // m, num_layers // 4
  # lower bound without remat: per tick and slot, gelu's input and output [rows, H]
  assert temp[False] >= t * slots * rows * 2 * H * 4
  assert temp[True] * 3 < temp[False], temp
