"""Cut L layers into K contiguous pipeline stages, exactly.

``balance(costs, num_stages=K)`` returns the layer count of each stage
(``counts[s] >= 1``, ``sum(counts) == L``); stage s holds layers
``sum(counts[:s]) .. sum(counts[:s+1]) - 1``. Objectives:

- ``"max"`` (default): minimise the largest stage cost, the pipeline's
  steady-state period.
- ``"alpa"``: Alpa's (Zheng et al., OSDI 2022, Sec. 5.2) pipeline latency
  ``sum(stage costs) + (M - 1) * max(stage costs)`` for M micro-batches,
  minimised by Alpa's DP: for each candidate ``t_max`` (a segment cost), the
  least total cost of a split whose stages all cost ``<= t_max``, plus
  ``(M-1) * t_max``. In Alpa a stage's latency depends on the sub-mesh it gets,
  so the sum varies between splits; here every stage has the same devices and
  a stage costs the sum of its layers, so ``sum(stage costs)`` is the same
  for every split and the optimum is exactly the ``"max"`` optimum (with the
  same tie-break). The DP is kept so the objective is computed as Alpa does,
  and the tests check both against brute force.

``memory`` / ``memory_limit`` add a cap on each stage's summed per-layer
memory (parameters, optimizer state, stashed activations: whatever the caller
counts); an infeasible cap raises ``ValueError`` with the smallest feasible
limit and the number of stages the cap would need.

Exactness: costs are converted to exact rationals (every float is one), so
sums have no rounding and ties are real ties. Among optimal splits the
lexicographically smallest ``counts`` is returned (fewer layers on earlier
stages, which hold more in-flight activations under 1F1B). Costs must be
finite and ``>= 0``. Time ``O(K L log L)`` for ``"max"``, ``O(K L^2)`` for
``"alpa"``.

Example::

  balance([1, 2, 3, 4, 5], num_stages=2)      # [3, 2]: stage costs 6 and 9
  balance([1, 1, 1, 1], num_stages=2, memory=[3, 1, 1, 1], memory_limit=3)  # [1, 3]
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from fractions import Fraction
from typing import Literal

Objective = Literal["max", "alpa"]
_INF = None  # "infeasible" in the DP tables (ints are exact costs)


def _exact(name: str, values) -> list[int]:
  """Finite non-negative numbers -> ints on a common scale (exact)."""
  if hasattr(values, "flops") and name == "costs":
    values = values.flops
  if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
    raise ValueError(f"balance: {name} must be a list of per-layer numbers, got "
                     f"{type(values).__name__} {values!r}.")
  fractions = []
  for i, x in enumerate(values):
    if getattr(x, "shape", None) == () and hasattr(x, "item"):
      x = x.item()        # a NumPy or jax scalar (np.float32 is no Fraction)
    try:
      f = Fraction(x) if not isinstance(x, bool) else None
    except (TypeError, ValueError, OverflowError):
      f = None
    if f is None or f < 0:
      raise ValueError(f"balance: {name}[{i}] must be a finite number >= 0, got {x!r}.")
    fractions.append(f)
  scale = math.lcm(*(f.denominator for f in fractions)) if fractions else 1
  return [f.numerator * (scale // f.denominator) for f in fractions]


def _prefix(values: list[int]) -> list[int]:
  out = [0]
  for x in values:
    out.append(out[-1] + x)
  return out


class _Split:
  """The shared machinery: prefix sums and which segments ``[i, j)`` a stage may be."""

  def __init__(self, costs: list[int], memory: list[int] | None, limit: int | None):
    self.n = len(costs)
    self.cost = _prefix(costs)
    self.mem = _prefix(memory) if memory is not None else None
    self.limit = limit
    # lo[j]: the first i such that [i, j) fits the memory cap (i <= j).
    self.lo = [0] * (self.n + 1)
    if self.mem is not None:
      i = 0
      for j in range(self.n + 1):
        while self.mem[j] - self.mem[i] > limit:
          i += 1
        self.lo[j] = i

  def seg(self, i: int, j: int) -> int:
    return self.cost[j] - self.cost[i]

  def fits(self, i: int, j: int, cap: int) -> bool:
    return self.seg(i, j) <= cap and (self.mem is None or
                                      self.mem[j] - self.mem[i] <= self.limit)

  def min_max(self, k: int) -> int | None:
    """Least possible max stage cost over k stages (None if the memory cap forbids)."""
    n = self.n
    dp = [None] * (n + 1)  # dp[j]: best max over the first j layers in `stages` stages
    for j in range(1, n + 1):
      dp[j] = self.seg(0, j) if self.lo[j] == 0 else None
    for stages in range(2, k + 1):
      new = [None] * (n + 1)
      for j in range(stages, n + 1):
        lo, hi = max(stages - 1, self.lo[j]), j - 1
        if lo > hi:
          continue
        # dp[i] is non-decreasing in i (None = infinity), seg(i, j) non-increasing:
        # the best i is where they cross.
        a, b = lo, hi
        while a < b:
          mid = (a + b) // 2
          if dp[mid] is None or dp[mid] >= self.seg(mid, j):
            b = mid
          else:
            a = mid + 1
        best = None
        for i in (a - 1, a):
          if lo <= i <= hi and dp[i] is not None:
            value = max(dp[i], self.seg(i, j))
            best = value if best is None else min(best, value)
        new[j] = best
      dp = new
    return dp[n]

  def min_parts_from(self, cap: int) -> list[float]:
    """parts[i]: fewest stages (each cost <= cap, memory <= limit) covering layers i.."""
    n = self.n
    parts = [math.inf] * (n + 1)
    parts[n] = 0
    j = n
    for i in range(n - 1, -1, -1):
      # reach(i): the furthest j with [i, j) fitting; non-increasing as i decreases.
      while j > i and not self.fits(i, j, cap):
        j -= 1
      if j > i:
        parts[i] = 1 + parts[j]
    return parts

  def lexicographic(self, k: int, cap: int) -> list[int]:
    """The lexicographically smallest counts of k stages, each cost <= cap."""
    parts = self.min_parts_from(cap)
    counts, i = [], 0
    for remaining in range(k, 0, -1):
      if remaining == 1:
        counts.append(self.n - i)
        break
      c = 1
      while not (self.fits(i, i + c, cap) and parts[i + c] <= remaining - 1
                 and self.n - (i + c) >= remaining - 1):
        c += 1
      counts.append(c)
      i += c
    return counts

  def min_sum(self, k: int, cap: int) -> int | None:
    """Alpa's inner DP: least total stage cost of k stages, each cost <= cap."""
    n = self.n
    best = [None] * (n + 1)
    best[0] = 0
    for stages in range(1, k + 1):
      new = [None] * (n + 1)
      for j in range(stages, n + 1):
        for i in range(max(stages - 1, self.lo[j]), j):
          if best[i] is None or not self.fits(i, j, cap):
            continue
          value = best[i] + self.seg(i, j)
          if new[j] is None or value < new[j]:
            new[j] = value
      best = new
    return best[n]


def balance(costs, num_stages: int, *, objective: Objective = "max",
            num_microbatches: int | None = None, memory=None,
            memory_limit: float | None = None) -> list[int]:
  """Layers per stage of the best contiguous split of ``costs`` into ``num_stages``.

  Args:
    costs: per-layer cost (FLOPs, seconds, ...), finite and >= 0; a
      :class:`~gshard.pipeline.costs.LayerCosts` uses its ``flops``.
    num_stages: K, at most the number of layers (each stage gets >= 1).
    objective: ``"max"`` (min of the max stage cost) or ``"alpa"`` (min of
      ``sum + (num_microbatches - 1) * max``; see the module docstring).
    num_microbatches: M, required by ``"alpa"``.
    memory: per-layer memory, with ``memory_limit`` the cap on each stage's
      sum.
    memory_limit: the cap (same units as ``memory``).

  Returns:
    ``counts``, a list of K ints >= 1 summing to L; the lexicographically
    smallest among optimal splits.

  Example::

    balance([4, 1, 1, 1, 1, 4], num_stages=3)                  # [1, 4, 1]
    balance([4, 1, 1, 1, 1, 4], 3, objective="alpa", num_microbatches=8)  # [1, 4, 1]
  """
  exact = _exact("costs", costs)
  n = len(exact)
  if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
    raise ValueError(f"balance: num_stages must be an int >= 1, got {num_stages!r}.")
  if n == 0:
    raise ValueError("balance: costs is empty; give one cost per layer (a list of L >= 1 "
                     "numbers, e.g. pipeline.layer_costs(...)).")
  if num_stages > n:
    raise ValueError(f"balance: num_stages={num_stages} but costs has {n} layers; each stage "
                     f"needs at least one layer, so use num_stages <= {n}.")
  if objective not in ("max", "alpa"):
    raise ValueError(f"balance: objective must be 'max' or 'alpa', got {objective!r}.")
  if objective == "alpa":
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) \
        or num_microbatches < 1:
      raise ValueError(f"balance: objective='alpa' needs num_microbatches, an int >= 1 (the "
                       f"pipeline latency is sum + (M-1)*max), got {num_microbatches!r}.")
  if (memory is None) != (memory_limit is None):
    raise ValueError("balance: pass memory (per layer) and memory_limit (per stage) together, "
                     f"got memory={'set' if memory is not None else None}, memory_limit="
                     f"{memory_limit!r}.")
  mem = limit = None
  if memory is not None:
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, float)) \
        or not 0 <= memory_limit < math.inf:
      raise ValueError(f"balance: memory_limit must be a finite number >= 0, got "
                       f"{memory_limit!r}.")
    both = _exact("memory", [*memory, memory_limit])
    mem, limit = both[:-1], both[-1]
    if len(mem) != n:
      raise ValueError(f"balance: memory has {len(mem)} entries, costs has {n}; give one "
                       "memory value per layer.")
  split = _Split(exact, mem, limit)
  best_max = split.min_max(num_stages)
  if best_max is None:
    _raise_memory(mem, limit, num_stages, memory_limit, memory)
  if objective == "max":
    return split.lexicographic(num_stages, best_max)
  return _alpa(split, num_stages, num_microbatches, best_max)


def _alpa(split: _Split, k: int, m: int, first_feasible: int) -> list[int]:
  """Alpa's enumeration of t_max, from the first feasible one, with its early stop.

  Candidates below ``first_feasible`` (the min-max value) admit no split. The
  loop stops once ``lower bound of the sum + (M-1) * t_max`` cannot beat the
  best, where the lower bound is the total cost (a stage costs its layers).
  """
  n = split.n
  total = split.seg(0, n)
  candidates = sorted({split.seg(i, j) for i in range(n) for j in range(i + 1, n + 1)
                       if split.seg(i, j) >= first_feasible})
  best_value, best_cap = None, None
  for cap in candidates:
    if best_value is not None and total + (m - 1) * cap >= best_value:
      break
    least_sum = split.min_sum(k, cap)
    if least_sum is None:
      continue
    value = least_sum + (m - 1) * cap
    if best_value is None or value < best_value:
      best_value, best_cap = value, cap
  return split.lexicographic(k, best_cap)


def _raise_memory(mem, limit, k, memory_limit, memory):
  worst = max(range(len(mem)), key=lambda i: mem[i])
  if mem[worst] > limit:
    raise ValueError(f"balance: memory_limit={memory_limit!r} is infeasible: layer {worst} "
                     f"alone needs memory {memory[worst]!r}. Raise memory_limit to at least "
                     f"{memory[worst]!r}.")
  # The smallest cap that works for k stages is the min-max split of memory itself.
  need = _Split(mem, None, None).min_max(k)
  scale = Fraction(memory_limit) / limit if limit else Fraction(1)
  smallest = need * scale
  parts = _Split(mem, mem, limit).min_parts_from(sum(mem))[0]
  raise ValueError(
      f"balance: memory_limit={memory_limit!r} is infeasible for num_stages={k}: the best "
      f"split needs a stage with memory {float(smallest)!r}. Raise memory_limit to at least "
      f"{float(smallest)!r}, or use num_stages >= {parts} (the fewest stages this cap allows).")
