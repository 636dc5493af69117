"""The auto_shard integer program (gshard.auto.solve) against brute force.

Hypothesis draws tiny pairwise cost graphs (2-6 variables of 1-4 choices, at
most 4096 assignments), every one of which numpy enumerates: the exact
minimum cost, every memory row, the least largest row. Then, with and without
:meth:`Solver.reduce` (the real search reduces first):

* with no memory limit, the solver's cost is the minimum and is the cost of
  the choice it returns;
* with 1-3 memory rows and a limit between the least memory any assignment
  reaches and the memory of the unconstrained optimum, the choice fits every
  row and its cost is the constrained minimum;
* under the least memory, :class:`Infeasible` is raised and its ``minimum`` is
  that least memory;
* ``forbid`` is respected and the cost is the minimum among the allowed
  (forbidden variables are in ``keep`` when reduced, as the search does).

Minimal cases pin down what the properties found (a fold that drops an
edge's memory, a problem folded away entirely, the least memory on rows of
bytes). The graphs exercise each reduction: chains, stars, trees and cycles fold
(degree 0, 1 and 2), duplicated and dominated choices are pruned, rank-1
additive matrices separate; dense graphs leave a real integer program. Costs
are integers times a unit (a wrong optimum is off by at least a unit), memory
integer bytes up to 1e7, so HiGHS's row scaling matters. Ties are frequent:
costs are compared, never choices.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gshard.auto.solve import Infeasible, Solver

# HiGHS (scipy.optimize.milp) accepts a solution whose binaries and rows are
# within mip_feasibility_tolerance = 1e-6 of exact: a choice group's (or a
# matrix's) mass off its chosen entry is then <= 2e-6, moving a total by
# <= 2 * 2e-6 * that group's largest |entry|, twice over once separation splits
# a matrix into row and column terms; cost_span, mem_span sum those largest entries.
SOLUTION_SLACK = 8e-6
# solve() stops at mip_abs_gap = 1e-6 of the objective divided by max|c| (<= 2 *
# span after separation), or mip_rel_gap = 1e-7 of |objective| (<= span).
GAP = 2e-6 + 1e-7
# min_memory() runs HiGHS with its default mip_rel_gap: 1e-4 of the optimum.
MIN_MEMORY_GAP = 1e-4
# solve() divides each memory row by max(1, |limit|): rows hold within 1e-6 of that.
ROW_FEASIBILITY = 1e-6


@dataclasses.dataclass
class Problem:
  cost: list[np.ndarray]                  # [n_v]
  mem: list[np.ndarray]                   # [K, n_v]
  edges: dict                             # (u, v) -> (C [n_u, n_v], M [K, n_u, n_v] | None)
  K: int

  def solver(self, keep=frozenset()) -> Solver:
    # copies: the solver must not depend on (or alter) the caller's arrays
    edges = {e: (c.copy(), None if m is None else m.copy()) for e, (c, m) in self.edges.items()}
    return Solver([c.copy() for c in self.cost], [m.copy() for m in self.mem], edges, keep=keep)

  def cost_span(self) -> float:
    """A bound on |total cost| of any assignment: each group's largest |entry|, summed."""
    return (sum(float(np.abs(c).max()) for c in self.cost)
            + sum(float(np.abs(c).max()) for c, _ in self.edges.values()))

  def mem_span(self) -> float:
    """The same bound for any memory row."""
    if not self.K:
      return 0.0
    return (sum(float(np.abs(m).max()) for m in self.mem)
            + sum(float(np.abs(m).max()) for _, m in self.edges.values() if m is not None))

  def cost_tol(self) -> float:
    # HiGHS's slack in its solution plus its stopping gap (scale is max(1, max|c|): + 1e-6)
    return (SOLUTION_SLACK + GAP) * self.cost_span() + 1e-6

  def mem_tol(self, limit: float) -> float:
    # a row's feasibility in units of the limit, plus the slack of the solution
    return ROW_FEASIBILITY * max(1.0, abs(limit)) + SOLUTION_SLACK * self.mem_span()


@dataclasses.dataclass
class Table:
  """Every assignment (rows of ``choice``), its total cost and memory rows."""
  choice: np.ndarray      # [N, n_vars]
  cost: np.ndarray        # [N]
  mem: np.ndarray         # [N, K]

  @property
  def peak(self) -> np.ndarray:
    """The largest memory row of each assignment."""
    return self.mem.max(axis=1) if self.mem.shape[1] else np.zeros(len(self.cost))


def enumerate_all(p: Problem) -> Table:
  n = [len(c) for c in p.cost]
  a = np.indices(n).reshape(len(n), -1).T
  cost = np.zeros(len(a))
  mem = np.zeros((len(a), p.K))
  for v in range(len(n)):
    cost += p.cost[v][a[:, v]]
    mem += p.mem[v][:, a[:, v]].T
  for (u, v), (c, m) in p.edges.items():
    cost += c[a[:, u], a[:, v]]
    if m is not None:
      mem += m[:, a[:, u], a[:, v]].T
  return Table(a, cost, mem)


def evaluate(p: Problem, choice: dict[int, int]) -> tuple[float, np.ndarray]:
  """The cost and memory rows of one assignment, summed directly."""
  assert sorted(choice) == list(range(len(p.cost))), choice
  for v, j in choice.items():
    assert 0 <= j < len(p.cost[v]), (v, j)
  cost = sum(float(p.cost[v][j]) for v, j in choice.items())
  mem = np.zeros(p.K)
  for v, j in choice.items():
    mem += p.mem[v][:, j]
  for (u, v), (c, m) in p.edges.items():
    cost += float(c[choice[u], choice[v]])
    if m is not None:
      mem += m[:, choice[u], choice[v]]
  return cost, mem


# -- random problems -----------------------------------------------------------

SHAPES = ("chain", "star", "tree", "cycle", "random", "dense")


def _graph(rng, shape: str, n: int) -> list[tuple[int, int]]:
  if shape == "chain":
    pairs = [(i, i + 1) for i in range(n - 1)]
  elif shape == "star":
    pairs = [(0, i) for i in range(1, n)]
  elif shape == "tree":
    pairs = [(int(rng.integers(0, i)), i) for i in range(1, n)]
  elif shape == "cycle":
    pairs = [(i, i + 1) for i in range(n - 1)] + ([(0, n - 1)] if n > 2 else [])
  elif shape == "random":        # isolated variables too (degree 0)
    pairs = [(u, v) for u in range(n) for v in range(u + 1, n) if rng.random() < 0.5]
  else:
    pairs = [(u, v) for u in range(n) for v in range(u + 1, n)]
  return pairs


@st.composite
def problems(draw, k_rows=st.integers(1, 3), edge_memory=st.booleans()):
  """A random pairwise cost graph with ``k_rows`` memory rows."""
  n = draw(st.integers(2, 6))
  shape = draw(st.sampled_from(SHAPES))
  K = draw(k_rows)
  with_m = draw(edge_memory) and K > 0
  unit = draw(st.sampled_from([1.0, 1024.0, 1e6]))        # cost: integers times a unit
  top = draw(st.sampled_from([2, 100]))                   # 2: ties everywhere
  mem_top = draw(st.sampled_from([100, 10**6, 10**7]))    # bytes
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

  def ints(hi, size):
    return rng.integers(0, hi + 1, size).astype(float)

  # base choices, then some variables get a duplicated or dominated extra choice
  base = [draw(st.integers(1, 4)) for _ in range(n)]
  extra = [b < 4 and draw(st.integers(0, 3)) == 0 for b in base]
  src = [np.concatenate([np.arange(b), [int(rng.integers(0, b))] if x else []]).astype(int)
         for b, x in zip(base, extra)]
  worse = [bool(x) and draw(st.booleans()) for x in extra]    # dominated, not a duplicate

  cost, mem = [], []
  for v in range(n):
    c = ints(top, base[v]) * unit
    if draw(st.integers(0, 2)) == 0:     # memory-free: the same bytes whatever the choice
      m = np.repeat(ints(mem_top, (K, 1)), base[v], axis=1)
    else:
      m = ints(mem_top, (K, base[v]))
    c, m = c[src[v]], m[:, src[v]]
    if worse[v]:
      c[-1] += ints(top, 1)[0] * unit
      m[:, -1] += ints(mem_top, K)
    cost.append(c)
    mem.append(m)

  edges = {}
  for u, v in _graph(rng, shape, n):
    kind = draw(st.sampled_from(["dense", "dense", "separable", "zero"]))
    if kind == "dense":
      c = ints(top, (base[u], base[v])) * unit
    elif kind == "separable":     # a row term plus a column term
      c = (ints(top, (base[u], 1)) + ints(top, (1, base[v]))) * unit
    else:
      c = np.zeros((base[u], base[v]))
    c = c[np.ix_(src[u], src[v])]
    if worse[u]:
      c[-1, :] += ints(top, len(src[v])) * unit
    if worse[v]:
      c[:, -1] += ints(top, len(src[u])) * unit
    m = None
    if with_m and draw(st.booleans()):
      m = ints(mem_top, (K, base[u], base[v]))[:, src[u]][:, :, src[v]]
    edges[(u, v)] = (c, m)
  return Problem(cost, mem, edges, K)


def make(p: Problem, reduce: bool, keep=frozenset()) -> Solver:
  s = p.solver(keep)
  if reduce:
    s.reduce()
  return s


def check_solution(p: Problem, sol, tol: float):
  """The reported cost is the returned choice's cost; return its memory rows."""
  cost, mem = evaluate(p, sol.choice)
  assert abs(cost - sol.cost) <= tol, (cost, sol.cost, sol.choice)
  return cost, mem


REDUCE = pytest.mark.parametrize("reduce", [False, True], ids=["ilp", "reduced"])


# -- 1. no memory limit ------------------------------------------------------------

@REDUCE
@settings(max_examples=100, deadline=None)
@given(p=problems(k_rows=st.integers(0, 3)))
def test_unlimited_cost_is_the_minimum(p, reduce):
  table = enumerate_all(p)
  sol = make(p, reduce).solve(None)
  tol = p.cost_tol()
  check_solution(p, sol, tol)
  assert abs(sol.cost - table.cost.min()) <= tol, (sol.cost, table.cost.min(), sol.choice)


# -- 2. a memory limit that some assignment meets --------------------------------

@REDUCE
@settings(max_examples=120, deadline=None)
@given(p=problems(), f=st.sampled_from([0.0, 1.0]) | st.floats(0.0, 1.0))
def test_limited_cost_is_the_constrained_minimum(p, f, reduce):
  table = enumerate_all(p)
  peak = table.peak
  lo = peak.min()
  best = table.cost.min()
  hi = peak[table.cost == best].min()       # the unconstrained optimum's memory
  limit = float(lo + f * (hi - lo))
  sol = make(p, reduce).solve(limit)
  tol, mtol = p.cost_tol(), p.mem_tol(limit)
  _, mem = check_solution(p, sol, tol)
  assert np.all(mem <= limit + mtol), (mem, limit, sol.choice)
  assert np.allclose(sol.memory, mem, rtol=0, atol=mtol), (sol.memory, mem)
  # between the best that fits exactly and the best within HiGHS's slack
  strict = table.cost[peak <= limit].min()
  loose = table.cost[peak <= limit + mtol].min()
  assert loose - tol <= sol.cost <= strict + tol, (sol.cost, strict, loose, sol.choice)


# -- 3. a limit under the least memory -------------------------------------------------

@REDUCE
@settings(max_examples=60, deadline=None)
@given(p=problems(), f=st.floats(0.0, 0.5))
def test_infeasible_reports_the_least_memory(p, f, reduce):
  table = enumerate_all(p)
  lo = float(table.peak.min())
  mtol = p.mem_tol(lo)
  limit = lo - 2 * mtol - 1.0 - f * lo       # clear of HiGHS's slack
  with pytest.raises(Infeasible) as info:
    make(p, reduce).solve(limit)
  minimum = info.value.minimum
  assert lo - mtol <= minimum <= lo * (1 + MIN_MEMORY_GAP) + mtol, (minimum, lo)
  assert info.value.minimum == minimum       # computed once


@REDUCE
@settings(max_examples=50, deadline=None)
@given(p=problems())
def test_min_memory_is_the_least_largest_row(p, reduce):
  lo = float(enumerate_all(p).peak.min())
  mtol = p.mem_tol(lo)
  got = make(p, reduce).min_memory()
  assert lo - mtol <= got <= lo * (1 + MIN_MEMORY_GAP) + mtol, (got, lo)


# -- 4. forbidden choices ----------------------------------------------------------------

@REDUCE
@settings(max_examples=100, deadline=None)
@given(p=problems(), data=st.data())
def test_forbid_is_respected_and_optimal(p, data, reduce):
  n = len(p.cost)
  vs = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
  forbid = {}
  for v in vs:
    choices = list(range(len(p.cost[v])))
    forbid[v] = data.draw(st.lists(st.sampled_from(choices), min_size=1,
                                   max_size=len(choices), unique=True))
  mode = data.draw(st.sampled_from(["none", "fits", "under"]))
  table = enumerate_all(p)
  allowed = np.ones(len(table.cost), bool)
  for v, js in forbid.items():
    allowed &= ~np.isin(table.choice[:, v], js)
  solver = make(p, reduce, keep=frozenset(forbid))   # the search keeps what it forbids
  tol = p.cost_tol()

  if not allowed.any():                 # every choice of some variable forbidden
    with pytest.raises(Infeasible) as info:
      solver.solve(None if mode == "none" else 1.0, forbid=forbid)
    if p.K and mode != "none":
      assert math.isinf(info.value.minimum), info.value.minimum
    return

  cost, peak = table.cost[allowed], table.peak[allowed]
  lo, best = float(peak.min()), cost.min()
  if mode == "none":
    limit = None
  elif mode == "fits":
    hi = peak[cost == best].min()
    limit = float(lo + data.draw(st.floats(0.0, 1.0)) * (hi - lo))
  else:
    limit = lo - 2 * p.mem_tol(lo) - 1.0
    with pytest.raises(Infeasible) as info:
      solver.solve(limit, forbid=forbid)
    mtol = p.mem_tol(lo)
    assert lo - mtol <= info.value.minimum <= lo * (1 + MIN_MEMORY_GAP) + mtol, (
        info.value.minimum, lo)
    return

  sol = solver.solve(limit, forbid=forbid)
  got, mem = check_solution(p, sol, tol)
  for v, js in forbid.items():
    assert sol.choice[v] not in js, (v, sol.choice[v], js)
  if limit is None:
    assert abs(sol.cost - best) <= tol, (sol.cost, best, sol.choice)
    return
  mtol = p.mem_tol(limit)
  assert np.all(mem <= limit + mtol), (mem, limit)
  strict = cost[peak <= limit].min()
  loose = cost[peak <= limit + mtol].min()
  assert loose - tol <= sol.cost <= strict + tol, (sol.cost, strict, loose, sol.choice)


# -- the reductions, one at a time, and minimal cases --------------------------------------

def test_reductions_fire():
  """The drawn shapes do reach each reduction (else the properties above say little)."""
  # a chain of memory-free variables folds away entirely (degree 1, then 0)
  chain = Problem([np.array([3., 1.]), np.array([0., 2.]), np.array([5., 4.])],
                  [np.zeros((1, 2))] * 3,
                  {(0, 1): (np.array([[0., 7.], [7., 0.]]), None),
                   (1, 2): (np.array([[1., 0.], [0., 1.]]), None)}, 1)
  s = make(chain, True)
  assert s.size()["variables"] == 0
  assert {k for k, *_ in s.steps} == {"one", "const"}
  # a cycle of memory-free variables: degree-2 folds
  cycle = Problem([np.array([0., 1.])] * 3, [np.zeros((1, 2))] * 3,
                  {(0, 1): (np.array([[0., 3.], [2., 0.]]), None),
                   (1, 2): (np.array([[1., 0.], [0., 4.]]), None),
                   (0, 2): (np.array([[0., 5.], [1., 0.]]), None)}, 1)
  assert "two" in {k for k, *_ in make(cycle, True).steps}
  # a duplicated choice is pruned, a separable matrix removed
  dup = Problem([np.array([3., 3., 0.]), np.array([2., 0.])],
                [np.array([[5., 5., 9.]]), np.array([[1., 3.]])],
                {(0, 1): (np.array([[1., 2.], [1., 2.], [3., 4.]]), None)}, 1)
  s = make(dup, True)
  assert s.size() == {"variables": 2, "choices": 4, "matrices": 0, "entries": 0}
  table = enumerate_all(dup)
  for limit in (6.0, 8.0, 12.0):
    sol = s.solve(limit)
    assert sol.cost == table.cost[table.peak <= limit].min(), limit


@pytest.mark.parametrize("limit", [None, 40.0, 20.0], ids=["unlimited", "fits", "under"])
def test_fully_folded_problem(limit):
  """reduce() folds every variable of a tree of memory-free variables: the
  answer is the constant it kept (cost 2 at (1, 0, 1), memory 30)."""
  p = Problem([np.array([3., 1.]), np.array([0., 2.]), np.array([5., 0.])],
              [np.full((1, 2), 10.), np.full((1, 2), 20.), np.zeros((1, 2))],
              {(0, 1): (np.array([[0., 7.], [0., 0.]]), None),
               (1, 2): (np.array([[0., 1.], [0., 1.]]), None)}, 1)
  table = enumerate_all(p)
  s = make(p, True)
  assert s.size()["variables"] == 0
  try:
    if limit is not None and limit < 30.0:
      with pytest.raises(Infeasible) as info:
        s.solve(limit)
      assert info.value.minimum == 30.0, info.value.minimum
      return
    sol = s.solve(limit)
  except ValueError as e:      # scipy's milp refuses a program of no variables
    pytest.fail(f"solve({limit}) of a problem reduce() folded completely raised {e!r}")
  assert sol.cost == table.cost.min() == 2.0, sol
  cost, mem = evaluate(p, sol.choice)
  assert (cost, mem.tolist()) == (2.0, [30.0]), sol.choice
  assert np.array_equal(sol.memory, [30.0]), sol.memory


@pytest.mark.parametrize("reduce", [False, True], ids=["ilp", "reduced"])
def test_fold_keeps_edge_memory(reduce):
  """A variable with the same own memory for every choice but a memory matrix
  on its edge: which of its choices is taken changes the memory."""
  p = Problem([np.array([1., 0.]), np.array([0., 1.])],
              [np.array([[0., 1.]]), np.zeros((1, 2))],
              {(0, 1): (np.zeros((2, 2)), np.array([[[10., 0.], [10., 0.]]]))}, 1)
  table = enumerate_all(p)     # (1, 1): cost 1, memory 1 fits 5; the cheapest, (1, 0), holds 11
  try:
    sol = make(p, reduce).solve(5.0)
  except Infeasible as e:
    pytest.fail(f"Infeasible (minimum {e.minimum}) at limit 5; (1, 1) holds 1 byte")
  assert sol.cost == table.cost[table.peak <= 5.0].min() == 1.0, sol
  assert evaluate(p, sol.choice)[1].max() <= 5.0, sol.choice


@pytest.mark.parametrize("reduce", [False, True], ids=["ilp", "reduced"])
def test_min_memory_exact_on_bytes(reduce):
  """Rows of bytes near 1e6: the least largest row is 1274002."""
  p = Problem([np.zeros(2), np.zeros(3), np.zeros(2)],
              [np.array([[172295., 494005.], [364928., 522220.]]),
               np.array([[323127., 479033., 464569.], [541141., 909740., 213164.]]),
               np.array([[417023., 778580.], [908406., 277848.]])],
              {(0, 1): (np.array([[2., 2., 0.], [1., 2., 0.]]), None),
               (1, 2): (np.array([[0., 0.], [1., 1.], [2., 1.]]), None)}, 2)
  table = enumerate_all(p)
  lo = table.peak.min()
  assert lo == 1274002.0, lo
  mtol = p.mem_tol(lo)
  got = make(p, reduce).min_memory()
  assert lo - mtol <= got <= lo * (1 + MIN_MEMORY_GAP) + mtol, (got, lo)
