"""GShard top-2 and Switch top-1 gating against a slow per-token reference.

The reference follows Algorithm 1 of the GShard paper literally: per group, a
Python loop over tokens in order with one counter per expert; first choices
first, then (in a second loop) second choices after all first choices; a
token whose counter position is >= C is dropped; gates normalised by their
sum. It is float64 numpy and shares no code with gshard. Ties: the lowest
expert index wins (as argmax), for the first and for the second choice.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gshard.moe import expert_capacity, top1_gating, top2_gating

EPS = 1e-9


# -- the reference ----------------------------------------------------------------

def _softmax(row):
  z = np.exp(row - row.max())
  return z / z.sum()


def _first_max(values, exclude=None):
  best = None
  for e, v in enumerate(values):
    if e == exclude:
      continue
    if best is None or v > values[best]:
      best = e
  return best


def reference_gating(logits, capacity, *, k=2, policy="all", u=None, gumbel=None,
                     scaling="paper"):
  """Algorithm 1, one token at a time. Returns combine, dispatch, aux, metrics."""
  logits = np.asarray(logits, np.float64)
  num_groups, group_size, num_experts = logits.shape
  combine = np.zeros((num_groups, group_size, num_experts, capacity))
  dispatch = np.zeros(combine.shape, bool)
  aux = 0.0
  first_dropped = 0
  for g in range(num_groups):
    counter = [0] * num_experts          # next free slot of each expert's buffer
    first_count = [0] * num_experts      # c_e: tokens whose first choice is e
    mean_gate = np.zeros(num_experts)    # m_e
    seconds = []
    for s in range(group_size):
      gates = _softmax(logits[g, s])
      mean_gate += gates / group_size
      e1 = _first_max(gates)
      first_count[e1] += 1
      if k == 1:
        g1 = gates[e1]
      else:
        if policy == "sampling":
          scores = [np.log(max(v, np.finfo(np.float32).tiny)) + gumbel[g, s, e]
                    for e, v in enumerate(gates)]
          e2 = _first_max(scores, exclude=e1)
        else:
          e2 = _first_max(gates, exclude=e1)
        denom = gates[e1] + gates[e2] + EPS
        g1, g2 = gates[e1] / denom, gates[e2] / denom
        seconds.append((s, e2, g2))
      if counter[e1] < capacity:
        combine[g, s, e1, counter[e1]] = g1
        dispatch[g, s, e1, counter[e1]] = True
      else:
        first_dropped += 1
      counter[e1] += 1
    for s, e2, g2 in seconds:             # after all first choices of the group
      if policy == "random" and not 2 * g2 > u[g, s]:
        continue
      if counter[e2] < capacity:
        combine[g, s, e2, counter[e2]] = g2
        dispatch[g, s, e2, counter[e2]] = True
      counter[e2] += 1
    aux += sum(first_count[e] / group_size * mean_gate[e]
               for e in range(num_experts)) / num_experts
  aux /= num_groups
  if scaling == "lingvo":
    aux *= num_experts ** 2
  tokens = num_groups * group_size
  metrics = {"dropped_fraction": np.mean(~dispatch.any(axis=(2, 3))),
             "first_dropped_fraction": first_dropped / tokens,
             "tokens_per_expert": dispatch.sum(axis=(0, 1, 3)).astype(np.float64)}
  return combine, dispatch, aux, metrics


# -- helpers ------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _jitted(k, capacity_factor, min_capacity, policy, scaling):
  """The gating and the random numbers it draws (one compilation per shape)."""
  fn = top2_gating if k == 2 else top1_gating

  def run(logits, key):
    out = fn(logits, capacity_factor=capacity_factor, min_capacity=min_capacity,
             second_policy=policy, key=key, aux_loss_scaling=scaling)
    u = jax.random.uniform(key, logits.shape[:2], jnp.float32)
    gumbel = jax.random.gumbel(key, logits.shape, jnp.float32)
    return out, u, gumbel
  return jax.jit(run)


def _check(logits, *, k=2, capacity_factor=1.0, min_capacity=4, policy="all", seed=0,
           scaling="paper"):
  num_groups, group_size, num_experts = logits.shape
  key = jax.random.PRNGKey(seed)
  got, u, gumbel = _jitted(k, capacity_factor, min_capacity, policy, scaling)(
      jnp.asarray(logits, jnp.float32), key)
  capacity = expert_capacity(group_size, num_experts, capacity_factor=capacity_factor,
                             min_capacity=min_capacity, k=k)
  u, gumbel = np.asarray(u), np.asarray(gumbel)
  if policy == "sampling":   # the float32 and float64 Gumbel-max must agree
    gates = np.apply_along_axis(_softmax, -1, np.asarray(logits, np.float64))
    scores = np.log(np.maximum(gates, np.finfo(np.float32).tiny)) + gumbel
    top = np.sort(scores, axis=-1)
    assume(np.all(np.abs(np.diff(top, axis=-1)) > 1e-4))
  combine, dispatch, aux, metrics = reference_gating(
      logits, capacity, k=k, policy=policy, u=u, gumbel=gumbel, scaling=scaling)
  assert got.combine_weights.shape == (num_groups, group_size, num_experts, capacity)
  assert got.combine_weights.dtype == jnp.float32
  assert got.dispatch_mask.dtype == jnp.bool_
  np.testing.assert_array_equal(np.asarray(got.dispatch_mask), dispatch)
  np.testing.assert_allclose(np.asarray(got.combine_weights), combine, rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(float(got.aux_loss), aux, rtol=1e-5, atol=1e-7)
  for name, want in metrics.items():
    np.testing.assert_allclose(np.asarray(getattr(got.metrics, name)), want, rtol=1e-6,
                               err_msg=name)
  return got


def _logits(draw, num_groups, group_size, num_experts):
  """Integer-valued logits (ties are frequent), or ones spaced by 1/4."""
  scale = draw(st.sampled_from([1.0, 0.25]))
  lo, hi = (-3, 3) if scale == 1.0 else (-16, 16)
  values = draw(st.lists(st.integers(lo, hi),
                         min_size=num_groups * group_size * num_experts,
                         max_size=num_groups * group_size * num_experts))
  return np.asarray(values, np.float32).reshape(num_groups, group_size,
                                                num_experts) * scale


# (S, E, capacity_factor, min_capacity): tiny groups, capacity 1, E = 2..8. A
# fixed set keeps XLA compilations few; hypothesis varies the logits.
CONFIGS = [(1, 2, 1.0, 4),     # C = 1: S = 1
           (2, 8, 1.0, 4),     # C = 2 (min 4 capped at S)
           (2, 3, 0.1, 1),     # C = 1
           (8, 4, 0.1, 1),     # C = 1
           (8, 5, 1.0, 1),     # C = ceil(3.2) = 4
           (16, 8, 0.5, 1),    # C = 2
           (16, 6, 1.0, 4),    # C = 6
           (12, 7, 2.0, 4)]    # C = ceil(6.86) = 7
NUM_GROUPS = 2


@st.composite
def gating_cases(draw):
  group_size, num_experts, capacity_factor, min_capacity = draw(st.sampled_from(CONFIGS))
  logits = _logits(draw, NUM_GROUPS, group_size, num_experts)
  return logits, capacity_factor, min_capacity


# -- top-2 ------------------------------------------------------------------------

@given(gating_cases(), st.sampled_from(["all", "random"]))
def test_top2_matches_algorithm_1(case, policy):
  logits, capacity_factor, min_capacity = case
  _check(logits, capacity_factor=capacity_factor, min_capacity=min_capacity,
         policy=policy)


@settings(max_examples=15)
@given(gating_cases(), st.integers(0, 3))
def test_top2_sampling_matches_reference_with_same_noise(case, seed):
  logits, capacity_factor, min_capacity = case
  _check(logits, capacity_factor=capacity_factor, min_capacity=min_capacity,
         policy="sampling", seed=seed)


@settings(max_examples=15)
@given(gating_cases())
def test_top1_matches_reference(case):
  logits, capacity_factor, min_capacity = case
  _check(logits, k=1, capacity_factor=capacity_factor, min_capacity=min_capacity)


def test_capacity_one_and_ties():
  # every token of the group prefers expert 0 equally, then expert 1
  logits = np.tile(np.asarray([2.0, 2.0, 0.0, 0.0], np.float32), (1, 5, 1))
  got = _check(logits, capacity_factor=0.1, min_capacity=1, policy="all")
  assert got.combine_weights.shape[-1] == 1
  # token 0 takes expert 0's only slot as its first choice, and expert 1's as its
  # second (second choices come after all first choices, but no other token
  # chose expert 1 first); everyone else is dropped
  dispatch = np.asarray(got.dispatch_mask)[0, :, :, 0]
  np.testing.assert_array_equal(dispatch[0], [True, True, False, False])
  assert not dispatch[1:].any()
  np.testing.assert_allclose(float(got.metrics.dropped_fraction), 4 / 5)


def test_second_choices_come_after_all_first_choices():
  # S=3, E=2, C=2: tokens 0 and 2 choose expert 0 first; token 1 chooses expert 1
  # first and expert 0 second. Token 1's second choice must not take a slot of
  # expert 0 before token 2's first choice does.
  logits = np.asarray([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]], np.float32)
  got = _check(logits, capacity_factor=0.5, min_capacity=2, policy="all")
  d = np.asarray(got.dispatch_mask)[0]
  assert d[0, 0, 0] and d[2, 0, 1]      # first choices fill expert 0: slots 0, 1
  assert not d[1, 0].any()               # token 1's second choice is dropped
  assert d[1, 1, 0] and d[0, 1, 1]       # expert 1: token 1 first, then token 0


def test_gates_normalised_and_softmax_in_float32():
  logits = jax.random.normal(jax.random.PRNGKey(3), (2, 8, 4)) * 3
  ref = top2_gating(logits, second_policy="all", capacity_factor=4.0)
  got = top2_gating(logits.astype(jnp.bfloat16), second_policy="all",
                    capacity_factor=4.0)
  assert got.combine_weights.dtype == jnp.float32
  # nothing dropped at this capacity: each token's two weights sum to 1
  np.testing.assert_allclose(np.asarray(ref.combine_weights.sum(axis=(2, 3))), 1.0,
                             rtol=1e-6)
  np.testing.assert_allclose(np.asarray(got.combine_weights.sum(axis=(2, 3))), 1.0,
                             rtol=1e-6)
  # bf16 logits differ only by their own rounding, not by a bf16 softmax
  exact = top2_gating(logits.astype(jnp.bfloat16).astype(jnp.float32),
                      second_policy="all", capacity_factor=4.0)
  np.testing.assert_array_equal(np.asarray(got.combine_weights),
                                np.asarray(exact.combine_weights))


def test_aux_loss_scaling_and_gradient():
  # each gating and gradient jitted: eagerly, every operation compiles on its own
  aux = jax.jit(lambda z, scaling: top2_gating(z, second_policy="all",
                                                aux_loss_scaling=scaling).aux_loss,
                static_argnums=1)
  logits = jnp.zeros((3, 16, 8))            # a uniform router
  paper, lingvo = aux(logits, "paper"), aux(logits, "lingvo")
  np.testing.assert_allclose(float(paper), 1 / 64, rtol=1e-6)
  np.testing.assert_allclose(float(lingvo), 1.0, rtol=1e-6)
  # The gradients, against the softmax's Jacobian written out in float64: with
  # p = softmax(z) per token, d/dz of sum_e a_e p_e is p * (a - sum_e a_e p_e).
  logits = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 4))
  p = np.exp(np.asarray(logits, np.float64))
  p /= p.sum(-1, keepdims=True)
  groups, tokens, experts = logits.shape

  def softmax_vjp(a):
    return p * (a - np.sum(a * p, axis=-1, keepdims=True))

  # aux = mean over (g, e) of density[g, e] * mean_s p[g, s, e]; the density (the
  # top-1 fraction) has no gradient: a[g, s, e] = density[g, e] / (G E S)
  grad = jax.jit(jax.grad(aux), static_argnums=1)(logits, "paper")
  density = np.eye(experts)[p.argmax(-1)].mean(axis=1, keepdims=True)
  np.testing.assert_allclose(np.asarray(grad),
                             softmax_vjp(np.broadcast_to(density, p.shape)
                                         / (groups * experts * tokens)),
                             rtol=1e-5, atol=1e-9)
  # top-1 weights are raw gates: the sum of the kept tokens' p[e1] has gradient
  # a = onehot(e1) through the softmax, a = 0 for a token over capacity (C = 2)
  def top1_total(z):
    result = top1_gating(z, min_capacity=1)
    return jnp.sum(result.combine_weights), result.dispatch_mask

  grad, dispatch = jax.jit(jax.grad(top1_total, has_aux=True))(logits)
  kept = np.asarray(dispatch).any(axis=(2, 3))
  assert 0 < kept.sum() < kept.size           # both kinds of token are covered
  a = np.eye(experts)[p.argmax(-1)] * kept[..., None]
  np.testing.assert_allclose(np.asarray(grad), softmax_vjp(a), rtol=1e-5, atol=1e-7)


def test_random_policy_is_reproducible_and_drops_weak_second_choices():
  logits = jnp.asarray(np.tile([6.0, 0.0, 0.0, 0.0], (1, 64, 1)), jnp.float32)
  key = jax.random.PRNGKey(7)
  a = top2_gating(logits, second_policy="random", key=key, capacity_factor=8.0)
  b = top2_gating(logits, second_policy="random", key=key, capacity_factor=8.0)
  np.testing.assert_array_equal(np.asarray(a.dispatch_mask), np.asarray(b.dispatch_mask))
  # g2 ~ 0.0025 after normalisation: P(2*g2 > u) = 0.5%, so almost all dropped
  seconds = np.asarray(a.dispatch_mask)[0, :, 1:].sum()
  assert seconds <= 3


@pytest.mark.parametrize("group_size,num_experts,factor,minimum,k,want", [
    (1024, 64, 1.0, 4, 2, 32), (16, 8, 0.5, 4, 2, 4), (2, 8, 1.0, 4, 2, 2),
    (10, 4, 1.0, 1, 2, 5), (10, 4, 1.0, 1, 1, 3), (12, 8, 1.5, 1, 2, 5),
    (7, 7, 0.1, 1, 2, 1)])
def test_expert_capacity(group_size, num_experts, factor, minimum, k, want):
  assert expert_capacity(group_size, num_experts, capacity_factor=factor,
                         min_capacity=minimum, k=k) == want
  assert want == min(group_size, max(minimum, math.ceil(factor * k * group_size
                                                        / num_experts - 1e-9)))


def test_errors():
  with pytest.raises(ValueError, match="second_policy='random' draws random numbers; "
                     "pass key="):
    top2_gating(jnp.zeros((1, 4, 4)))
  with pytest.raises(ValueError, match=r"logits must be \[G, S, E\].*got shape \(4, 4\)"):
    top2_gating(jnp.zeros((4, 4)), second_policy="all")
  with pytest.raises(ValueError, match="needs at least 2 experts, logits have E=1"):
    top2_gating(jnp.zeros((1, 4, 1)), second_policy="all")
  with pytest.raises(ValueError, match="second_policy must be 'all', 'random' or "
                     "'sampling', got 'top'"):
    top2_gating(jnp.zeros((1, 4, 4)), second_policy="top")
  with pytest.raises(ValueError, match="capacity_factor must be a positive finite number, got 0"):
    expert_capacity(4, 4, capacity_factor=0)
  for bad in (float("nan"), float("inf")):
    with pytest.raises(ValueError, match="capacity_factor must be a positive finite number"):
      expert_capacity(4, 4, capacity_factor=bad)
  with pytest.raises(ValueError, match="num_experts >= 1.*num_experts=0"):
    expert_capacity(16, 0)
  with pytest.raises(TypeError, match="capacity_factor and min_capacity must be Python numbers"):
    jax.jit(lambda c: top2_gating(jnp.zeros((1, 4, 4)), capacity_factor=c,
                                  second_policy="all"))(1.0)
