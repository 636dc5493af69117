"""The pipeline family: ``pipeline_shift`` (``gshard.pipeline.shift``), and the
``name`` primitive of ``jax.ad_checkpoint.checkpoint_name``.

``pipeline_shift`` moves rows of one dim; every dim keeps its factor, the
shifted one too, so a split of the shifted dim passes through and the
partition rule moves rows between devices (one ``ppermute``) instead of
gathering. It is linear in its one operand: a pending sum passes.

``name`` (``checkpoint_name``, which remat policies such as
``save_only_these_names`` read) is an identity: a linear elementwise rule,
partitioned by the generic rule.
"""

from __future__ import annotations

from gshard.spmd.partition import pipeline as partition
from gshard.spmd.registry import register
from gshard.spmd.rules._core import FactorRule, factor_rule, letters, shapes
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
