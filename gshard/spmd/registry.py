"""The one table of primitives: how each propagates and how each runs per device.

Registering a primitive states both of its rules in one call::

  register("dot_general", dot_general_rule)                       # generic partition
  register("gather", gather_rule, partition=indexing.gather_rule)  # a rule of its own
  register("scatter", scatter_rule, partition=SAFE)               # gathered, with a warning

- the **sharding rule** (``spmd/rules/X.py``) is a pure function of avals and
  params returning a ``FactorRule`` or an ``OpRule``: propagation reads it;
- the **partition rule** is :data:`GENERIC` (the primitive itself on local
  shapes, driven by the same factor rule: ``spmd/partition/generic.py``), a
  function ``rule(ctx, eqn, operands, scope, idx) -> results`` of its own
  (``spmd/partition/X.py``), or :data:`SAFE` (operands gathered, computed
  replicated, with a ``PartitionWarning``).

Lookups are dict lookups by primitive name. ``gshard.coverage`` reads this
table too. Importing ``gshard.spmd`` registers every family.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Union

GENERIC = "generic"
SAFE = "safe path"

PartitionRule = Callable[..., list]
PartitionEntry = Union[str, PartitionRule]   # GENERIC, SAFE or a function


@dataclasses.dataclass(frozen=True)
class Entry:
  """A registered primitive.

  Attributes:
    name: the primitive's name (``eqn.primitive.name``).
    sharding: its sharding rule.
    partition: :data:`GENERIC`, :data:`SAFE` or its own partition rule.
  """

  name: str
  sharding: Callable[..., Any]
  partition: PartitionEntry

  @property
  def kind(self) -> str:
    """``"generic"``, ``"safe path"`` or ``"specific"``."""
    return self.partition if isinstance(self.partition, str) else "specific"

  @property
  def rule_name(self) -> str:
    """The partition rule's function name (``gather_rule``), or the kind."""
    if isinstance(self.partition, str):
      return self.partition
    fn = getattr(self.partition, "func", self.partition)   # functools.partial
    return getattr(fn, "__name__", type(fn).__name__)


table: dict[str, Entry] = {}


def register(names: str, sharding: Callable[..., Any], *,
             partition: PartitionEntry = GENERIC) -> None:
  """Register each primitive of the space-separated ``names`` with both rules."""
  if not (partition in (GENERIC, SAFE) or callable(partition)):
    raise ValueError(f"register({names!r}): partition must be GENERIC, SAFE or a "
                     f"function, got {partition!r}")
  for name in names.split():
    table[name] = Entry(name, sharding, partition)
  _rule_memo.cache_clear()


def sharding_rule(name: str) -> Callable[..., Any] | None:
  """The sharding rule of primitive ``name``, or None (no rule: unconstrained)."""
  entry = table.get(name)
  return entry.sharding if entry is not None else None


def rule_of(eqn) -> Any:
  """What ``eqn``'s sharding rule returns for its avals and params (None: no
  rule; a rule's ``NotImplementedError`` passes through). Memoised on them: a
  model's repeated layers build each rule once."""
  name = eqn.primitive.name
  if name not in table:
    return None
  key = (name, tuple(v.aval for v in eqn.invars), tuple(v.aval for v in eqn.outvars),
         tuple(sorted(eqn.params.items())))
  try:
    hash(key)
  except TypeError:            # a parameter jax cannot hash (an array): build anew
    return _rule(*key)
  return _rule_memo(*key)


def _rule(name, in_avals, out_avals, params):
  return table[name].sharding(list(in_avals), list(out_avals), **dict(params))


_rule_memo = functools.lru_cache(maxsize=1 << 14)(_rule)


def entry(name: str) -> Entry | None:
  """The registered :class:`Entry` of primitive ``name``, or None."""
  return table.get(name)
