"""``gshard.coverage``: which primitives of a program gshard partitions, and how.

Every equation of the traced program (nested jaxprs included) is counted by
primitive, and each primitive is classified by the two rule tables:

- **sharding rule**: whether propagation knows it (``spmd/rules``). Without
  one, its result is not linked to its operands.
- **partition rule**: ``generic`` (the factor-based rule: the primitive on
  local shapes), ``specific`` (a rule of its own: offsets, masks, an inner
  jaxpr, a cross-device combine; the rule's name is shown), or ``safe path``
  (operands gathered, computed replicated, with a ``PartitionWarning``).

With a ``mesh``, the program is also propagated and partitioned (traced, not
lowered), and the equations that actually took the safe path are listed with
their source lines.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from collections.abc import Callable


from gshard.spmd import registry
from gshard.spmd.graph import source_of, sub_jaxprs
from gshard.spmd.partition.api import partition
from gshard.spmd.partition.context import PartitionWarning
from gshard.spmd.tracing import trace
from gshard.spmd.partition.padded import logical_args
from gshard.spmd.sharding import mesh_scope, mesh_sizes_of, mesh_str

GENERIC, SPECIFIC, SAFE = registry.GENERIC, "specific", registry.SAFE


@dataclasses.dataclass(frozen=True)
class PrimitiveCoverage:
  """How gshard handles one primitive of the program.

  Attributes:
    primitive: its name, e.g. ``dot_general``.
    count: its equations in the program, nested jaxprs included.
    sharding_rule: whether propagation has a rule for it.
    partition: ``"generic"``, ``"specific"`` or ``"safe path"``.
    rule: the partition rule's function name (``gather_rule``, ``safe_rule``).
    sources: the distinct source lines it comes from, program order.
    fell_back: source lines where partitioning took the safe path (with a mesh).
  """

  primitive: str
  count: int
  sharding_rule: bool
  partition: str
  rule: str
  sources: tuple[str, ...]
  fell_back: tuple[str, ...] = ()

  @property
  def safe(self) -> bool:
    """Whether any equation of this primitive takes (or would take) the safe path."""
    return self.partition == SAFE or bool(self.fell_back)


@dataclasses.dataclass(frozen=True)
class Coverage:
  """The primitives of a program and how each is propagated and partitioned.

  ``print(cov)`` shows a table; ``cov["gather"]`` one row; ``cov.safe_path``
  the primitives that fall back. ``fallbacks`` is ``None`` without a mesh,
  else the ``(primitive, source)`` of each equation that took the safe path.
  """

  primitives: tuple[PrimitiveCoverage, ...]
  mesh: str | None = None
  fallbacks: tuple[tuple[str, str], ...] | None = None

  def __getitem__(self, name: str) -> PrimitiveCoverage:
    for p in self.primitives:
      if p.primitive == name:
        return p
    raise KeyError(f"{name!r} is not a primitive of this program; it has "
                   f"{sorted(p.primitive for p in self.primitives)}")

  def __contains__(self, name: str) -> bool:
    return any(p.primitive == name for p in self.primitives)

  @property
  def num_equations(self) -> int:
    """Equations of the program, nested jaxprs included."""
    return sum(p.count for p in self.primitives)

  @property
  def safe_path(self) -> list[str]:
    """Names of the primitives that take the safe path somewhere."""
    return [p.primitive for p in self.primitives if p.safe]

  def __str__(self) -> str:
    safe = self.safe_path
    head = (f"gshard coverage: {len(self.primitives)} primitives, "
            f"{self.num_equations} equations"
            + (f", mesh {self.mesh}" if self.mesh else "")
            + (f"; {len(safe)} take the safe path" if safe else
               "; none takes the safe path"))
    width = max([len("primitive")] + [len(p.primitive) for p in self.primitives])
    lines = [head, f"  {'primitive':<{width}}  {'count':>5}  sharding  partition"]
    for p in self.primitives:
      part = p.partition if p.partition != SPECIFIC else f"{SPECIFIC} ({p.rule})"
      if p.fell_back and p.partition != SAFE:
        part += f", safe path x{len(p.fell_back)}"
      mark = "!" if p.safe else " "
      lines.append(f"{mark} {p.primitive:<{width}}  {p.count:>5}  "
                   f"{'yes' if p.sharding_rule else 'NO':<8}  {part}")
    if safe:
      lines.append("")
      lines.append("safe path (operands gathered, computed replicated):")
      for p in self.primitives:
        if p.safe:
          where = p.fell_back or p.sources
          more = f" (+{len(where) - 3} more)" if len(where) > 3 else ""
          lines.append(f"  {p.primitive}: {'; '.join(where[:3])}{more}")
    return "\n".join(lines)


def _equations(jaxpr, outer_source: str = ""):
  """Every equation with its source line (inner ones inherit their caller's)."""
  for eqn in jaxpr.eqns:
    src = source_of(eqn) or outer_source
    yield eqn, src
    for _, inner in sub_jaxprs(eqn.params):
      yield from _equations(inner, src)


def classify(name: str) -> tuple[str, str]:
  """(partition kind, rule name) of a primitive, read from the registry."""
  entry = registry.entry(name)
  if entry is None or entry.kind == SAFE:
    return SAFE, "safe_rule"
  if entry.kind == GENERIC:
    return GENERIC, "generic_rule"
  return SPECIFIC, entry.rule_name


def coverage(fn: Callable, *args, mesh=None, in_specs=None) -> Coverage:
  """List the primitives of ``fn(*args)`` and how gshard partitions each.

  Args:
    fn: the function, as given to ``gshard.partition``.
    *args: its positional arguments: arrays or ``jax.ShapeDtypeStruct``s.
    mesh: optional ``Mesh`` / ``AbstractMesh``. With one, the program is also
      propagated and partitioned (traced only) to find the equations
      that actually take the safe path.
    in_specs: as for ``gshard.partition``; used only with ``mesh``.

  Returns:
    A :class:`Coverage`: rows sorted with the safe path first, then by count.

  Example::

    >>> print(gshard.coverage(train_step, params, x, y))
    gshard coverage: 31 primitives, 154 equations; none takes the safe path
      primitive     count  sharding  partition
      mul              28  yes       generic
      ...
  """
  if mesh is None:
    closed = trace(fn, logical_args(args))[0]     # as gshard.partition traces it
    fallbacks = None
  else:
    prog = partition(fn, mesh, in_specs=in_specs).program(*args)
    with warnings.catch_warnings(), mesh_scope(mesh):
      warnings.simplefilter("ignore", PartitionWarning)
      prog.per_device()   # runs the partition rules (on padded shapes)
    closed = prog.result.jaxpr
    fallbacks = tuple(prog.recorder.fallbacks)
  counts: collections.Counter = collections.Counter()
  sources: dict[str, dict[str, None]] = collections.defaultdict(dict)
  for eqn, src in _equations(closed.jaxpr):
    name = eqn.primitive.name
    counts[name] += 1
    sources[name].setdefault(src, None)
  fell: dict[str, list[str]] = collections.defaultdict(list)
  for name, src in fallbacks or ():
    fell[name].append(src)
  rows = []
  for name, n in counts.items():
    partition_kind, rule = classify(name)
    rows.append(PrimitiveCoverage(name, n, registry.sharding_rule(name) is not None,
                                  partition_kind, rule,
                                  tuple(sources[name]), tuple(fell.get(name, ()))))
  rows.sort(key=lambda r: (not r.safe, -r.count, r.primitive))
  where = mesh_str(mesh_sizes_of(mesh)) if mesh is not None else None
  return Coverage(tuple(rows), where, fallbacks)
