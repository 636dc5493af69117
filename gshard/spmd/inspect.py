"""The ``Lowered`` object: read what the partitioner built.

Follows JAX's AOT convention: ``as_text()`` StableHLO, ``compile()`` a
compiled object (``as_text()``, ``memory_analysis()``, ``cost_analysis()``);
plus ``as_text("jaxpr")`` the per-device program, ``shardings()``,
``collectives()`` and ``explain()``.
"""

from __future__ import annotations

import collections

import jax

from gshard.spmd import infer
from gshard.spmd.partition.context import Choice, Collective
from gshard.spmd.partition.padded import is_padded
from gshard.spmd.sharding import TensorSharding, mesh_str


class Lowered:
  """A partitioned program lowered for one input signature."""

  def __init__(self, partitioned, program, lowered, structs):
    self._p = partitioned
    self._program = program
    self._lowered = lowered
    self._structs = structs

  # -- text ------------------------------------------------------------------
  def as_text(self, dialect: str | None = None) -> str:
    """``"jaxpr"``: the per-device program; default: StableHLO; ``"hlo"``: HLO."""
    if dialect == "jaxpr":
      return str(self.per_device_jaxpr())
    if dialect in (None, "stablehlo", "mlir"):
      return self._lowered.as_text()
    return self._lowered.as_text(dialect=dialect)

  def per_device_jaxpr(self):
    """The body of the shard_map: the program each device runs (a Jaxpr)."""
    # the shard_map of the padded arguments, traced once when it was built
    closed = self._program.per_device()
    eqns = list(closed.jaxpr.eqns)
    while eqns:                    # the shard_map, inside the jit it was traced in
      eqn = eqns.pop(0)
      if eqn.primitive.name == "shard_map":
        return eqn.params["jaxpr"]
      if eqn.primitive.name in ("jit", "pjit"):
        eqns = list(eqn.params["jaxpr"].jaxpr.eqns) + eqns
    return closed.jaxpr

  def compile(self) -> Compiled:
    """XLA-compile the lowered program (``.as_text()``, ``memory_analysis()``,
    ``cost_analysis()``); call it like the partitioned function."""
    if self._p._abstract:
      raise RuntimeError(
          f"{self._p.__name__}.lower(...).compile(): the mesh is an AbstractMesh "
          f"{mesh_str(self._p.mesh_sizes)}, which has no devices to compile for. Inspect "
          "the lowered program (as_text(), collectives(), explain()), or partition over "
          "a concrete mesh (gshard.make_mesh) to compile and run it.")
    return Compiled(self._lowered.compile(), self._p, self._program, self._structs)

  # -- shardings -------------------------------------------------------------
  @property
  def propagation(self):
    """The :class:`ShardingResult` of the global program."""
    return self._program.result

  def shardings(self) -> dict[tuple, TensorSharding]:
    """(scope, var) -> sharding, every variable of the global program."""
    return self._program.result.shardings

  @property
  def in_shardings(self) -> list[TensorSharding]:
    """The layout of each flat input inside the partitioned program."""
    return list(self._program.in_shardings)

  @property
  def out_shardings(self) -> list[TensorSharding]:
    """The layout of each flat output inside the partitioned program."""
    return list(self._program.out_shardings)

  # -- communication -----------------------------------------------------------
  def collectives(self) -> list[Collective]:
    """Every collective of the per-device program, with its cause."""
    return list(self._program.recorder.collectives)

  def choices(self) -> list[Choice]:
    """How each contraction (dot_general, conv) runs per device and the
    alternatives it was chosen among: GShard's options (a) compute where the
    operands are and reshard the result, (b) contract the split dim and keep
    a partial sum, (c) reshard an operand first; each with its bytes."""
    return list(self._program.recorder.choices)

  @property
  def fallbacks(self) -> list[tuple[str, str]]:
    """(primitive, source line) of each equation that took the safe path."""
    return list(self._program.recorder.fallbacks)

  def total_bytes(self) -> int:
    """Bytes one device sends over all collectives of the program."""
    return sum(c.bytes for c in self.collectives())

  @property
  def timings(self) -> dict[str, float]:
    """Seconds spent in trace / propagate / partition set-up / lower."""
    return dict(self._program.timings)

  def explain(self, top: int = 20) -> str:
    """A report a user can act on: largest communication first, with causes
    (the ``top`` largest of each list; None for all)."""
    if top is None:
      top = 1 << 62
    elif isinstance(top, bool) or not isinstance(top, int) or top < 0:
      raise ValueError(f"explain(top={top!r}): give how many entries to list, an int >= 0 "
                       "(or None for all).")
    cols = self.collectives()
    res = self._program.result
    lines = [f"gshard partition report: mesh {mesh_str(res.mesh_sizes)}, "
             f"{len(res.graph.tensors)} values, {len(cols)} collectives, "
             f"{format_bytes(self.total_bytes())} sent per device"]
    by_kind: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for c in cols:
      by_kind[c.kind][0] += 1
      by_kind[c.kind][1] += c.bytes
    if by_kind:
      lines.append("  by kind: " + ", ".join(
          f"{k} x{n} ({format_bytes(b)})" for k, (n, b) in sorted(by_kind.items())))
    lines.append("")
    lines.append("largest communication first:")
    groups: dict[tuple, list[Collective]] = collections.defaultdict(list)
    for c in cols:
      groups[(c.kind, c.axes, c.source, c.primitive, c.role, str(c.src), str(c.dst),
              c.shape, c.dtype)].append(c)
    ranked = sorted(groups.values(), key=lambda g: -sum(c.bytes for c in g))
    for g in ranked[:top]:
      c = g[0]
      total = sum(x.bytes for x in g)
      times = f" x{len(g)}" if len(g) > 1 else ""
      if c.repeat > 1:
        times += f" (x{c.repeat} in a loop)"
      lines.append(f"  {format_bytes(total):>10}  {c.kind}[{','.join(c.axes)}]{times}  "
                   f"{c.src.format(c.shape, c.dtype)} -> {c.dst.format(c.shape, c.dtype)}")
      lines.append(f"              {c.primitive} {c.role} at {c.source}")
      hint = _hint(c)
      if hint:
        lines.append(f"              hint: {hint}")
    if len(ranked) > top:
      lines.append(f"  ... {len(ranked) - top} more")
    lines += _choice_lines(self.choices(), top)
    if self.fallbacks:
      lines.append("")
      lines.append("safe path taken (operands gathered, computed replicated):")
      for prim, where in self.fallbacks:
        lines.append(f"  {prim} at {where}")
    if res.conflicts:
      lines.append("")
      lines.append(f"conflicts settled by propagation ({len(res.conflicts)}):")
      for c in res.conflicts[:10]:
        lines.append(f"  {c}")
      if len(res.conflicts) > 10:
        lines.append(f"  ... {len(res.conflicts) - 10} more")
    return "\n".join(lines)


class Compiled:
  """The compiled partitioned program: jax's ``Compiled``, called like the
  partitioned function (the same argument pytree; laid out as
  ``Lowered.in_shardings``, or it is an error, as for jax). An unevenly split
  input the program keeps padded may also be passed as the plain array it
  was lowered with: it is padded on the way in, as the partitioned function
  does. Called with the flat leaves of the arguments instead, it returns the
  flat leaves of the outputs.

  Attributes:
    compiled: jax's ``Compiled`` (``as_text()``, ``memory_analysis()`` ...,
      which are also reachable on this object).
  """

  def __init__(self, compiled, partitioned=None, program=None, structs=None):
    self.compiled = compiled
    self._p, self._program, self._structs = partitioned, program, structs
    # the flat inputs taken padded (none: a call passes its arguments as they are)
    want = jax.tree_util.tree_leaves(structs, is_leaf=is_padded) if structs else []
    self._pad_at = {i: w for i, w in enumerate(want) if is_padded(w)}
    self._num_leaves = len(want)

  def __call__(self, *args, **kwargs):
    if kwargs and self._p is not None:      # as the partitioned step binds them
      args = infer.bind_positional(self._p.fn, args, kwargs)
    elif kwargs:
      return self.compiled(*args, **kwargs)
    args = self._padded(args)
    try:
      return self.compiled(*args)
    except TypeError:
      args_tree, _ = self.compiled.in_tree.children()
      flat = jax.tree_util.tree_leaves(args)       # a PaddedArray as its data
      if len(flat) != self.compiled.in_tree.num_leaves or \
          jax.tree_util.tree_structure(args) == args_tree:
        raise
    tree = jax.tree_util.tree_unflatten(args_tree, flat)
    return jax.tree_util.tree_leaves(self.compiled(*tree))

  def _padded(self, args):
    """``args`` with each plain array passed where the program takes a padded
    one (the array ``lower`` was given) padded and laid out as the program
    keeps it."""
    if not self._pad_at:
      return args
    leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=is_padded)
    if len(leaves) != self._num_leaves:
      return args
    for i, w in self._pad_at.items():
      x = leaves[i]
      if not is_padded(x) and tuple(getattr(x, "shape", ())) == w.shape:
        leaves[i] = self._p._place_leaf(self._program, i, x)
    return jax.tree_util.tree_unflatten(treedef, leaves)

  def __getattr__(self, name):
    return getattr(self.compiled, name)


def _choice_lines(choices: list[Choice], top: int) -> list[str]:
  """The contractions and lookups that communicate, largest first: the option
  chosen and what each alternative would have sent (why this collective, not
  another)."""
  groups: dict[tuple, list[Choice]] = collections.defaultdict(list)
  for c in choices:
    groups[(c.primitive, c.signature, c.source, c.options)].append(c)
  def sent(g, o):
    return o.bytes * sum(c.repeat for c in g)
  ranked = sorted(groups.values(), key=lambda g: -sent(g, g[0].chosen))
  ranked = [g for g in ranked if any(o.bytes for o in g[0].options)]
  if not ranked:
    return []
  lines = ["", "contractions and lookups: the option chosen, and what the others would send:"]
  for g in ranked[:top]:
    c = g[0]
    times = f" x{len(g)}" if len(g) > 1 else ""
    lines.append(f"  {c.primitive} {c.signature}{times} at {c.source}")
    for o in sorted(c.options, key=lambda o: (not o.chosen, o.bytes)):
      mark = "chosen" if o.chosen else ""
      held = f" (holds {format_bytes(o.memory)} more per device)" if o.memory else ""
      lines.append(f"    {mark:>6} {format_bytes(sent(g, o)):>10}  {o}{held}")
  if len(ranked) > top:
    lines.append(f"  ... {len(ranked) - top} more")
  return lines


def _hint(c: Collective) -> str:
  if c.fallback:
    return "full rematerialisation: annotate this value to avoid the gather"
  if c.kind == "all_gather":
    dims = [i for i, (a, b) in enumerate(zip(c.src.dims, c.dst.dims)) if a != b]
    return (f"dims {dims} are gathered; an annotation keeping them split there "
            "(or splitting the consumer the same way) removes it")
  return ""


def format_bytes(n: float, digits: int = 1) -> str:
  """``format_bytes(1536) == '1.5 KiB'``; below 1 KiB whole bytes (``'7 B'``)."""
  for unit in ("B", "KiB", "MiB"):
    if abs(n) < 1024:
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
    n /= 1024
  return f"{n:.{digits}f} GiB"

