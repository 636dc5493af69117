"""The search: the reduced problem, its memory rows, the exact solve, runner-ups.

:func:`search` turns a pinned propagation graph into a :class:`Search`: the
layout of every value and the strategy of every op that minimise the bytes
sent per device (weighted by bandwidth, plus a small latency per collective),
with the per-device memory at most the limit.

Memory rows are the arguments plus the values live at a few points of the
program (:class:`memory.Liveness`): first the peaks of the replicated program;
if the solution's own memory curve peaks higher than the limit elsewhere, that
point becomes a row too and the problem is solved again (a cutting plane), so
the limit holds at every point of the sweep.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time
from collections.abc import Mapping

import numpy as np

from gshard.auto import layouts as L
from gshard.auto import memory, problem, solve, tie
from gshard.spmd.graph import Graph

MAX_ROUNDS = 4          # cutting-plane rounds for the memory limit
CANONICAL_TIE = 0.25    # bytes: of equal layouts, prefer axes in mesh order


@dataclasses.dataclass
class Options:
  """What :func:`search` weighs (see ``gshard.auto_shard``)."""

  memory_limit: float | None = None
  bandwidth: Mapping[str, float] | None = None
  latency: float = 1024.0
  min_bytes: int = 4096
  time_limit: float = 60.0
  runner_up_seconds: float = 10.0
  tie_layers: bool = True


@dataclasses.dataclass
class RunnerUp:
  """The best plan whose value ``var`` is laid out otherwise."""

  choice: int | None            # the value's layout index there (None: none found)
  bytes: float                  # predicted bytes per device of that plan
  memory: float                 # its predicted peak memory per device
  exact: bool                   # solved to optimality (else: the rest held fixed)


@dataclasses.dataclass
class Search:
  """The solution and how it was found."""

  problem: problem.Problem
  choice: dict[int, int]
  bytes: float                  # predicted bytes sent per device (the model's)
  memory: memory.Memory
  inputs: list[int]             # value variables that hold arguments
  runner_ups: dict[int, RunnerUp]
  size: dict[str, int]          # of the reduced problem
  seconds: dict[str, float]
  status: str
  solved: tuple = ()            # (solver, memory model, budget): for the runner-ups


def _input_values(prob: problem.Problem, jaxpr) -> list[int]:
  out = []
  for v in jaxpr.invars:
    t = prob.graph.tensors.get(((), v))
    vi = prob.var_of(t) if t is not None else None
    if vi is not None and vi not in out:
      out.append(vi)
  return out


def _canonical_penalty(v: problem.Value, mesh_order: dict[str, int]) -> np.ndarray:
  return np.array([CANONICAL_TIE * sum(
      1 for axes in c.dims if list(axes) != sorted(axes, key=mesh_order.get))
      for c in v.candidates])


def _rows(mem: memory.ProgramMemory, prob: problem.Problem, sets: list[set]) -> list:
  """Per variable, [K, n] bytes: its arguments plus its values live in each set."""
  out = []
  for var in prob.vars:
    m = np.zeros((len(sets), var.n))
    if var.kind == "value" and sets:
      v = var.item
      for mb in v.members:
        t = mb.tensor
        if t.scope != () or not t.shape:
          continue
        arg = t.var in mem.invars
        hit = [k for k, s in enumerate(sets) if t.var in s]
        if not arg and not hit:
          continue
        for j, c in enumerate(v.candidates):
          b = mem.bytes(t, v.layout_of(mb, c))
          if arg:
            m[:, j] += b
          else:
            m[hit, j] += b
    out.append(m)
  return out


class _Tied:
  """The integer program over classes of variables (:mod:`tie`): costs, memory
  and matrices summed over each class's members."""

  def __init__(self, prob, cls: list[int], rows, keep, mesh_order):
    self.cls = cls
    n = max(cls) + 1 if cls else 0
    first = {}
    for vi, c in enumerate(cls):
      first.setdefault(c, vi)
    self.first = [first[c] for c in range(n)]
    cost = [np.zeros(prob.vars[self.first[c]].n) for c in range(n)]
    mem = [np.zeros_like(rows[self.first[c]]) for c in range(n)]
    for vi, var in enumerate(prob.vars):
      c = var.cost
      if var.kind == "value":
        c = c + _canonical_penalty(var.item, mesh_order)
      cost[cls[vi]] = cost[cls[vi]] + c
      mem[cls[vi]] = mem[cls[vi]] + rows[vi]
    edges: dict = {}
    for (o, v), mat in prob.edges.items():
      key = (cls[o], cls[v])
      edges[key] = (edges[key][0] + mat, None) if key in edges else (mat, None)
    self.solver = solve.Solver(cost, mem, edges, keep={cls[v] for v in keep})
    self.solver.reduce()

  def solve(self, budget, forbid=None, time_limit=60.0):
    """The solution, every variable's choice (a class's members share it)."""
    sol = self.solver.solve(budget, forbid={self.cls[v]: c for v, c in (forbid or {}).items()},
                            time_limit=time_limit)
    sol.choice = {vi: sol.choice[c] for vi, c in enumerate(self.cls)}
    return sol

  def size(self):
    return self.solver.size()


def _polish(prob, choice, inputs, mem: memory.ProgramMemory, mesh_order) -> None:
  """Of an argument's layouts that cost the same given the rest of the plan, take
  the one that holds the fewest bytes (then the one with axes in mesh order)."""
  inc: dict[int, list] = {}
  for (o, v), mat in prob.edges.items():
    inc.setdefault(v, []).append((o, mat))
  for vi in inputs:
    var = prob.vars[vi]
    v = var.item
    pen = _canonical_penalty(v, mesh_order)
    args = [m for m in v.members if m.tensor.scope == () and m.tensor.var in mem.invars]

    def key(j):
      local = var.cost[j] + sum(mat[choice[o], j] for o, mat in inc.get(vi, []))
      held = sum(mem.bytes(m.tensor, v.layout_of(m, v.candidates[j])) for m in args)
      return local, held, pen[j]
    best = choice[vi]
    bk = key(best)
    for j in range(var.n):
      k = key(j)
      if k[0] <= bk[0] + 1e-6 * max(1.0, abs(bk[0])) and (k[1], k[2]) < (bk[1], bk[2]):
        best, bk = j, k
    choice[vi] = best


def search(graph: Graph, jaxpr, mesh_sizes: Mapping[str, int], opts: Options,
           paths: list[str], cache: dict | None = None, runner_ups: bool = True) -> Search:
  """Solve the layout problem of a pinned graph; see the module docstring.
  ``paths`` names the program's inputs (``[0]['w1']``), for tying layers.
  ``cache``: a dict kept across calls on the same graph with other memory
  limits (the problem, its memory model and tied classes are built once).
  ``runner_ups=False`` leaves them to :func:`add_runner_ups`."""
  secs: dict[str, float] = {}
  t0 = time.perf_counter()
  cache = {} if cache is None else cache
  if "prob" not in cache:
    pricer = L.Pricer(mesh_sizes, opts.bandwidth, opts.latency)
    prob = problem.build(graph, mesh_sizes, pricer, opts.min_bytes)
    mem = memory.ProgramMemory(graph, jaxpr, mesh_sizes)
    inputs = _input_values(prob, jaxpr)
    names = {}
    for var, path in zip(jaxpr.invars, paths):
      t = graph.tensors.get(((), var))
      vi = prob.var_of(t) if t is not None else None
      if vi is not None:
        names.setdefault(vi, path)
    cls = tie.classes(prob, names) if opts.tie_layers else list(range(len(prob.vars)))
    cache.update(prob=prob, mem=mem, inputs=inputs, cls=cls)
  prob, mem, inputs, cls = cache["prob"], cache["mem"], cache["inputs"], cache["cls"]
  secs["build"] = time.perf_counter() - t0
  mesh_order = {a: i for i, a in enumerate(mesh_sizes)}
  limit = opts.memory_limit
  # the memory rows: the replicated program's peaks, and every point a
  # solution has peaked at since (kept in ``cache``: a cut holds for any budget)
  if limit is not None and "sets" not in cache:
    cache["sets"] = mem.peak_sets()
  sets = cache["sets"] if limit is not None else []
  secs["solve"] = 0.0
  for _ in range(MAX_ROUNDS):
    t1 = time.perf_counter()
    solver = _Tied(prob, cls, _rows(mem, prob, sets), inputs, mesh_order)
    budget = limit - mem.scalar_args if limit is not None else None
    sol = solver.solve(budget, time_limit=opts.time_limit)
    secs["solve"] += time.perf_counter() - t1
    choice = sol.choice
    _polish(prob, choice, inputs, mem, mesh_order)
    used = mem.of(lambda t: prob.layout(t, choice))
    if limit is None or used.peak <= limit * (1 + 1e-9):
      break
    at = set(mem.live.live_at(used.point))
    if at in sets:
      break
    sets.append(at)
  sent = sum(b for b, _, _ in problem.evaluate(prob, choice))
  found = Search(prob, choice, sent, used, inputs, {}, solver.size(), secs, sol.status,
                 (solver, mem, budget))
  return add_runner_ups(found, opts) if runner_ups else found


def least_memory(graph: Graph, jaxpr, mesh_sizes: Mapping[str, int], opts: Options,
                 paths: list[str], cache: dict) -> float:
  """The least memory per device (the model's) any layout reaches: below it
  :func:`search` is infeasible. ``cache`` as for :func:`search`."""
  try:
    search(graph, jaxpr, mesh_sizes, dataclasses.replace(opts, memory_limit=0.0), paths,
           cache=cache, runner_ups=False)
  except solve.Infeasible as e:
    return float(e.minimum) + cache["mem"].scalar_args
  return float(cache["mem"].scalar_args)


def add_runner_ups(found: Search, opts: Options) -> Search:
  """``found`` with the runner-up of each argument's value (see :class:`RunnerUp`)."""
  solver, mem, budget = found.solved
  t2 = time.perf_counter()
  runner = _runner_ups(found.problem, solver, found.choice, found.inputs, mem, budget, opts)
  secs = dict(found.seconds, runner_ups=time.perf_counter() - t2)
  return dataclasses.replace(found, runner_ups=runner, seconds=secs)


def _runner_ups(prob, solver, choice, inputs, mem, budget, opts) -> dict[int, RunnerUp]:
  """For each argument's value: the best plan that lays it out otherwise.

  The integer programs are independent and HiGHS runs without Python's lock,
  so they are solved in threads, one per core: the deadline is shared."""
  deadline = time.perf_counter() + opts.runner_up_seconds
  asked: dict[int, int] = {}        # tied class -> the first argument's value asking
  for vi in inputs:
    if prob.vars[vi].n > 1:
      asked.setdefault(solver.cls[vi], vi)
  solver.solver.prepare()           # built once, before the threads read it

  def one(vi) -> RunnerUp:
    left, alt = deadline - time.perf_counter(), None
    if left > 0.5:
      try:
        alt = solver.solve(budget, forbid={vi: _same_tiling(prob.vars[vi].item, choice[vi])},
                           time_limit=min(opts.time_limit, left)).choice
        exact = True
      except solve.Infeasible:      # no other layout of it fits the limit
        return RunnerUp(None, float("inf"), float("inf"), True)
      except TimeoutError:          # out of time: the rest held fixed, as below
        pass
    if alt is None:
      alt, exact = _local_alternative(prob, choice, vi), False
      if alt is None:
        return RunnerUp(None, float("inf"), float("inf"), False)
    sent = sum(b for b, _, _ in problem.evaluate(prob, alt))
    used = mem.of(lambda t: prob.layout(t, alt))
    return RunnerUp(alt[vi], sent, used.peak, exact)

  workers = max(1, min(len(asked), os.cpu_count() or 1))
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    done = dict(zip(asked, pool.map(one, asked.values())))
  return {vi: done[solver.cls[vi]] for vi in inputs if solver.cls[vi] in done}


def _same_tiling(v: problem.Value, j: int) -> list[int]:
  """The layouts of ``v`` that split each dim over the same axes as layout ``j``,
  in any order: the runner-up must differ in more than the order."""
  sets = [frozenset(a) for a in v.candidates[j].dims]
  return [k for k, c in enumerate(v.candidates) if [frozenset(a) for a in c.dims] == sets]


def _local_alternative(prob, choice, vi) -> dict[int, int] | None:
  """The best other layout of value ``vi`` with every other value held and only
  the ops touching it re-chosen (when the time for exact runner-ups is spent)."""
  ops = [o for (o, v) in prob.edges if v == vi]
  best, best_cost = None, float("inf")
  same = _same_tiling(prob.vars[vi].item, choice[vi])
  for j in range(prob.vars[vi].n):
    if j in same:
      continue
    trial = dict(choice)
    trial[vi] = j
    total = 0.0
    for o in ops:
      cols = prob.vars[o].cost.copy()
      for (o2, v2), mat in prob.edges.items():
        if o2 == o:
          cols = cols + mat[:, trial[v2]]
      trial[o] = int(np.argmin(cols))
      total += cols[trial[o]]
    if total < best_cost:
      best, best_cost = trial, total
  return best
