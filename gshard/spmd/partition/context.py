"""What partition rules see: values with their shardings, and a context that
reshards (through ``spmd/reshard.py``, the one place collectives are chosen)
and records every collective with its cause.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from jax.extend.core import get_opaque_trace_state

from gshard.spmd import collectives, exchange, reshard
from gshard.spmd.graph import Graph
from gshard.spmd.sharding import TensorSharding, fit_axes
from gshard.spmd.source import source_of


class PartitionWarning(UserWarning):
  """A primitive took the safe path (operands gathered, computed replicated)."""


@dataclasses.dataclass
class Value:
  """A per-device value inside the shard_map body, with its global shape."""

  x: Any
  sharding: TensorSharding
  shape: tuple[int, ...]
  dtype: Any
  literal: bool = False


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of the per-device program and why it is there.

  Attributes:
    kind: ``all_gather``, ``all_to_all``, ``psum``, ``psum_scatter``,
      ``ppermute``, ``pmax`` ...
    axes: the mesh axes it runs over.
    bytes: bytes sent per device (ring formulas).
    primitive: the equation that needed it.
    role: which of its values: ``operand 0``, ``result 0``, ``output 1`` ...
    src, dst: the value's sharding before and after.
    shape, dtype: the value's global shape and dtype.
    source: the user's file:line.
    fallback: True for a full gather-and-recompute (the safe path).
    repeat: how many times it runs, in loops (a ``scan`` body's ``length``);
      ``bytes`` counts them all.
  """

  kind: str
  axes: tuple[str, ...]
  bytes: int
  primitive: str
  role: str
  src: TensorSharding
  dst: TensorSharding
  shape: tuple[int, ...]
  dtype: str
  source: str
  fallback: bool = False
  repeat: int = 1

  def __str__(self) -> str:
    times = f" (x{self.repeat} in a loop)" if self.repeat > 1 else ""
    return (f"{self.kind}[{','.join(self.axes)}] {self.bytes} B/device{times}  "
            f"{self.src.format(self.shape, self.dtype)} -> "
            f"{self.dst.format(self.shape, self.dtype)}  ({self.primitive} {self.role} "
            f"at {self.source})")


@dataclasses.dataclass(frozen=True)
class Choice:
  """How one contraction or table lookup runs, and the alternatives it was
  chosen among.

  Attributes:
    primitive: ``dot_general``, ``conv_general_dilated``, ``gather`` or
      ``scatter-add``.
    source: the user's file:line.
    signature: operand and result shapes, ``f32[8,128] x f32[128,512] -> f32[8,512]``.
    options: each alternative (``label``, ``bytes`` per device, ``moves``,
      ``chosen``), the chosen one among them.
    repeat: how many times it runs per step (inside a loop of that many trips).
  """

  primitive: str
  source: str
  signature: str
  options: tuple
  repeat: int = 1

  @property
  def chosen(self):
    """The option the partitioner ran."""
    return next(o for o in self.options if o.chosen)


@dataclasses.dataclass
class Recorder:
  """The collectives, safe-path fallbacks and contraction choices of one
  per-device program, in order."""

  collectives: list[Collective] = dataclasses.field(default_factory=list)
  fallbacks: list[tuple[str, str]] = dataclasses.field(default_factory=list)
  choices: list[Choice] = dataclasses.field(default_factory=list)

  def clear(self) -> None:
    """Forget what was recorded (the body is traced again)."""
    self.collectives.clear()
    self.fallbacks.clear()
    self.choices.clear()


def evenize(s: TensorSharding, shape, mesh_sizes) -> TensorSharding:
  """Drop trailing axes of any dim they would split unevenly.

  ``[model]`` on a dim of 30 over model=4 becomes unsplit. jax places arrays
  only with even shardings: this is the layout of an uneven program input or
  output outside the partitioned program (inside, it is padded).
  """
  return TensorSharding(tuple(fit_axes(axes, n, mesh_sizes) for n, axes in zip(shape, s.dims)),
                        s.partial)


class Context:
  """Shared state of one partitioning: graph, mesh, recorder, options.

  Rules reach the interpreter through it: :meth:`run_jaxpr` interprets an inner
  jaxpr (a call's, a loop body's) per device. ``windowed_einsum``: the bytes
  per device of a gathered operand (or a reduce-scattered result) of a
  ``dot_general`` at or above which it runs as a ring of ppermutes
  (``partition/windowed_einsum.py``); ``None``: never.
  """

  def __init__(self, graph: Graph, mesh_sizes: Mapping[str, int], recorder: Recorder,
               strict: bool, interpreter: Callable[..., list],
               windowed_einsum: float | None = None, chunks_first: bool = False,
               mesh=None):
    self.graph = graph
    self.mesh = mesh            # the Mesh or AbstractMesh partitioned over
    self._interpreter = interpreter
    self.mesh_sizes = dict(mesh_sizes)
    self.recorder = recorder
    self.strict = strict
    self.windowed_einsum = windowed_einsum
    self.chunks_first = chunks_first   # collectives on a leading dim (XLA:CPU)
    self.repeat = 1          # trip count of the loops being traced (bytes scale)
    self.enclosing: list = []   # call equations whose inner jaxpr is running
    # (id of a local array, src, dst) -> [(trace, the array, its resharded Value)]
    self._memo: dict[tuple, list] = {}
    # id of a local array -> [(trace, the array, a complete Value resharded from it)]
    self._layouts: dict[int, list] = {}

  def forget(self) -> None:
    """Drop the reshards remembered while tracing (call before and after a trace)."""
    self._memo.clear()
    self._layouts.clear()

  def run_jaxpr(self, jaxpr, scope: tuple, consts, args: list[Value]) -> list[Value]:
    """Interpret ``jaxpr`` (in ``scope``) on per-device values; its outputs' values."""
    return self._interpreter(self, jaxpr, scope, consts, args)

  def source(self, eqn) -> str:
    """The user's file:line of ``eqn``; for an equation inside a library's
    jitted function (``jnp.fft.fft``), whose own traceback has no user frame,
    that of the innermost enclosing call that has one."""
    if eqn is None:
      return "program output"
    for e in [eqn, *reversed(self.enclosing)]:
      where = source_of(e)
      if where:
        return where
    return "<unknown source>"

  # -- shardings ------------------------------------------------------------
  def target(self, scope, var) -> TensorSharding:
    """The propagated sharding of ``var``, as the runtime holds it."""
    t = self.graph.tensors.get((scope, var))
    shape = tuple(getattr(var.aval, "shape", ()))
    if t is None:
      return TensorSharding.replicated(len(shape))
    return t.sharding

  def all_replicated(self, eqn, ins: list[Value], scope) -> bool:
    """Whether every operand arrives, and every result is wanted, whole on
    every device (a third of a train step's equations: scalars, the
    optimizer's replicated state): its local plan is the op itself."""
    for v in ins:
      if not v.literal and (v.sharding.partial or any(v.sharding.dims)):
        return False
    for var in eqn.outvars:
      if type(var).__name__ != "DropVar":
        t = self.target(scope, var)
        if t.partial or any(t.dims):
          return False
    return True

  # -- communication --------------------------------------------------------
  def reshard(self, v: Value, dst: TensorSharding, eqn, role: str) -> Value:
    """``v`` laid out as ``dst``; collectives recorded against ``eqn``.

    A reshard never creates a pending sum: ``dst``'s pending axes that ``v``
    does not have are dropped (propagation may keep a sum pending over an
    axis whose uneven split :func:`evenize` removed, so the local op never
    produced it).
    """
    if dst.partial - v.sharding.partial:
      dst = dst.with_partial(dst.partial & v.sharding.partial)
    if v.literal or v.sharding == dst:
      return dataclasses.replace(v, sharding=dst) if v.literal else v
    # One reshard per (value, layout) in a trace: every later consumer of the
    # same layout reuses it (and no collective is recorded twice); a layout
    # that slices one the value was already gathered to is cut from that one.
    return self.once(("reshard", v.sharding, dst), v.x,
                     lambda: self._reshard(self._gathered(v, dst), dst, eqn, role, v.x))

  def held_layouts(self, v: Value) -> frozenset:
    """The layouts ``v``'s local array was already resharded to in this trace
    (complete values): a reshard to one of them is the earlier copy."""
    seen = self._layouts.get(id(v.x))
    if not seen or v.literal or v.sharding.partial:
      return frozenset()
    trace = get_opaque_trace_state()
    return frozenset(out.sharding for seen_trace, seen_x, out in seen
                     if seen_x is v.x and seen_trace == trace)

  def _gathered(self, v: Value, dst: TensorSharding) -> Value:
    """An earlier reshard of ``v`` in this trace that ``dst`` only slices (a
    forward pass's gathered activation, read again in the backward pass
    split less than it arrived); else ``v``. The gathered copy is reused,
    as a reshard to its own layout is."""
    seen = self._layouts.get(id(v.x))
    if not seen or dst.partial or v.sharding.partial or not reshard.plan_reshard(
        v.sharding, dst, v.shape, v.dtype, self.mesh_sizes).collectives:
      return v                   # (slicing the value itself holds no copy)
    trace = get_opaque_trace_state()
    for seen_trace, seen_x, out in seen:
      if (seen_x is v.x and seen_trace == trace
          and reshard.cut_from(out.sharding, dst, v.shape, v.dtype, self.mesh_sizes)):
        return out
    return v

  def _reshard(self, v: Value, dst: TensorSharding, eqn, role: str, origin=None) -> Value:
    plan = exchange.plan_move(v.sharding, dst, v.shape, v.dtype, self.mesh_sizes)
    src_name = self.source(eqn)
    prim = eqn.primitive.name if eqn is not None else "output"
    # the steps another move of this block began with are run (and recorded) once
    x, shared = collectives.apply_plan_sharing(v.x, plan, v.shape, self.mesh_sizes,
                                               self.chunks_first, self._done(v))
    for step in plan.steps[shared:]:
      if step.kind in ("slice", "pad", "local"):
        continue
      self.recorder.collectives.append(Collective(        # (an exchange's rounds: ppermutes)
          "ppermute" if step.kind == "exchange" else step.kind, tuple(step.axes),
          int(step.bytes_per_device) * self.repeat, prim,
          role,
          v.sharding, dst, tuple(v.shape), str(np.dtype(v.dtype)) if _is_np(v.dtype)
          else str(v.dtype), src_name, bool(plan.fallback), self.repeat))
    out = Value(x, dst, v.shape, v.dtype)
    if origin is not None and not dst.partial and not v.sharding.partial:
      self._layouts.setdefault(id(origin), []).append((get_opaque_trace_state(), origin, out))
    return out

  def _done(self, v: Value) -> dict:
    """The steps already run on ``v``'s block in this trace, each prefix of a
    plan to its result (see :func:`collectives.apply_plan_sharing`)."""
    return self.once(("steps run", v.sharding, tuple(v.shape), str(v.dtype)), v.x, dict)

  def once(self, key: tuple, x, make: Callable[[], Any]) -> Any:
    """``make()``, computed once per (``key``, local array ``x``, trace) and
    reused after: what a rule derives from ``x`` by collectives (a reshard,
    a windowed einsum's ring of blocks) is sent and recorded once. Keyed by
    the trace too: a scan / cond body must not reuse (or leak) another
    trace's value."""
    key, trace = (id(x), *key), get_opaque_trace_state()
    for seen_trace, seen_x, out in self._memo.get(key, ()):
      if seen_x is x and seen_trace == trace:
        return out
    out = make()
    self._memo.setdefault(key, []).append((trace, x, out))   # keeps x alive: ids stay unique
    return out

  def record(self, kind: str, axes, nbytes: int, eqn, role: str, src: TensorSharding,
             dst: TensorSharding, shape, dtype) -> None:
    """Record a collective a rule emits itself (a halo ppermute, a pmax), sent
    ``nbytes`` per device, against ``eqn``."""
    self.recorder.collectives.append(Collective(
        kind, tuple(axes), int(nbytes) * self.repeat, eqn.primitive.name, role, src, dst,
        tuple(shape), str(dtype), self.source(eqn), repeat=self.repeat))

  def note_choice(self, eqn, options, ins: list[Value], results) -> None:
    """Record how contraction or lookup ``eqn`` runs among ``options`` (for ``explain()``):
    its operands as they arrive, its results as the chosen option makes them."""
    sig = " x ".join(v.sharding.format(v.shape, v.dtype) for v in ins) + " -> " + ", ".join(
        s.format(v.aval.shape, v.aval.dtype) for s, v in zip(results, eqn.outvars))
    self.recorder.choices.append(Choice(eqn.primitive.name, self.source(eqn), sig,
                                        tuple(options), self.repeat))

  def fallback(self, eqn, why: str, gathered: bool = True) -> None:
    """Report the safe path. ``gathered``: some operand is not replicated, so the
    safe path moves data; under ``strict=True`` that is an error. An equation
    whose operands are all replicated already loses nothing: it only warns."""
    where = self.source(eqn)
    name = eqn.primitive.name
    if not gathered:
      msg = (f"gshard: no partition rule for {name} ({why}) at {where}: it is computed "
             "replicated; its operands are already replicated, so nothing is gathered.")
    elif self.strict:
      raise NotImplementedError(
          f"gshard: no partition rule for {name} ({why}) at {where}: the safe path would "
          "gather its operands and compute it replicated, and strict=True forbids that. "
          f"Replicate {name}'s operands yourself (gshard.replicate) to accept the "
          "gather, or pass strict=False to let gshard take the safe path with a warning.")
    else:
      msg = (f"gshard: no partition rule for {name} ({why}) at {where}: its operands are "
             "gathered and it is computed replicated. Pass strict=True to make this an "
             "error.")
    self.recorder.fallbacks.append((name, where))
    warnings.warn(msg, PartitionWarning, stacklevel=2)

  # -- device coordinates ---------------------------------------------------
  def linear_index(self, axes) -> Any:
    """This device's index along ``axes`` (major first), as a traced int32."""
    return collectives.linear_axis_index(tuple(axes), self.mesh_sizes)

  def num_shards(self, axes) -> int:
    """How many blocks ``axes`` cut a dim into."""
    return math.prod(self.mesh_sizes[a] for a in axes)


def _is_np(dtype) -> bool:
  try:
    np.dtype(dtype)
    return True
  except TypeError:
    return False

