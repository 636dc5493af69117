"""``stage_switch``: row k of every result comes from branch ``index[k]``.

The pipeline executor runs a tick where stages run different actions (1F1B's
steady state) as one ``stage_switch``; under gshard each device runs only its
own branch (a ``lax.switch`` on its entry of the index). Property tests over
random meshes, index vectors, branch sets and dtypes: the partitioned result
equals the primitive's one-device definition (every branch computed, rows
selected), NaN positions included, for

- the per-device switch (the K dim split one row per device), also with
  branches that need collectives over another mesh axis (their participants
  share the stage, hence the branch);
- the fallback where K is split into blocks of several rows, and where a
  branch needs a collective over the stage axis itself (a sum over stages):
  every branch on every device, rows selected, with a SwitchWarning.

Tolerance: a branch's rows are computed by the same ops on one device and on
the mesh, except sums over a split dim (psum of partial sums in another
order); every sum here has at most 16 terms of size <= 4, so an f32 result is
within ``16 * 4 * 2**-24 * 16`` of the other order (Higham's bound, summed
values' magnitudes <= 4 * 16); bf16 with its unit roundoff 2**-8.
"""

from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import gshard
from gshard.pipeline.switch import stage_switch
from gshard.spmd.partition.pipeline import SwitchWarning
from helpers_partition import mesh

N, D = 4, 16


def _branches(kind: str):
  """Branch sets: ``x [K, N, D]``, ``w [K, D, D]`` -> ``[y [K, N, D], s [K]]``."""
  def zero(x, w):
    return [jnp.zeros_like(x), jnp.zeros(x.shape[:1], x.dtype)]

  def matmul(x, w):
    y = jnp.einsum("knd,kde->kne", x, w)
    return [y, jnp.sum(y, axis=(1, 2))]

  def model_split(x, w):        # the contraction split over "model": a psum inside
    w = gshard.shard(w, P("stage", "model", None))
    x = gshard.shard(x, P("stage", None, "model"))
    y = jnp.einsum("knd,kde->kne", x, w)
    return [jnp.tanh(y), jnp.max(y, axis=(1, 2))]

  def over_stages(x, w):        # not row-local: every row needs every stage's x
    total = jnp.sum(x, axis=0, keepdims=True)
    return [x + total, jnp.sum(x, axis=(1, 2))]

  def nan_where_negative(x, w):
    y = jnp.where(x < 0, jnp.nan, jnp.sqrt(jnp.abs(x)))
    return [y, jnp.min(y, axis=(1, 2))]

  sets = {"local": [zero, matmul, nan_where_negative],
          "model": [zero, model_split, matmul],
          "stages": [matmul, over_stages]}
  return sets[kind]


def _run(branches, index, x, w):
  return stage_switch(index, branches, [x, w], [0, 0])


MESHES = {"local": [((4,), ("stage",)), ((2, 4), ("data", "stage")), ((8,), ("stage",))],
          "model": [((4, 2), ("stage", "model")), ((2, 4), ("stage", "model"))],
          "stages": [((4,), ("stage",)), ((2, 4), ("data", "stage"))]}


@settings(max_examples=int(os.environ.get("GSHARD_SWITCH_EXAMPLES", "6")))
@given(kind=st.sampled_from(sorted(MESHES)), which=st.integers(0, 2), rows=st.sampled_from([1, 2]),
       seed=st.integers(0, 2 ** 16), dtype=st.sampled_from(["float32", "bfloat16"]))
@example(kind="stages", which=0, rows=1, seed=1, dtype="float32")      # the stage-crossing fallback
@example(kind="model", which=0, rows=1, seed=2, dtype="bfloat16")      # collectives in a branch
@example(kind="local", which=1, rows=2, seed=3, dtype="float32")       # K in blocks of 2 rows
@example(kind="local", which=2, rows=1, seed=4, dtype="float32")       # one row per device, NaNs
def test_switch_equals_its_one_device_definition(kind, which, rows, seed, dtype):
  shape, names = MESHES[kind][which % len(MESHES[kind])]
  stages = dict(zip(names, shape))["stage"]
  k = stages * rows                          # rows > 1: blocks of rows, the fallback
  branches = _branches(kind)
  rng = np.random.default_rng(seed)
  index = jnp.asarray(rng.integers(0, len(branches), size=k), jnp.int32)
  x = jnp.asarray(rng.uniform(-1, 1, (k, N, D)), dtype)
  w = jnp.asarray(rng.uniform(-1, 1, (k, D, D)) / 4, dtype)
  want = jax.jit(lambda i, x, w: _run(branches, i, x, w))(index, x, w)
  step = gshard.partition(lambda i, x, w: _run(branches, i, x, w), mesh(shape, names),
                          in_specs=(P("stage"), P("stage"), P("stage")))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", SwitchWarning)
    got = step(index, x, w)
  crossed = [c for c in caught if issubclass(c.category, SwitchWarning)]
  assert bool(crossed) == (kind == "stages" and rows == 1), [str(c.message) for c in crossed]
  u = 2.0 ** -24 if dtype == "float32" else 2.0 ** -8
  tol = 16 * 4 * u * 16
  for g, e in zip(got, want):
    g, e = np.asarray(g, np.float64), np.asarray(e, np.float64)
    assert g.dtype == e.dtype and g.shape == e.shape
    np.testing.assert_array_equal(np.isnan(g), np.isnan(e))
    np.testing.assert_allclose(np.nan_to_num(g), np.nan_to_num(e), rtol=0,
                               atol=tol * max(1.0, float(np.nanmax(np.abs(e)))))
  low = step.lower(index, x, w)
  if rows == 1 and kind != "stages":          # one branch per device, nothing moved
    assert not any(set(c.axes) & {"stage"} for c in low.collectives()), low.explain()


def test_each_device_runs_one_branch():
  # a branch whose result is NaN everywhere must not reach a stage that did
  # not choose it, and the per-device program holds a switch on a scalar
  def poison(x, w):
    return [x * jnp.nan, jnp.zeros(x.shape[:1], x.dtype)]

  def keep(x, w):
    return [x, jnp.ones(x.shape[:1], x.dtype)]
  index = jnp.array([1, 0, 1, 1], jnp.int32)
  x = jnp.ones((4, N, D))
  step = gshard.partition(lambda i, x, w: _run([poison, keep], i, x, w),
                          mesh((4,), ("stage",)), in_specs=(P("stage"), P("stage"), P("stage")))
  y, s = step(index, x, x[:, :1, :1])
  y = np.asarray(y)
  assert np.isnan(y[1]).all() and not np.isnan(y[[0, 2, 3]]).any()
  np.testing.assert_array_equal(np.asarray(s), [1, 0, 1, 1])
  conds = [e for e in step.lower(index, x, x[:, :1, :1]).per_device_jaxpr().eqns
           if e.primitive.name == "cond"]
  assert len(conds) == 1 and conds[0].invars[0].aval.shape == ()


def test_vmap_of_the_switch_is_its_definition():
  index = jnp.array([2, 0, 1, 1], jnp.int32)
  xs = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, (3, 4, N, D)), jnp.float32)
  w = jnp.ones((4, D, D)) / D
  branches = _branches("local")
  got = jax.vmap(lambda x: _run(branches, index, x, w))(xs)
  for i in range(3):
    for g, e in zip(got, _run(branches, index, xs[i], w)):
      np.testing.assert_array_equal(np.asarray(g[i]), np.asarray(e))


@pytest.mark.parametrize("k", [4])
def test_branches_must_agree(k):
  with pytest.raises(AssertionError, match="stage_switch branches"):
    stage_switch(jnp.zeros(k, jnp.int32), [lambda x: [x], lambda x: [x[:, :1]]],
                 [jnp.ones((k, 2))], [0])
