"""Sharding rules: one file per family; what a rule is lives in ``_core``.

This package's ``__init__`` exports the rule types only. The family modules
(``elementwise``, ``dot``, ``reduce``, ``shape``, ``indexing``, ``conv``,
``control``, ``random``, ``annotation``, ``pipeline``, ``linalg``, ``callback``)
register their primitives in
:mod:`gshard.spmd.registry` when imported; ``gshard.spmd`` imports them all.
"""

from gshard.spmd.rules._core import (IN, OUT, SUB_IN, SUB_OUT, Constraint, FactorRule,
                                     Factors, OpRule, Pin, Ref, RuleResult, ShardingRule,
                                     as_op_rule, factor_rule, letters, shapes)

__all__ = ["IN", "OUT", "SUB_IN", "SUB_OUT", "Constraint", "FactorRule", "Factors", "OpRule",
           "Pin", "Ref", "RuleResult", "ShardingRule", "as_op_rule", "factor_rule", "letters",
           "shapes"]
