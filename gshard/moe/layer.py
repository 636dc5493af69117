"""The GShard MoE feed-forward layer: plain-pytree params, the paper's einsums.

Shapes (capitals as in the paper): G groups of S tokens of width M; E experts
with hidden width H; C buffer slots per group and expert.

    logits     GSM,ME->GSE       gates, computed where the tokens are (G split)
    dispatch   GSEC,GSM->EGCM    G split -> E split: the first all-to-all
    expert     EGCM,EMH->EGCH    local: each device runs its own experts
               EGCH,EHM->EGCM
    combine    GSEC,EGCM->GSM    E split -> G split: the second all-to-all

Annotations follow the paper: inputs split on G, gating weights replicated,
the dispatched tensor and the expert weights split on E over ``expert_axis``
(optionally H over ``model_axis`` on a 2-D mesh). Outside gshard they are
identities, so the layer runs unchanged on one device.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gshard.annotate import replicate, shard, split
from gshard.moe.gating import top1_gating, top2_gating

_GATINGS = {1: top1_gating, 2: top2_gating}


def moe_init(key, d_model: int, d_hidden: int, num_experts: int, dtype=jnp.float32):
  """Parameters of one MoE layer, a dict of arrays.

  Returns:
    ``{"wg": [M, E], "wi": [E, M, H], "wo": [E, H, M]}`` (gating weights, then
    each expert's two FFN matrices), scaled by 1/sqrt(fan-in).

  Example::

    params = moe_init(jax.random.key(0), d_model=64, d_hidden=256, num_experts=8)
  """
  kg, ki, ko = jax.random.split(key, 3)
  normal = lambda k, shape, fan_in: (jax.random.normal(k, shape, dtype)
                                     / jnp.sqrt(fan_in).astype(dtype))
  return {"wg": normal(kg, (d_model, num_experts), d_model),
          "wi": normal(ki, (num_experts, d_model, d_hidden), d_model),
          "wo": normal(ko, (num_experts, d_hidden, d_model), d_hidden)}


def moe_specs(expert_axis="expert", model_axis=None) -> dict[str, P]:
  """PartitionSpecs of :func:`moe_init`'s params, for ``in_specs``.

  The gating weights are replicated; expert weights split on E over
  ``expert_axis`` and, with ``model_axis``, on H over it.
  """
  return {"wg": P(), "wi": P(expert_axis, None, model_axis),
          "wo": P(expert_axis, model_axis, None)}


def moe_apply(params, x, *, expert_axis="expert", model_axis=None, num_selected: int = 2,
              capacity_factor: float = 1.0, min_capacity: int = 4,
              second_policy: str = "random", key=None,
              activation: Callable = jax.nn.relu, aux_loss_scaling: str = "paper"):
  """The MoE feed-forward layer on tokens in groups.

  Args:
    params: from :func:`moe_init`.
    x: [G, S, M] tokens; G is split over ``expert_axis`` (usually G = the
      number of devices on it, or a multiple).
    expert_axis: mesh axis (or tuple of axes) for G and E.
    model_axis: optional mesh axis splitting the expert hidden dim H.
    num_selected: 2 (GShard top-2, :func:`top2_gating`) or 1 (Switch).
    capacity_factor, min_capacity, second_policy, key, aux_loss_scaling: passed
      to the gating. ``second_policy="random"`` (the default) needs ``key``.
    activation: the expert FFN's nonlinearity.

  Returns:
    ``(y, aux_loss, metrics)``: y [G, S, M] in x's dtype (the layer output,
    without the residual: add ``x`` yourself, which is how dropped tokens pass
    through), the gating's aux loss f32[] and its :class:`GatingMetrics`.

  Example::

    y, aux, metrics = moe_apply(params, x, key=jax.random.key(step))
    x = x + y
  """
  if num_selected not in _GATINGS:
    raise ValueError(f"moe_apply: num_selected must be 1 or 2, got {num_selected}.")
  if jnp.ndim(x) != 3:
    raise ValueError(f"moe_apply: x must be [G, S, M] (groups, tokens per group, "
                     f"d_model), got shape {tuple(jnp.shape(x))}.")
  shapes = {k: tuple(jnp.shape(params[k])) for k in ("wg", "wi", "wo") if k in params}
  if len(shapes) < 3:
    raise ValueError(f"moe_apply: params must be moe_init's {{'wg', 'wi', 'wo'}}, got keys "
                     f"{sorted(params)}.")
  ranks = {"wg": 2, "wi": 3, "wo": 3}
  if any(len(shapes[k]) != r for k, r in ranks.items()):
    raise ValueError(f"moe_apply: params must be wg [M, E], wi [E, M, H], wo [E, H, M], got "
                     f"wg {shapes['wg']}, wi {shapes['wi']}, wo {shapes['wo']}. Build them "
                     "with moe_init(key, d_model, d_ff, num_experts).")
  m = jnp.shape(x)[-1]
  if shapes["wg"][0] != m or shapes["wi"][1] != m or shapes["wo"][2] != m:
    raise ValueError(f"moe_apply: x is {tuple(jnp.shape(x))} (d_model {m}) but params are "
                     f"for d_model {shapes['wg'][0]} (wg {shapes['wg']}, wi {shapes['wi']}, "
                     f"wo {shapes['wo']}). Make x's last dim d_model, or the params with "
                     f"moe_init(key, d_model={m}, ...).")
  e, h = shapes["wg"][1], shapes["wi"][2]
  if shapes["wi"][0] != e or shapes["wo"][0] != e or shapes["wo"][1] != h:
    raise ValueError(f"moe_apply: params disagree on the number of experts E or the hidden "
                     f"size H: wg {shapes['wg']} is [M, E], wi {shapes['wi']} [E, M, H], wo "
                     f"{shapes['wo']} [E, H, M] (E={e} from wg, H={h} from wi). Build the "
                     "three with one moe_init(key, d_model, d_ff, num_experts).")
  x = split(x, 0, expert_axis)
  wg = replicate(params["wg"])
  wi = shard(params["wi"], P(expert_axis, None, model_axis))
  wo = shard(params["wo"], P(expert_axis, model_axis, None))
  logits = jnp.einsum("GSM,ME->GSE", x, wg)
  gating = _GATINGS[num_selected](
      logits, capacity_factor=capacity_factor, min_capacity=min_capacity,
      second_policy=second_policy, key=key, aux_loss_scaling=aux_loss_scaling)
  dispatch = gating.dispatch_mask.astype(x.dtype)
  combine = gating.combine_weights.astype(x.dtype)
  # The paper's annotations: tokens split on G, the gate replicated, the
  # dispatched tensor split on E. Propagation and the partitioner find the
  # rest: dispatch and combine are one all-to-all each way (forward and
  # backward), the experts run where their weights are.
  dispatched = jnp.einsum("GSEC,GSM->EGCM", dispatch, x)
  if model_axis is not None:
    # With the expert FFN split over model too, each all-to-all is pinned
    # between two annotations (computed where the tokens are, then moved to
    # the experts; the way back mirrors it): propagation alone would compute
    # the combine weights' gradient on E and move it back (a fifth all-to-all).
    dispatched = split(dispatched, 1, expert_axis)
  dispatched = split(dispatched, 0, expert_axis)
  h = activation(jnp.einsum("EGCM,EMH->EGCH", dispatched, wi))
  if model_axis is not None:
    h = shard(h, P(expert_axis, None, None, model_axis))
  expert_out = jnp.einsum("EGCH,EHM->EGCM", h, wo)
  if model_axis is not None:
    expert_out = split(split(expert_out, 0, expert_axis), 1, expert_axis)
  y = jnp.einsum("GSEC,EGCM->GSM", combine, expert_out)
  if model_axis is not None:
    y = split(y, 0, expert_axis)
  return y, gating.aux_loss, gating.metrics


__all__ = ["moe_apply", "moe_init", "moe_specs"]
