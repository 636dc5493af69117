"""Pod-scale lowering on this machine: the GPT train step (plain and scanned)
partitioned for 2048 devices and lowered to StableHLO for TPU, from
``jax.ShapeDtypeStruct``s on an ``AbstractMesh`` (no device is needed).

Meshes: (64, 32) named (data, model), and 16x16x8 named (data, seq, model)
with the tokens also split over seq. Checked: the module is a 2048-way SPMD
program (``mhlo.num_partitions = 2048``), the mesh and the per-device blocks
are the expected ones, no primitive takes the safe path, the scanned stack
keeps its loop, and ``Lowered.timings`` reports gshard's phases.
"""

from __future__ import annotations

import math
import re
import time

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

import gshard
from examples import models as M

pytestmark = pytest.mark.filterwarnings("error::gshard.PartitionWarning")

MESHES = {
    "64x32": ((64, 32), ("data", "model")),
    "16x16x8": ((16, 16, 8), ("data", "seq", "model")),
}
SIZES = dict(d_model=256, n_heads=32, d_ff=1024, n_layers=2)
BATCH, SEQ = 256, 128


def abstract_mesh(name):
  shape, names = MESHES[name]
  return AbstractMesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def lower_gpt(mesh_name: str, scanned: bool, vocab: int = 1024):
  m = abstract_mesh(mesh_name)
  init, specs, loss = ((M.gpt_scan_init, M.gpt_scan_specs, M.gpt_scan_loss) if scanned
                       else (M.gpt_init, M.gpt_specs, M.gpt_loss))
  params = jax.eval_shape(lambda: init(jax.random.PRNGKey(0), vocab=vocab, **SIZES))
  assert all(isinstance(p, jax.ShapeDtypeStruct) for p in jax.tree.leaves(params))
  tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
  tok_spec = P("data", "seq") if "seq" in m.axis_names else P("data")
  step = gshard.partition(M.sgd_step(loss), m, in_specs=(specs(params), tok_spec, tok_spec))
  return step.lower(params, tokens, tokens, platform="tpu"), m


CASES = [(mesh_name, scanned) for mesh_name in MESHES for scanned in (False, True)]


@pytest.mark.parametrize("mesh_name,scanned", CASES,
                         ids=[f"{n}-{'scan' if s else 'plain'}" for n, s in CASES])
def test_gpt_train_step_lowers_for_2048_devices(mesh_name, scanned):
  t0 = time.perf_counter()
  low, m = lower_gpt(mesh_name, scanned)
  elapsed = time.perf_counter() - t0
  sizes = dict(zip(m.axis_names, m.axis_sizes))
  assert math.prod(sizes.values()) == 2048
  text = low.as_text()
  assert text.startswith("module @") and "stablehlo." in text
  assert "mhlo.num_partitions = 2048" in text
  assert "mhlo.num_replicas = 1" in text
  for a, n in sizes.items():
    assert f'"{a}"={n}' in text, a
  # the global embedding table and its per-device vocab block
  model = sizes["model"]
  assert "tensor<1024x256xf32>" in text
  assert f"tensor<{1024 // model}x256xf32>" in text
  # the tokens' per-device block: batch over data (and sequence over seq)
  local_tokens = (BATCH // sizes["data"], SEQ // sizes.get("seq", 1))
  assert f"tensor<{local_tokens[0]}x{local_tokens[1]}xi32>" in text
  # the scanned stack stays a loop; the plain one has none
  assert ("stablehlo.while" in text) == scanned
  # nothing took the safe path; tensor parallelism reduces over model
  assert not low.fallbacks
  cols = low.collectives()
  assert cols and not [c for c in cols if c.fallback]
  assert any(c.kind == "psum" and c.axes == ("model",) for c in cols)
  if "seq" in sizes:
    assert any("seq" in c.axes for c in cols)      # the sequence split is real
  # gshard's own phases are timed, in seconds: each took some time, and being
  # disjoint parts of the call they add up to no more than the call took
  timings = low.timings
  assert set(timings) == {"trace", "propagate", "partition_setup", "lower"}, timings
  assert all(isinstance(t, float) and t > 0 for t in timings.values()), timings
  assert sum(timings.values()) <= elapsed, (timings, elapsed)


def test_uneven_vocabulary_at_pod_scale():
  """GPT-2's vocabulary of 50257 over model=32: blocks of ceil(50257/32) = 1571
  rows, the last one padded; still a 2048-way program with no safe path."""
  low, _ = lower_gpt("64x32", scanned=True, vocab=50257)
  text = low.as_text()
  assert "mhlo.num_partitions = 2048" in text
  assert "tensor<1571x256xf32>" in text
  # the per-device program (its arguments padded to 32 x 1571 = 50272 rows)
  assert low.per_device_jaxpr().invars[0].aval.shape == (1571, 256)
  assert not low.fallbacks
  assert not [c for c in low.collectives() if c.kind == "all_gather"
              and c.shape and c.shape[0] == 50257], low.explain()


def test_scanned_program_size_does_not_depend_on_depth_at_pod_scale():
  """2 and 16 layers: the same StableHLO up to the trip count."""
  m = abstract_mesh("64x32")
  texts = []
  for n_layers in (2, 16):
    params = jax.eval_shape(lambda n=n_layers: M.gpt_scan_init(
        jax.random.PRNGKey(0), vocab=1024, **{**SIZES, "n_layers": n}))
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    step = gshard.partition(M.sgd_step(M.gpt_scan_loss), m,
                            in_specs=(M.gpt_scan_specs(params), P("data"), P("data")))
    texts.append(step.lower(params, tokens, tokens, platform="tpu").as_text())
  a, b = texts
  assert abs(len(a) - len(b)) <= 0.02 * len(a), (len(a), len(b))
  assert len(re.findall("stablehlo.while", a)) == len(re.findall("stablehlo.while", b)) >= 1
