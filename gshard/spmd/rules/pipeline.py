"""The pipeline family: ``pipeline_shift`` (``gshard.pipeline.shift``),
``stage_switch``, and the ``name`` primitive of ``jax.ad_checkpoint.checkpoint_name``.

``pipeline_shift`` moves rows of one dim; every dim keeps its factor, the
shifted one too, so a split of the shifted dim passes through and the
partition rule moves rows between devices (one ``ppermute``) instead of
gathering. It is linear in its one operand: a pending sum passes.

``stage_switch`` (``gshard.pipeline.switch``, a tick where pipeline stages
run different actions): each device runs its own branch; see its rule.

``name`` (``checkpoint_name``, which remat policies such as
``save_only_these_names`` read) is an identity: a linear elementwise rule,
partitioned by the generic rule.
"""

from __future__ import annotations

from gshard.spmd.partition import pipeline as partition
from gshard.spmd.registry import register
from gshard.spmd.rules._core import (IN, OUT, Constraint, FactorRule, OpRule, factor_rule,
                                     letters, shapes)
from gshard.spmd.rules.control import cond_rule
from gshard.spmd.rules.elementwise import register_elementwise


def shift_rule(in_avals, out_avals, *, axis, offset, circular) -> FactorRule:
  """``shift`` of ``f32[8,16]`` along dim 0: ``ab->ab linear=unary`` (the
  shifted dim ``a`` may stay split)."""
  del axis, offset, circular, out_avals
  (shape,) = shapes(in_avals)
  f = letters(len(shape))
  return factor_rule(f"{f}->{f}", [shape], [shape], linear="unary")


register("pipeline_shift", shift_rule, partition=partition.shift_rule)
register_elementwise("name", linear="unary")


def stage_switch_rule(in_avals, out_avals, *, branches, kdims) -> OpRule:
  """``stage_switch`` (``gshard/pipeline/switch.py``): ``cond``'s links (every
  branch's invars to the operands, its outvars to the results), and the
  index's one dim (the stages) linked to each result's K dim."""
  k = in_avals[0].shape[0]
  cons = list(cond_rule(in_avals, out_avals, branches=branches).constraints)
  for j, (a, d) in enumerate(zip(out_avals, kdims)):
    f = letters(len(a.shape))
    cons.append(Constraint(factor_rule(f"{f[d]}->{f}", [(k,)], [a.shape], linear="layout"),
                           (IN(0),), (OUT(j),)))
  return OpRule(tuple(cons))


register("stage_switch", stage_switch_rule, partition=partition.stage_switch_rule)
