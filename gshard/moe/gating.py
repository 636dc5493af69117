"""GShard top-2 gating (Algorithm 1 of arXiv 2006.16668) and Switch top-1 gating.

Tokens come in ``G`` groups of ``S`` tokens; each group routes its tokens to
``E`` experts independently, with a per-group, per-expert buffer of ``C``
slots (the expert capacity). Everything is vectorised (one-hot masks,
cumulative sums over S, einsum-style products): no Python loop over tokens,
so the gating partitions like any other part of the program (split on G).

Conventions shared by both gatings:

- The softmax runs in float32 whatever the logits' dtype; combine weights are
  float32, dispatch masks bool. Cast them to the activation dtype for the
  dispatch/combine einsums.
- Ties in the top choice go to the lowest expert index (as ``argmax``), and so
  do ties among the remaining experts for the second choice.
- Expert buffers fill in token order (position = exclusive cumulative sum of
  the one-hot choice over S). A token whose position is ``>= C`` is dropped for
  that expert: zero combine weight, no dispatch; it still reaches the output
  through the layer's residual connection.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

SecondPolicy = Literal["all", "random", "sampling"]
AuxScaling = Literal["paper", "lingvo"]
_EPS = 1e-9


class GatingMetrics(NamedTuple):
  """Routing statistics (no gradient).

  Attributes:
    dropped_fraction: f32[], fraction of the G*S tokens routed to no expert at
      all (every choice over capacity or, for the second choice, not routed):
      they pass only through the residual connection.
    first_dropped_fraction: f32[], fraction of tokens whose top-1 expert was
      full (over capacity).
    tokens_per_expert: f32[E], (token, expert) assignments that got a buffer
      slot, summed over groups. Its sum is at most ``k * G * S``.
  """

  dropped_fraction: jax.Array
  first_dropped_fraction: jax.Array
  tokens_per_expert: jax.Array


class GatingResult(NamedTuple):
  """What a gating returns for logits f32[G, S, E] and capacity C.

  Attributes:
    combine_weights: f32[G, S, E, C], the gate of token s for expert e at
      buffer slot c; zero where the token is not there.
    dispatch_mask: bool[G, S, E, C], True where token s sits in slot c of
      expert e. Each (g, e, c) holds at most one token.
    aux_loss: f32[], the load-balancing loss (see :func:`top2_gating`).
    metrics: :class:`GatingMetrics`.
  """

  combine_weights: jax.Array
  dispatch_mask: jax.Array
  aux_loss: jax.Array
  metrics: GatingMetrics


def expert_capacity(group_size: int, num_experts: int, *, capacity_factor: float = 1.0,
                    min_capacity: int = 4, k: int = 2) -> int:
  """Buffer slots per group and expert: ``ceil(capacity_factor * k * S / E)``.

  Raised to ``min_capacity`` (so small groups still route) and capped at the
  group size ``S`` (an expert never receives more than S tokens of a group).

  Example::

    expert_capacity(1024, 64)                       # ceil(2*1024/64) = 32
    expert_capacity(16, 8, capacity_factor=0.5)     # ceil(2.0) = 2 -> min 4
    expert_capacity(2, 8)                           # min 4, capped at S = 2
  """
  if isinstance(capacity_factor, jax.core.Tracer) or isinstance(min_capacity, jax.core.Tracer):
    raise TypeError(
        "capacity_factor and min_capacity must be Python numbers, not traced values: the "
        "capacity is a buffer size, fixed when the program is traced. Pass them as "
        "static arguments (e.g. functools.partial, or jax.jit's static_argnames).")
  if not (isinstance(capacity_factor, (int, float, np.number))
          and math.isfinite(capacity_factor) and capacity_factor > 0):
    raise ValueError(f"capacity_factor must be a positive finite number, got "
                     f"{capacity_factor!r}. Use e.g. capacity_factor=1.0 (or 1.25 to "
                     "drop fewer tokens).")
  if min_capacity < 1:
    raise ValueError(f"min_capacity must be >= 1, got {min_capacity}.")
  if num_experts < 1 or group_size < 0:
    raise ValueError(f"expert_capacity: needs num_experts >= 1 and group_size >= 0, got "
                     f"group_size={group_size}, num_experts={num_experts}.")
  # A tiny tolerance so 2.0000000001 (float noise in capacity_factor*k*S/E) is 2.
  c = math.ceil(capacity_factor * k * group_size / num_experts - 1e-9)
  return int(min(max(c, min_capacity), group_size))


def _check_logits(name: str, logits, k: int) -> tuple[int, int, int]:
  if jnp.ndim(logits) != 3:
    raise ValueError(
        f"{name}: logits must be [G, S, E] (groups, tokens per group, experts), got "
        f"shape {tuple(jnp.shape(logits))}. Reshape tokens to [G, S, E] first.")
  g, s, e = jnp.shape(logits)
  if e < k:
    raise ValueError(f"{name}: needs at least {k} experts, logits have E={e}.")
  return g, s, e


def _exclusive_cumsum(mask):
  """Position of each token in its expert's buffer: mask [G,S,E] -> [G,S,E]."""
  return jnp.cumsum(mask, axis=1) - mask


def _slots(gate, mask, position, capacity: int):
  """One choice's contribution: (combine [G,S,E,C], dispatch [G,S,E,C] f32).

  gate [G,S], mask [G,S,E] (one-hot, already cut to capacity), position [G,S,E].
  """
  slot = jnp.sum(position * mask, axis=-1).astype(jnp.int32)           # [G,S]
  slot_1h = jax.nn.one_hot(slot, capacity, dtype=jnp.float32)           # [G,S,C]
  dispatch = mask[..., None] * slot_1h[:, :, None, :]                   # [G,S,E,C]
  return gate[..., None, None] * dispatch, dispatch


def _aux_loss(gates, first_mask, scaling: AuxScaling):
  """(1/E) sum_e (c_e/S) m_e per group, mean over groups; ``lingvo``: times E^2.

  c_e counts the tokens whose first choice is e (before capacity), m_e is the
  mean gate of e over the group. Only m_e carries a gradient.
  """
  num_experts = gates.shape[-1]
  density = jnp.mean(first_mask, axis=1)          # c_e / S      [G, E]
  density_proxy = jnp.mean(gates, axis=1)         # m_e          [G, E]
  loss = jnp.mean(density * density_proxy)        # mean over G and E = (1/E) sum_e
  if scaling == "lingvo":
    return loss * (num_experts * num_experts)
  if scaling != "paper":
    raise ValueError(f"aux_loss_scaling must be 'paper' or 'lingvo', got {scaling!r}.")
  return loss


def _metrics(masks, first_kept, first_routed) -> GatingMetrics:
  routed = sum(masks)                                     # [G,S,E] after capacity
  got_none = jnp.sum(routed, axis=-1) == 0                # [G,S]
  first_lost = jnp.sum(first_routed - first_kept, axis=-1)
  return jax.lax.stop_gradient(GatingMetrics(
      dropped_fraction=jnp.mean(got_none.astype(jnp.float32)),
      first_dropped_fraction=jnp.mean(first_lost),
      tokens_per_expert=jnp.sum(routed, axis=(0, 1))))


def top2_gating(logits, *, capacity_factor: float = 1.0, min_capacity: int = 4,
                second_policy: SecondPolicy = "random", key=None,
                aux_loss_scaling: AuxScaling = "paper") -> GatingResult:
  """GShard's top-2 gating with expert capacity (Algorithm 1), vectorised.

  For each group: ``gates = softmax(logits)`` in float32; ``e1`` is the top
  expert, ``e2`` the top of the others; ``g1, g2 = g1/(g1+g2+eps),
  g2/(g1+g2+eps)`` (eps 1e-9), computed before any routing decision, so
  ``g1`` keeps that value even when ``e2`` is not used. First choices fill the
  expert buffers in token order; second choices are placed after *all* first
  choices of the group (offset by the number of first choices the expert
  kept); a position ``>= C`` is dropped (zero weight).

  Args:
    logits: [G, S, E] router logits (any float dtype).
    capacity_factor: C = ceil(capacity_factor * 2 * S / E) ...
    min_capacity: ... raised to at least this, then capped at S
      (:func:`expert_capacity`).
    second_policy: how the second expert is used.
      ``"all"``: always (subject to capacity).
      ``"random"`` (the paper's default): keep e2 only if ``2 * g2 > u`` with
      ``u = jax.random.uniform(key, (G, S), float32)`` and g2 normalised; a
      token not kept does not take a slot.
      ``"sampling"``: e2 is *sampled* from the gates renormalised over the
      experts other than e1 (Gumbel-max with
      ``jax.random.gumbel(key, (G, S, E), float32)``: e2 = argmax over e != e1
      of ``log(gate_e) + gumbel_e``), then always used.
    key: a jax PRNG key; required for ``"random"`` and ``"sampling"``.
    aux_loss_scaling: ``"paper"``: per group ``(1/E) * sum_e (c_e/S) * m_e``
      (c_e = tokens whose first choice is e, before capacity; m_e = mean gate
      of e), averaged over groups; a perfectly uniform router gives 1/E^2.
      ``"lingvo"``: the same times E^2 (Lingvo's and Switch's
      ``E * sum_e f_e P_e``; uniform gives 1).

  Returns:
    A :class:`GatingResult`: combine_weights f32[G,S,E,C], dispatch_mask
    bool[G,S,E,C], aux_loss f32[], metrics.

  Example::

    logits = jnp.einsum("GSM,ME->GSE", x, wg)
    r = top2_gating(logits, capacity_factor=2.0, key=jax.random.key(0))
    dispatched = jnp.einsum("GSEC,GSM->EGCM", r.dispatch_mask.astype(x.dtype), x)
  """
  num_groups, group_size, num_experts = _check_logits("top2_gating", logits, 2)
  if second_policy not in ("all", "random", "sampling"):
    raise ValueError(f"top2_gating: second_policy must be 'all', 'random' or "
                     f"'sampling', got {second_policy!r}.")
  if second_policy != "all" and key is None:
    raise ValueError(f"top2_gating: second_policy={second_policy!r} draws random "
                     "numbers; pass key=jax.random.key(...) (a fixed key makes routing "
                     "reproducible), or use second_policy='all'.")
  capacity = expert_capacity(group_size, num_experts, capacity_factor=capacity_factor,
                             min_capacity=min_capacity, k=2)
  gates = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)          # [G,S,E]
  mask1 = jax.nn.one_hot(jnp.argmax(gates, axis=-1), num_experts, dtype=jnp.float32)
  if second_policy == "sampling":
    noise = jax.random.gumbel(key, (num_groups, group_size, num_experts), jnp.float32)
    tiny = jnp.finfo(jnp.float32).tiny
    scores = jnp.where(mask1 > 0, -jnp.inf, jnp.log(jnp.maximum(gates, tiny)) + noise)
  else:
    scores = jnp.where(mask1 > 0, -1.0, gates)     # gates >= 0: e1 never wins again
  mask2 = jax.nn.one_hot(jnp.argmax(scores, axis=-1), num_experts, dtype=jnp.float32)
  g1 = jnp.sum(gates * mask1, axis=-1)
  g2 = jnp.sum(gates * mask2, axis=-1)
  denom = g1 + g2 + _EPS
  g1, g2 = g1 / denom, g2 / denom
  if second_policy == "random":
    u = jax.random.uniform(key, (num_groups, group_size), jnp.float32)
    mask2 = mask2 * (2.0 * g2 > u).astype(jnp.float32)[..., None]
  aux = _aux_loss(gates, mask1, aux_loss_scaling)
  routed1 = mask1
  pos1 = _exclusive_cumsum(mask1)
  mask1 = mask1 * (pos1 < capacity)
  kept1 = jnp.sum(mask1, axis=1, keepdims=True)                        # [G,1,E]
  pos2 = _exclusive_cumsum(mask2) + kept1
  mask2 = mask2 * (pos2 < capacity)
  c1, d1 = _slots(g1, mask1, pos1, capacity)
  c2, d2 = _slots(g2, mask2, pos2, capacity)
  return GatingResult(combine_weights=c1 + c2, dispatch_mask=(d1 + d2) > 0,
                      aux_loss=aux, metrics=_metrics([mask1, mask2], mask1, routed1))


def top1_gating(logits, *, capacity_factor: float = 1.0, min_capacity: int = 4,
                second_policy: SecondPolicy | None = None, key=None,
                aux_loss_scaling: AuxScaling = "paper") -> GatingResult:
  """Switch Transformer top-1 gating, with the interface of :func:`top2_gating`.

  ``e1 = argmax(softmax(logits))``; the combine weight is the gate ``g1``
  itself (not renormalised, so the router gets a gradient); buffers fill in
  token order; positions ``>= C`` are dropped, with
  ``C = ceil(capacity_factor * S / E)`` raised to ``min_capacity`` and capped
  at S. The aux loss is as in :func:`top2_gating` (``"lingvo"`` scaling is
  Switch's ``E * sum_e f_e P_e``).

  Args:
    logits: [G, S, E] router logits.
    capacity_factor, min_capacity, aux_loss_scaling: as for top2_gating.
    second_policy, key: accepted for interface compatibility and ignored (top-1
      routing draws no random numbers).

  Returns:
    A :class:`GatingResult` with C = :func:`expert_capacity` (k=1).
  """
  del second_policy, key
  _, group_size, num_experts = _check_logits("top1_gating", logits, 1)
  capacity = expert_capacity(group_size, num_experts, capacity_factor=capacity_factor,
                             min_capacity=min_capacity, k=1)
  gates = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  mask1 = jax.nn.one_hot(jnp.argmax(gates, axis=-1), num_experts, dtype=jnp.float32)
  g1 = jnp.sum(gates * mask1, axis=-1)
  aux = _aux_loss(gates, mask1, aux_loss_scaling)
  routed1 = mask1
  pos1 = _exclusive_cumsum(mask1)
  mask1 = mask1 * (pos1 < capacity)
  c1, d1 = _slots(g1, mask1, pos1, capacity)
  return GatingResult(combine_weights=c1, dispatch_mask=d1 > 0, aux_loss=aux,
                      metrics=_metrics([mask1], mask1, routed1))
