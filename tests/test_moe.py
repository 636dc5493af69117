"""The MoE layer and an MoE Transformer under gshard.partition.

Partitioned equals unpartitioned (forward, gradients, a train step) on a 1-D
expert mesh and on 2-D expert x model meshes, with random second-expert
routing from a fixed key passed as an argument. Structure: the train step of
one layer has exactly four all-to-alls (dispatch and combine, forward and
backward), each of the analytic (n-1)/n x the local dispatched tensor
[E, G/n, C, M]; no all-gather at all (tokens, dispatch masks, expert weights),
in gshard's records and in XLA's optimized HLO.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import gshard
from examples import models as M
from examples import moe_transformer as MT
from gshard.moe import expert_capacity, moe_apply, moe_init, moe_specs
from helpers_numerics import AdamSpec, assert_close_to_f64, f64_run
from helpers_partition import hlo_collectives, mesh

M_, H_ = 16, 32          # d_model, expert hidden


def _layer_step(model_axis=None, num_selected=2, capacity_factor=2.0, expert_axis="expert"):
  """value_and_grad of a loss of one MoE layer, w.r.t. params and tokens."""
  def loss(params, x, key):
    y, aux, metrics = moe_apply(params, x, expert_axis=expert_axis,
                                model_axis=model_axis, key=key,
                                num_selected=num_selected,
                                capacity_factor=capacity_factor)
    return jnp.sum((x + y) ** 2) + 0.1 * aux, metrics
  return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


def _inputs(groups, group_size, experts, seed=0):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  params = moe_init(k1, M_, H_, experts)
  x = jax.random.normal(k2, (groups, group_size, M_))
  return params, x, jax.random.PRNGKey(seed + 1)


MESHES = [((8,), ("expert",), None), ((4, 2), ("expert", "model"), "model"),
          ((2, 4), ("expert", "model"), "model")]


@pytest.mark.parametrize("shape,names,model_axis", MESHES)
@pytest.mark.parametrize("num_selected", [2, 1])
def test_layer_partitioned_equals_unpartitioned(shape, names, model_axis, num_selected):
  m = mesh(shape, names)
  step = _layer_step(model_axis, num_selected)
  params, x, key = _inputs(groups=8, group_size=16, experts=8)
  specs = (moe_specs("expert", model_axis), P("expert"), P())
  got = gshard.partition(step, m, in_specs=specs)(params, x, key)
  want = jax.jit(step)(params, x, key)
  # the loss sums G * S * M = 2048 squares: the longest reduction
  assert_close_to_f64(got, want, f64_run(jax.jit(step), params, x, key), n=x.size)
  # the same routing: (token, expert) assignments are counts, equal exactly; a
  # routed token has 1 to num_selected of them, a dropped one none
  (_, m_got), _ = got
  (_, m), _ = want
  np.testing.assert_array_equal(np.asarray(m_got.tokens_per_expert),
                                np.asarray(m.tokens_per_expert))
  tokens = x.shape[0] * x.shape[1]
  routed = (1 - float(m.dropped_fraction)) * tokens
  assigned = float(m.tokens_per_expert.sum())
  assert routed <= assigned <= num_selected * routed
  assert num_selected == 2 or assigned == routed
  assert routed >= tokens / 2, "capacity factor 2: most tokens find a slot"


def _analytic_all_to_all_bytes(experts, groups, capacity, n, itemsize=4):
  """(n-1)/n x the local dispatched tensor [E, G/n, C, M] (REFERENCES.md)."""
  return (n - 1) * experts * (groups // n) * capacity * M_ * itemsize // n


@pytest.mark.parametrize("groups,experts", [(8, 8), (16, 8), (8, 16)])
def test_one_layer_train_step_has_four_all_to_alls_of_analytic_size(groups, experts):
  m = mesh((8,), ("expert",))
  params, x, key = _inputs(groups, group_size=16, experts=experts)
  step = gshard.partition(_layer_step(), m,
                          in_specs=(moe_specs(), P("expert"), P()))
  lowered = step.lower(params, x, key)
  cols = lowered.collectives()
  a2a = [c for c in cols if c.kind == "all_to_all"]
  capacity = expert_capacity(16, experts, capacity_factor=2.0)
  want = _analytic_all_to_all_bytes(experts, groups, capacity, n=8)
  assert [c.bytes for c in a2a] == [want] * 4, lowered.explain()
  # dispatch and combine, forward and backward: a tensor of the [E, G, C, M]
  # volume (the backward may hold its dims in another order) moves between
  # split on its G dim and split on its E dim, twice each way
  def split_size(c, s):
    (dim,) = [i for i, d in enumerate(s.dims) if d == ("expert",)]
    return c.shape[dim]
  moves = sorted((split_size(c, c.src), split_size(c, c.dst)) for c in a2a)
  assert moves == sorted([(groups, experts)] * 2 + [(experts, groups)] * 2), moves
  assert all(sorted(c.shape) == sorted((experts, groups, capacity, M_)) for c in a2a)
  assert not [c for c in cols if c.kind == "all_gather"], lowered.explain()
  assert not lowered.fallbacks
  # everything else is small: the gating and aux-loss reductions and the
  # data-parallel sum of the replicated gating weights' gradient
  others = [c for c in cols if c.kind != "all_to_all"]
  assert {c.kind for c in others} <= {"psum"}
  assert sum(c.bytes for c in others) < sum(c.bytes for c in a2a)
  hlo = hlo_collectives(lowered.compile().as_text(), m)
  assert not [c for c in hlo if c.kind in ("all-gather", "collective-permute")], hlo
  hlo_a2a = [c for c in hlo if c.kind == "all-to-all"]
  assert hlo_a2a and all(c.axes == ("expert",) for c in hlo_a2a)
  # XLA may split or fuse them; the volume is the same
  local = experts * (groups // 8) * capacity * M_ * 4
  assert sum(c.nbytes for c in hlo_a2a) == 4 * local


@settings(max_examples=12, deadline=None)
@given(n=st.sampled_from([2, 4, 8]), groups_per=st.sampled_from([1, 2]),
       experts_per=st.sampled_from([1, 2]), group_size=st.sampled_from([8, 16]),
       capacity_factor=st.sampled_from([0.5, 1.0, 2.0, 4.0]))
def test_four_all_to_alls_whatever_the_sizes(n, groups_per, experts_per, group_size,
                                             capacity_factor):
  # The paper's annotations, any sizes: four all-to-alls of the analytic size,
  # nothing gathered. Where E*C equals the tokens per device (4 experts on 4
  # devices at capacity factor 2, say) the combine's gradient once came out
  # split on experts, then moved to groups (a fifth all-to-all, plus an
  # all-gather of the tokens' cotangent): computing it on groups, from the
  # expert output's copy the forward combine made, sends the same bytes at
  # that equation, and is what the gating's backward reads.
  groups, experts = n * groups_per, n * experts_per
  params, x, key = _inputs(groups, group_size, experts)
  step = gshard.partition(_layer_step(capacity_factor=capacity_factor),
                          mesh((n,), ("expert",)), in_specs=(moe_specs(), P("expert"), P()))
  lowered = step.lower(params, x, key)
  cols = lowered.collectives()
  capacity = expert_capacity(group_size, experts, capacity_factor=capacity_factor)
  want = _analytic_all_to_all_bytes(experts, groups, capacity, n)
  assert [c.bytes for c in cols if c.kind == "all_to_all"] == [want] * 4, lowered.explain()
  assert {c.kind for c in cols} <= {"all_to_all", "psum"}, lowered.explain()


def test_scanned_layers_four_all_to_alls_each():
  # Stacked MoE layers under lax.scan: the backward loop reads the expert
  # output as a residual, and once resharded it again every step (five
  # all-to-alls a layer). The residual is now stacked as the forward combine
  # already holds it: four, as unrolled; values unchanged.
  n, layers, group_size = 4, 3, 16
  keys = jax.random.split(jax.random.PRNGKey(0), layers)
  params = jax.tree.map(lambda *a: jnp.stack(a), *[moe_init(k, M_, H_, n) for k in keys])
  x = jax.random.normal(jax.random.PRNGKey(1), (n, group_size, M_))

  def loss(params, x, key):
    def layer(h, p):
      y, aux, _ = moe_apply(p, h, key=key, capacity_factor=1.0)
      return h + y, aux
    h, aux = jax.lax.scan(layer, x, params)
    return jnp.sum(h ** 2) + 0.1 * jnp.sum(aux)

  step = jax.value_and_grad(loss, argnums=(0, 1))
  specs = ({k: P(None, *s) for k, s in moe_specs().items()}, P("expert"), P())
  part = gshard.partition(step, mesh((n,), ("expert",)), in_specs=specs)
  key = jax.random.PRNGKey(2)
  lowered = part.lower(params, x, key)
  capacity = expert_capacity(group_size, n, capacity_factor=1.0)
  want = layers * _analytic_all_to_all_bytes(n, n, capacity, n)
  a2a = [c for c in lowered.collectives() if c.kind == "all_to_all"]
  assert [c.bytes for c in a2a] == [want] * 4, lowered.explain()
  assert not [c for c in lowered.collectives() if c.kind == "all_gather"], lowered.explain()
  # the sums run over a layer's G * S * M squares (its routing is exact)
  assert_close_to_f64(part(params, x, key), jax.jit(step)(params, x, key),
                      f64_run(jax.jit(step), params, x, key), n=x.size)


@settings(max_examples=10, deadline=None)
@given(shape=st.sampled_from([(2, 4), (4, 2), (2, 2), (2, 2, 2)]),
       order=st.sampled_from(["mesh", "reversed"]), experts_per=st.sampled_from([1, 2]),
       capacity_factor=st.sampled_from([1.0, 2.0]), seed=st.integers(0, 3))
def test_experts_over_a_tuple_of_mesh_axes_four_all_to_alls(shape, order, experts_per,
                                                          capacity_factor, seed):
  # expert_axis a tuple of mesh axes: one all-to-all over the tuple moves the
  # dispatched tensor, as over one axis of the same size. The combine's
  # backward once took the tuple one axis at a time, and its first step
  # (groups split on one axis only) gathered the tokens' cotangent: an
  # all-gather of 7 KiB and a fifth all-to-all on a (2, 4) mesh.
  names = ("a", "b", "c")[:len(shape)]
  axes = names if order == "mesh" else names[::-1]
  n = int(np.prod(shape))
  groups, experts = n, n * experts_per
  params, x, key = _inputs(groups, 16, experts, seed=seed)
  m = mesh(shape, names)
  step = _layer_step(capacity_factor=capacity_factor, expert_axis=axes)
  part = gshard.partition(step, m, in_specs=(moe_specs(axes), P(axes), P()))
  lowered = part.lower(params, x, key)
  cols = lowered.collectives()
  capacity = expert_capacity(16, experts, capacity_factor=capacity_factor)
  want = _analytic_all_to_all_bytes(experts, groups, capacity, n)
  assert [(c.kind, c.bytes) for c in cols if c.kind != "psum"] == \
      [("all_to_all", want)] * 4, lowered.explain()
  got, ref = part(params, x, key), jax.jit(step)(params, x, key)
  assert_close_to_f64(got, ref, f64_run(jax.jit(step), params, x, key), n=x.size)


@pytest.mark.parametrize("shape", [(4, 2), (2, 4)])
def test_two_d_mesh_all_to_all_over_expert_psum_over_model(shape):
  m = mesh(shape, ("expert", "model"))
  n, n_model = shape
  params, x, key = _inputs(groups=8, group_size=16, experts=8)
  step = gshard.partition(_layer_step("model"), m,
                          in_specs=(moe_specs("expert", "model"), P("expert"), P()))
  lowered = step.lower(params, x, key)
  cols = lowered.collectives()
  capacity = expert_capacity(16, 8, capacity_factor=2.0)
  a2a = [c for c in cols if c.kind == "all_to_all"]
  assert [(c.axes, c.bytes) for c in a2a] == [
      (("expert",), _analytic_all_to_all_bytes(8, 8, capacity, n))] * 4
  assert not [c for c in cols if c.kind == "all_gather"], lowered.explain()
  # H split over model: the second expert matmul (forward) and the input
  # gradient of the first (backward) are partial sums over model, one
  # all-reduce each of the local [E/n, G, C, M] block
  on_model = [c for c in cols if "model" in c.axes]
  block = (8 // n) * 8 * capacity * M_ * 4
  assert [(c.kind, c.bytes) for c in on_model] == [
      ("psum", 2 * (n_model - 1) * block // n_model)] * 2, lowered.explain()


# -- the MoE Transformer of examples/moe_transformer.py -----------------------------

SMALL = dict(vocab=64, d_model=32, n_heads=4, n_layers=2, d_ff=64, d_expert=32)


# Adam, as examples/moe_transformer.py trains: where (params, opt_state, loss,
# extra) keeps its moments, and its hyperparameters (helpers_numerics derives
# the parameters' bound through Adam's update, which amplifies gradient noise
# near g = 0)
ADAM = optax.adam(3e-3)
ADAM_SPEC = AdamSpec(params="[0]", mu="[1][0].mu", nu="[1][0].nu", count="[1][0].count",
                     lr=3e-3)
BATCH, SEQ = 8, 8


def _transformer(shape, names):
  model_axis = "model" if len(shape) == 2 else None
  # jitted: eagerly, each of init's random draws would compile a program of its own
  params = jax.jit(functools.partial(MT.init, num_experts=shape[0], **SMALL))(
      jax.random.PRNGKey(0))
  step = MT.make_step(ADAM, model_axis=model_axis)
  specs = (MT.specs(params, "expert", model_axis), None, P("expert"), P("expert"), P())
  tokens, targets = M.synthetic_batch(jax.random.PRNGKey(1), BATCH, SEQ, SMALL["vocab"])
  args = (params, ADAM.init(params), tokens, targets, jax.random.PRNGKey(2))
  return step, specs, args


@pytest.mark.parametrize("shape,names", [((8,), ("expert",)),
                                         ((4, 2), ("expert", "model")),
                                         ((2, 4), ("expert", "model"))])
def test_moe_transformer_train_step_partitioned_equals_unpartitioned(shape, names):
  step, specs, args = _transformer(shape, names)
  part = gshard.partition(step, mesh(shape, names), in_specs=specs)
  ref, exact = jax.jit(step), jax.jit(step)        # exact: traced in f64
  state = args[:2]
  for i in range(2):        # two Adam steps, a new routing key each
    batch = (*args[2:4], jax.random.PRNGKey(10 + i))
    out = part(*state, *batch)
    want = ref(*jax.tree.map(np.asarray, state), *batch)
    # from the same input state; the longest sum is the tokens' (or vocabulary's)
    assert_close_to_f64(out, want, f64_run(exact, *state, *batch), n=BATCH * SEQ,
                        old=state, adam=ADAM_SPEC, what=f"step {i}: ")
    state = out[:2]
  lowered = part.lower(*args)
  cols = lowered.collectives()
  # layer 1 is the MoE: four all-to-alls over expert (the embedding lookup
  # may move its table over model by one more)
  a2a = [c for c in cols if c.kind == "all_to_all" and c.axes == ("expert",)]
  assert len(a2a) == 4, lowered.explain()
  assert all(c.primitive == "gather" for c in cols
             if c.kind == "all_to_all" and c.axes != ("expert",)), lowered.explain()
  assert not lowered.fallbacks
  gathered = [c for c in cols if c.kind == "all_gather"
              and (c.primitive, c.role) != ("gather", "result 0")]    # the lookup's
  assert not gathered, lowered.explain()


def test_moe_apply_errors():
  # shapes only (jax.eval_shape): the checks run at trace time, nothing compiles
  params = jax.eval_shape(lambda: moe_init(jax.random.PRNGKey(0), 8, 16, 4))

  def apply(x, **kw):
    return jax.eval_shape(lambda p, x: moe_apply(p, x, **kw), params, x)
  with pytest.raises(ValueError, match=r"x must be \[G, S, M\].*got shape \(4, 8\)"):
    apply(jax.ShapeDtypeStruct((4, 8), jnp.float32), second_policy="all")
  with pytest.raises(ValueError, match="num_selected must be 1 or 2, got 3"):
    apply(jax.ShapeDtypeStruct((2, 4, 8), jnp.float32), num_selected=3)
  y, aux, _ = apply(jax.ShapeDtypeStruct((2, 4, 8), jnp.float32), second_policy="all")
  assert y.shape == (2, 4, 8) and aux.shape == ()
  # experts (wg against wi, wo) and the hidden size (wi against wo) must agree
  x = jax.ShapeDtypeStruct((2, 4, 8), jnp.float32)
  other = jax.eval_shape(lambda: moe_init(jax.random.PRNGKey(0), 8, 12, 2))
  for name in ("wi", "wo"):
    bad = dict(params, **{name: other[name]})
    with pytest.raises(ValueError, match=r"disagree on the number of experts E or the hidden "
                       r"size H: wg \(8, 4\) is \[M, E\]"):
      jax.eval_shape(lambda p, x: moe_apply(p, x, second_policy="all"), bad, x)
  bad = dict(params, wi=jax.ShapeDtypeStruct((4, 8), jnp.float32))
  with pytest.raises(ValueError, match=r"wi \[E, M, H\], wo \[E, H, M\], got .*wi \(4, 8\)"):
    jax.eval_shape(lambda p, x: moe_apply(p, x, second_policy="all"), bad, x)


def test_moe_apply_bf16_activations():
  # jitted: eagerly, every operation of the layer would compile a program of its own
  apply = jax.jit(lambda p, x: moe_apply(p, x, second_policy="all"))
  f32 = jax.jit(moe_init, static_argnums=(1, 2, 3))(jax.random.PRNGKey(0), 8, 16, 4)
  params = jax.tree.map(lambda w: w.astype(jnp.bfloat16), f32)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 8)).astype(jnp.bfloat16)
  y, aux, _ = apply(params, x)
  assert y.dtype == jnp.bfloat16 and aux.dtype == jnp.float32
  f32 = jax.tree.map(lambda w: w.astype(jnp.float32), params)
  y32, _, _ = apply(f32, x.astype(jnp.float32))
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y32), atol=0.1)
