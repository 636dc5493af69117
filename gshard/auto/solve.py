"""The exact solver: a pairwise cost graph reduced, then an integer linear program.

Variables have a few choices each, a cost and per-device memory per choice,
and pairwise cost (and memory) matrices. The minimum of the total cost subject
to every memory row staying under the limit is found in two exact steps:

1. **Reduction** (:meth:`Solver.reduce`), which never changes the optimum
   of the cost (memory is carried along exactly, for the choices kept):
   - a variable with one neighbour is folded into it (for each choice of the
     neighbour, its best choice), one with two neighbours into an edge between
     them (for each pair of their choices, its best choice): chains of ops
     collapse to one matrix;
   - a choice that is no better than another in its cost, its memory and every
     row of every matrix it touches (*dominated*) is dropped;
   - a matrix that is a sum of a row term and a column term becomes two costs.
   Variables whose memory differs between choices (the arguments: parameters,
   optimizer state, the batch) are never folded: the memory limit decides them.
2. **ILP** (:meth:`Solver.solve`): a binary per choice, one per variable; a
   continuous per entry of each matrix, tied to the choices by its row and
   column sums (so it is 1 exactly at the chosen pair); identical rows or
   columns of a matrix share entries. ``scipy.optimize.milp`` (HiGHS) solves it.

:meth:`Solver.expand` undoes the folding: every variable's choice.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np


@dataclasses.dataclass
class Solution:
  """Each variable's choice, the total cost and the memory rows."""

  choice: dict[int, int]
  cost: float
  memory: np.ndarray
  seconds: float
  status: str


class Infeasible(Exception):
  """No assignment meets the memory limit (``minimum``: the least memory any
  assignment reaches, a second integer program solved only when asked for)."""

  def __init__(self, minimum):
    super().__init__("no layout fits the memory limit")
    self._minimum = minimum

  @property
  def minimum(self) -> float:
    if callable(self._minimum):
      self._minimum = float(self._minimum())
    return self._minimum


class Solver:
  """A pairwise cost graph: ``cost[v]`` [n_v], ``mem[v]`` [K, n_v], ``edges[(u, v)]``
  = (C [n_u, n_v], M [K, n_u, n_v] or None) with u < v."""

  def __init__(self, cost: list[np.ndarray], mem: list[np.ndarray], edges: dict,
               keep: set[int] = frozenset()):
    self.cost = {i: np.asarray(c, float) for i, c in enumerate(cost)}
    self.mem = {i: np.asarray(m, float) for i, m in enumerate(mem)}
    self.K = next(iter(self.mem.values())).shape[0] if self.mem else 0
    self.alive = {i: np.arange(len(c)) for i, c in self.cost.items()}   # kept choices
    self.edges: dict[tuple[int, int], tuple[np.ndarray, np.ndarray | None]] = {}
    self.nbrs: dict[int, set[int]] = {i: set() for i in self.cost}
    for (u, v), (c, m) in edges.items():
      self._add_edge(u, v, np.asarray(c, float), m)
    self.keep = set(keep)
    self.steps: list[tuple] = []     # folds, in order, for expand()
    self.constant = 0.0
    self.constant_mem = np.zeros(self.K)

  # -- edges -----------------------------------------------------------------
  def _add_edge(self, u, v, c, m):
    if u == v:
      self.cost[u] = self.cost[u] + np.diag(c)
      if m is not None:
        self.mem[u] = self.mem[u] + np.stack([np.diag(r) for r in m])
      return
    if u > v:
      u, v, c = v, u, c.T
      m = None if m is None else m.transpose(0, 2, 1)
    old = self.edges.get((u, v))
    if old is not None:
      c = c + old[0]
      m = old[1] if m is None else (m if old[1] is None else m + old[1])
    self.edges[(u, v)] = (c, m)
    self.nbrs[u].add(v)
    self.nbrs[v].add(u)

  def _edge(self, u, v):
    """(C, M) oriented u -> v."""
    if u < v:
      return self.edges[(u, v)]
    c, m = self.edges[(v, u)]
    return c.T, (None if m is None else m.transpose(0, 2, 1))

  def _drop_edge(self, u, v):
    self.edges.pop((min(u, v), max(u, v)))
    self.nbrs[u].discard(v)
    self.nbrs[v].discard(u)

  def _remove(self, v):
    for u in list(self.nbrs[v]):
      self._drop_edge(u, v)
    del self.cost[v], self.mem[v], self.nbrs[v]

  # -- reduction ---------------------------------------------------------------
  def _memory_free(self, v) -> bool:
    m = self.mem[v]
    if v in self.keep or not (m.size == 0 or np.ptp(m, axis=1).max() == 0):
      return False
    for u in self.nbrs[v]:
      mm = self._edge(v, u)[1]
      if mm is not None and mm.size and np.ptp(mm, axis=1).max() > 0:
        return False
    return True

  def _fold(self, v) -> bool:
    ns = sorted(self.nbrs[v])
    cv, mv = self.cost[v], self.mem[v]
    if len(ns) == 0:
      j = int(np.argmin(cv))
      self.constant += cv[j]
      self.constant_mem += mv[:, j]
      self.steps.append(("const", v, self.alive[v][j]))
    elif len(ns) == 1:
      (u,) = ns
      c, m = self._edge(u, v)                    # [n_u, n_v]
      tot = c + cv[None, :]
      j = np.argmin(tot, axis=1)
      rows = np.arange(len(j))
      self.cost[u] = self.cost[u] + tot[rows, j]
      add = mv[:, j] + (m[:, rows, j] if m is not None else 0)
      self.mem[u] = self.mem[u] + add
      self.steps.append(("one", v, (u,), (self.alive[u].copy(),), self.alive[v][j]))
    elif len(ns) == 2:
      u, w = ns
      cu, mu = self._edge(u, v)                  # [n_u, n_v]
      cw, mw = self._edge(v, w)                  # [n_v, n_w]
      tot = cu[:, :, None] + cv[None, :, None] + cw[None, :, :]   # [n_u, n_v, n_w]
      j = np.argmin(tot, axis=1)                 # [n_u, n_w]
      iu, iw = np.meshgrid(np.arange(len(cu)), np.arange(cw.shape[1]), indexing="ij")
      c2 = tot[iu, j, iw]
      m2 = mv[:, j]
      if mu is not None:
        m2 = m2 + mu[:, iu, j]
      if mw is not None:
        m2 = m2 + mw[:, j, iw]
      self._remove(v)
      self._add_edge(u, w, c2, m2 if np.any(m2) else None)
      self.steps.append(("two", v, (u, w), (self.alive[u].copy(), self.alive[w].copy()),
                         self.alive[v][j]))
      return True
    else:
      return False
    self._remove(v)
    return True

  def _prune(self, v) -> bool:
    """Drop dominated choices of ``v``; True if any was dropped."""
    n = len(self.cost[v])
    if n <= 1 or v in self.keep:     # kept whole: the runner-ups are asked of them
      return False
    blocks = [self.cost[v][:, None], self.mem[v].T]
    for u in sorted(self.nbrs[v]):
      c, m = self._edge(v, u)
      blocks.append(c)
      if m is not None:
        blocks.append(m.transpose(1, 0, 2).reshape(n, -1))
    rows = np.concatenate(blocks, axis=1)        # [n, features]; smaller is better
    keep = np.ones(n, bool)
    order = np.argsort(rows.sum(axis=1), kind="stable")
    for a in order:
      if not keep[a]:
        continue
      dominated = np.all(rows[a][None, :] <= rows, axis=1) & keep
      dominated[a] = False
      keep &= ~dominated
    if keep.all():
      return False
    idx = np.nonzero(keep)[0]
    self._restrict(v, idx)
    return True

  def _restrict(self, v, idx):
    self.cost[v] = self.cost[v][idx]
    self.mem[v] = self.mem[v][:, idx]
    self.alive[v] = self.alive[v][idx]
    for u in list(self.nbrs[v]):
      c, m = self._edge(v, u)
      self._drop_edge(v, u)
      self._add_edge(v, u, c[idx], None if m is None else m[:, idx])

  def _separate(self, u, v) -> bool:
    c, m = self.edges[(u, v)]
    if m is not None:
      return False
    r, s = c[:, :1], c[:1, :] - c[0, 0]
    if not np.allclose(c, r + s, rtol=1e-9, atol=1e-6):
      return False
    self.cost[u] = self.cost[u] + r[:, 0]
    self.cost[v] = self.cost[v] + s[0]
    self._drop_edge(u, v)
    return True

  def reduce(self) -> None:
    """Fold, prune and separate until nothing changes."""
    changed = True
    while changed:
      changed = False
      for e in list(self.edges):
        if e in self.edges and self._separate(*e):
          changed = True
      for v in sorted(self.cost):
        if v in self.cost and self._prune(v):
          changed = True
      for v in sorted(self.cost, key=lambda v: len(self.nbrs[v])):
        if v in self.cost and len(self.nbrs[v]) <= 2 and self._memory_free(v):
          changed |= self._fold(v)

  # -- the integer program ---------------------------------------------------------
  def size(self) -> dict[str, int]:
    """How big the remaining problem is."""
    return {"variables": len(self.cost),
            "choices": sum(len(c) for c in self.cost.values()),
            "matrices": len(self.edges),
            "entries": sum(c.size for c, _ in self.edges.values())}

  def prepare(self) -> None:
    """Build the integer program now (before :meth:`solve` runs in several threads)."""
    self._model()

  def _model(self):
    """(objective, equality matrix, rhs, memory matrix, number of binaries,
    offsets, variables), built once: the reduction is done by then."""
    if getattr(self, "_built", None) is None:
      self._built = self._build_model()
    return self._built

  def _build_model(self):
    from scipy import sparse
    vs = sorted(self.cost)
    off, n = {}, 0
    for v in vs:
      off[v] = n
      n += len(self.cost[v])
    obj = [self.cost[v] for v in vs]
    memcols = [self.mem[v] for v in vs]
    rows, cols, vals, rhs = [], [], [], []

    def row(entries, value):
      r = len(rhs)
      for c, x in entries:
        rows.append(r)
        cols.append(c)
        vals.append(x)
      rhs.append(value)

    for v in vs:                                 # one choice per variable
      row([(off[v] + k, 1.0) for k in range(len(self.cost[v]))], 1.0)
    m = n
    for (u, v), (c, mm) in self.edges.items():
      parts = [c] if mm is None else [c] + list(mm)
      _, gr = np.unique(np.concatenate(parts, axis=1), axis=0, return_inverse=True)
      _, gc = np.unique(np.concatenate([x.T for x in parts], axis=1), axis=0,
                        return_inverse=True)
      gr, gc = gr.ravel(), gc.ravel()
      nr, nc = int(gr.max()) + 1, int(gc.max()) + 1
      ra = np.array([np.nonzero(gr == g)[0][0] for g in range(nr)])
      ca = np.array([np.nonzero(gc == h)[0][0] for h in range(nc)])
      obj.append(c[np.ix_(ra, ca)].ravel())
      memcols.append(np.zeros((self.K, nr * nc)) if mm is None else
                     np.stack([x[np.ix_(ra, ca)].ravel() for x in mm]))
      for g in range(nr):          # the entries of row group g sum to u's choices in it
        row([(m + g * nc + h, 1.0) for h in range(nc)]
            + [(off[u] + k, -1.0) for k in np.nonzero(gr == g)[0]], 0.0)
      for h in range(nc):
        row([(m + g * nc + h, 1.0) for g in range(nr)]
            + [(off[v] + k, -1.0) for k in np.nonzero(gc == h)[0]], 0.0)
      m += nr * nc
    c_all = np.concatenate(obj) if obj else np.zeros(0)
    mem_all = np.concatenate(memcols, axis=1) if memcols else np.zeros((self.K, 0))
    a_eq = sparse.csr_array((vals, (rows, cols)), shape=(len(rhs), m))
    return c_all, a_eq, np.array(rhs), mem_all, n, off, vs

  def solve(self, limit: float | None, forbid: dict[int, list[int]] | None = None,
            time_limit: float = 60.0) -> Solution:
    """The cheapest assignment with every memory row at most ``limit`` (None: no
    limit). ``forbid``: variable -> original choices it may not take; after
    :meth:`reduce`, only variables in ``keep`` (the others may have been folded
    away, or lost a choice identical to a forbidden one). Raises
    :class:`Infeasible`."""
    from scipy import optimize, sparse
    t0 = time.perf_counter()
    c_all, a_eq, rhs, mem_all, n, off, vs = self._model()
    m = len(c_all)
    if m == 0:
      if limit is not None and self.K and np.any(self.constant_mem > limit):
        raise Infeasible(lambda: self.min_memory(forbid))
      return Solution(self.expand({}), self.constant, self.constant_mem.copy(), 0.0, "optimal")
    ub = np.ones(m)
    for v, orig in (forbid or {}).items():
      if v in self.alive:
        for k in np.nonzero(np.isin(self.alive[v], orig))[0]:
          ub[off[v] + k] = 0.0
    cons = [optimize.LinearConstraint(a_eq, rhs, rhs)]
    if limit is not None and self.K:
      # rows in units of the limit: bytes (up to 1e7 and more) next to 0/1
      # choice rows leave HiGHS badly scaled and slower (the feasible set is
      # the same)
      unit = max(1.0, abs(float(limit)))
      cons.append(optimize.LinearConstraint(sparse.csr_array(mem_all / unit), -np.inf,
                                            (limit - self.constant_mem) / unit))
    scale = max(1.0, float(np.abs(c_all).max()) if m else 1.0)
    res = optimize.milp(c_all / scale, constraints=cons,
                        integrality=np.concatenate([np.ones(n), np.zeros(m - n)]),
                        bounds=optimize.Bounds(np.zeros(m), ub),
                        options={"time_limit": time_limit, "mip_rel_gap": 1e-7})
    if res.x is None:
      if res.status == 1:     # out of time without an assignment
        raise TimeoutError(f"the integer program found no assignment in {time_limit} s")
      raise Infeasible(lambda: self.min_memory(forbid))
    choice = {v: int(self.alive[v][int(np.argmax(res.x[off[v]:off[v] + len(self.cost[v])]))])
              for v in vs}
    return Solution(self.expand(choice), float(c_all @ res.x) + self.constant,
                    mem_all @ res.x + self.constant_mem, time.perf_counter() - t0,
                    "optimal" if res.status == 0 else str(res.message))

  def min_memory(self, forbid: dict[int, list[int]] | None = None) -> float:
    """The least largest memory row any assignment reaches."""
    if not self.K:
      return 0.0
    from scipy import optimize, sparse
    c_all, a_eq, rhs, mem_all, n, off, vs = self._model()
    m = len(c_all)
    ub = np.ones(m + 1)
    ub[m] = np.inf
    for v, orig in (forbid or {}).items():
      if v in self.alive:
        for k in np.nonzero(np.isin(self.alive[v], orig))[0]:
          ub[off[v] + k] = 0.0
    a_eq = sparse.hstack([a_eq, sparse.csr_array((a_eq.shape[0], 1))])
    unit = max(1.0, float(np.abs(mem_all).max()) if mem_all.size else 1.0)
    a_mem = sparse.hstack([sparse.csr_array(mem_all / unit), -np.ones((self.K, 1))])
    obj = np.zeros(m + 1)
    obj[m] = 1.0
    res = optimize.milp(obj, constraints=[optimize.LinearConstraint(a_eq, rhs, rhs),
                                          optimize.LinearConstraint(
                                              a_mem, -np.inf, -self.constant_mem / unit)],
                        integrality=np.concatenate([np.ones(n), np.zeros(m + 1 - n)]),
                        bounds=optimize.Bounds(np.zeros(m + 1), ub),
                        options={"time_limit": 60.0})
    return float(res.fun) * unit if res.x is not None else float("inf")

  def expand(self, choice: dict[int, int]) -> dict[int, int]:
    """Every variable's (original) choice from those of the remaining ones."""
    full = dict(choice)
    for kind, v, *rest in reversed(self.steps):
      if kind == "const":
        full[v] = int(rest[0])
        continue
      nbrs, alive, table = rest
      at = tuple(int(np.nonzero(a == full[u])[0][0]) for u, a in zip(nbrs, alive))
      full[v] = int(table[at])
    return full
