"""Sharding rules, one file per family, gathered in one table keyed by primitive name."""

from gshard.spmd.rules import (annotation, control, conv, dot, elementwise, indexing,  # noqa: F401
                               reduce, shape)
from gshard.spmd.rules import random as _random  # noqa: F401  (registers rules)
from gshard.spmd.rules._core import (IN, OUT, SUB_IN, SUB_OUT, Constraint, FactorRule,
                                     OpRule, Pin, as_op_rule, factor_rule, register,
                                     sharding_rules)

__all__ = ["IN", "OUT", "SUB_IN", "SUB_OUT", "Constraint", "FactorRule", "OpRule", "Pin",
           "as_op_rule", "factor_rule", "register", "sharding_rules"]
