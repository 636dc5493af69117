"""Automatic sharding: ``gshard.auto_shard`` finds the layouts a program needs.

Per argument it chooses a layout (a PartitionSpec), and where propagation would
not follow, a few annotations, minimising the bytes each device sends under a
per-device memory limit: an integer program over gshard's own propagation graph
(Alpa's formulation over factor rules), solved exactly with HiGHS after an
exact reduction, then checked by partitioning the program with gshard.

  search.py       the problem, its memory rows, the solve, the runner-ups
  problem.py      values (merged elementwise chains) and ops (factor-rule strategies)
  layouts.py      candidate layouts and strategies; reshard plans priced
  solve.py        reduction (folds, dominance) and the ILP (scipy.optimize.milp)
  memory.py       arguments + live activations, as XLA keeps them
  realize.py      in_specs, and the annotations propagation needs to follow
  annotations.py  the annotations, and the function that applies them
  plan.py         the Plan: in_specs, annotations, costs, runner-ups, print
  api.py          auto_shard
"""

from gshard.auto.annotations import Annotation
from gshard.auto.api import AutoShard, auto_shard
from gshard.auto.plan import Choice, Cost, Plan

__all__ = ["Annotation", "AutoShard", "Choice", "Cost", "Plan", "auto_shard"]
