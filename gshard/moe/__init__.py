"""Mixture of experts, GShard style: top-2 / top-1 gating and the MoE layer.

Public API::

  gshard.moe.top2_gating / top1_gating   logits [G,S,E] -> combine, dispatch, aux loss
  gshard.moe.expert_capacity             C from S, E, capacity factor
  gshard.moe.moe_init / moe_apply        the layer, plain pytrees of params
  gshard.moe.moe_specs                   PartitionSpecs of the params
"""

from gshard.moe.gating import (GatingMetrics, GatingResult, expert_capacity,
                               top1_gating, top2_gating)
from gshard.moe.layer import moe_apply, moe_init, moe_specs

__all__ = ["GatingMetrics", "GatingResult", "expert_capacity", "moe_apply", "moe_init",
           "moe_specs", "top1_gating", "top2_gating"]
