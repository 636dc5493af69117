"""Per-device memory of a candidate layout: arguments plus live activations.

What a device holds while the program runs is its arguments (parameters,
optimizer state, the batch: exact, from their layouts) and, at each point of
the program, the intermediate values still to be read (the activations the
backward pass reads, the gradients being formed). XLA fuses elementwise chains
and never materialises their insides, so a value counts only where XLA keeps a
buffer for it: the result of an op that is not elementwise (a matmul, a
reduction, a gather, a call ...), an operand of a matmul, reduction, gather or
scatter, and a program output. The live bytes of those values, swept in program
order over the top-level program, are a model of what
``compiled.memory_analysis()`` counts, not a copy of it (XLA also holds the
gathered copies of values read by several contractions, and the outputs):
``auto_shard`` checks each plan against the compiled program and, where XLA
needs more, tries the plans at the model's least memory (``api``);
``tests/test_auto.py`` bounds the ratio.

:class:`Liveness` gives, for a few points of the program, the set of values
live there; the solver constrains the memory at those points (the peaks of the
replicated program, and any point a solution peaks at: see ``api``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.extend.core import Literal

from gshard.auto import layouts as L

# Results XLA materialises (not fused into their consumers).
PRODUCERS = frozenset({
    "dot_general", "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
    "reduce_or", "argmax", "argmin", "gather", "scatter-add", "scatter", "scatter_add",
    "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort",
    "conv_general_dilated", "transpose", "jit", "pjit", "closed_call", "core_call",
    "custom_jvp_call", "custom_vjp_call", "checkpoint", "remat", "scan", "while", "cond",
    "stage_switch",
    "dynamic_slice", "dynamic_update_slice", "concatenate", "pad", "reduce_window_sum",
    "reduce_window_max", "select_and_scatter_add", "all_to_all", "ragged_dot"})
# Operands XLA reads from a buffer.
CONSUMERS = frozenset({
    "dot_general", "gather", "scatter-add", "scatter", "scatter_add", "reduce_sum",
    "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin", "conv_general_dilated",
    "cumsum", "cumprod", "cummax", "cummin", "sort", "ragged_dot"})


def _real(v) -> bool:
  return not isinstance(v, Literal) and type(v).__name__ != "DropVar"


@dataclasses.dataclass
class Liveness:
  """The materialised top-level values, when each is made and last read."""

  born: dict          # var -> eqn index that makes it
  dies: dict          # var -> eqn index of its last read (len(eqns) for an output)
  n_eqns: int

  @classmethod
  def of(cls, jaxpr) -> Liveness:
    """The liveness of a top-level jaxpr (invars are arguments: not counted here)."""
    outs = {v for v in jaxpr.outvars if _real(v)}
    read_by_buffer = set()
    last = {}
    for i, eqn in enumerate(jaxpr.eqns):
      for v in eqn.invars:
        if _real(v):
          last[v] = i
          if eqn.primitive.name in CONSUMERS:
            read_by_buffer.add(v)
    born, dies = {}, {}
    n = len(jaxpr.eqns)
    for i, eqn in enumerate(jaxpr.eqns):
      for v in eqn.outvars:
        if not _real(v) or not getattr(v.aval, "shape", None):
          continue
        if eqn.primitive.name in PRODUCERS or v in read_by_buffer or v in outs:
          born[v] = i
          dies[v] = n if v in outs else last.get(v, i)
    return cls(born, dies, n)

  def live_at(self, point: int) -> list:
    """The values live just after equation ``point`` runs."""
    return [v for v, b in self.born.items() if b <= point <= self.dies[v]]

  def curve(self, nbytes) -> np.ndarray:
    """Live bytes after each equation, for ``nbytes(var)``."""
    delta = np.zeros(self.n_eqns + 2)
    for v, b in self.born.items():
      x = nbytes(v)
      delta[b] += x
      delta[self.dies[v] + 1] -= x
    return np.cumsum(delta)[:self.n_eqns]

  def peaks(self, nbytes, k: int = 3) -> list[int]:
    """Up to ``k`` points of highest live bytes, at least a tenth of the program apart."""
    c = self.curve(nbytes)
    if not len(c):
      return []
    gap = max(1, len(c) // 10)
    out: list[int] = []
    for i in np.argsort(-c, kind="stable"):
      if all(abs(int(i) - j) >= gap for j in out):
        out.append(int(i))
      if len(out) == k:
        break
    return out


@dataclasses.dataclass
class Memory:
  """Predicted per-device memory of a layout of the program."""

  peak: float
  arguments: float
  activations: float            # live at the peak
  point: int                    # the equation the peak is after


class ProgramMemory:
  """The memory of the top-level program of a propagation graph under layouts."""

  def __init__(self, graph, jaxpr, mesh_sizes):
    self.mesh_sizes = dict(mesh_sizes)
    self.live = Liveness.of(jaxpr)
    self.invars = set(jaxpr.invars)
    self.top = {v: graph.tensors.get(((), v)) for v in
                list(jaxpr.invars) + list(self.live.born)}
    self.scalar_args = sum(L.itemsize(t.dtype) for v, t in self.top.items()
                           if v in self.invars and t is not None and not t.shape)

  def bytes(self, t, s) -> float:
    """Bytes one device holds of tensor ``t`` laid out as ``s``."""
    return L.local_bytes(t.shape, t.dtype, s, self.mesh_sizes)

  def of(self, layout_of) -> Memory:
    """The memory under ``layout_of(tensor)`` (a layout per top-level value)."""
    def nb(var):
      t = self.top.get(var)
      return 0.0 if t is None or not t.shape else self.bytes(t, layout_of(t))
    args = self.scalar_args + sum(nb(v) for v in self.invars)
    curve = self.curve_of(nb)
    point = int(np.argmax(curve)) if len(curve) else 0
    act = float(curve[point]) if len(curve) else 0.0
    return Memory(args + act, args, act, point)

  def curve_of(self, nb) -> np.ndarray:
    return self.live.curve(nb)

  def peak_sets(self) -> list[set]:
    """The live sets at the peaks of the replicated program."""
    def nb(var):
      t = self.top.get(var)
      return 0 if t is None or not t.shape else \
          L.itemsize(t.dtype) * int(np.prod(t.shape))
    return [set(self.live.live_at(p)) for p in self.live.peaks(nb)]
