"""Debug prints and host callbacks (``jax.debug.print``, ``jax.debug.callback``,
``io_callback``, ``pure_callback``): they constrain no layout, and run once
per step on the whole values, as in the unpartitioned program
(``partition/callback.py``). ``jax.debug.inspect_array_sharding`` constrains
none either; its callback is given the layout the value has.
"""

from __future__ import annotations

from gshard.spmd.partition.callback import inspect_rule, once_rule
from gshard.spmd.registry import register
from gshard.spmd.rules._core import OpRule


def no_layout_rule(in_avals, out_avals, **params) -> OpRule:
  """No link between the operands (what is printed takes any layout)."""
  del in_avals, out_avals, params
  return OpRule(())


register("debug_print debug_callback io_callback pure_callback", no_layout_rule,
         partition=once_rule)
register("inspect_sharding", no_layout_rule, partition=inspect_rule)
