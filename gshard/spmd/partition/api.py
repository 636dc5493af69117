"""``gshard.partition``: trace, propagate, partition, run under shard_map + jit.

Building the program for one input signature is a few named steps
(:meth:`Partitioned._build`): analyze (trace + pin + propagate, shared with
``infer_shardings`` and ``coverage``), the state pairing and the boundary
layouts, the per-device body and its ``shard_map``.

Running it is one ``jax.jit`` of the argument pytree (:meth:`Partitioned._run`),
so jax's C++ dispatch looks the executable up (tree, shapes, dtypes, weak
types, layouts) with no Python work per leaf. The expensive steps run when jax
traces: ``_run`` finds (or builds) the :class:`Program` for the logical
signature and calls its ``shard_map``. Before anything heavy, a trace whose
state arrives off the mesh (numpy, a Python scalar) or unpadded raises
:class:`_Place`; ``__call__`` lays those leaves out as the program keeps
them and dispatches again: every later step hits that compiled program.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import Literal, jaxpr_as_fun
from jax.sharding import AbstractMesh, NamedSharding

from gshard.spmd import _gc, collectives, infer
from gshard.spmd.hoist import gather_early
from gshard.spmd.infer import ShardingResult, analyze, flatten_specs, pair_state, spec_to_pin
from gshard.spmd.inspect import Lowered
from gshard.spmd.partition import derivative, nans
from gshard.spmd.partition.checks import check_donate, check_donated_alias, check_windowed
from gshard.spmd.partition.context import Context, Recorder, Value, evenize
from gshard.spmd.partition.interpret import run_jaxpr
from gshard.spmd.partition.padded import (PaddedArray, batched, elsewhere,
                                          is_padded, pad_to, traced)
from gshard.spmd.sharding import (TensorSharding, mesh_sizes_of, mesh_str, short_dtype,
                                   mesh_scope, require_mesh, with_auto_axes)


@dataclasses.dataclass
class Program:
  """Everything built for one (logical) input signature of a :class:`Partitioned`.

  Attributes:
    result: what propagation found (the global program and every sharding).
    in_shardings, out_shardings: the layouts of the flat inputs and outputs
      inside the partitioned program (uneven dims padded).
    out_tree: the outputs' tree structure.
    shard_fn: the ``shard_map`` of the per-device body (padded inputs).
    recorder: every collective and safe-path fallback (filled when traced).
    timings: seconds per phase (trace, propagate, partition_setup, lower).
    flat_avals: logical shape, dtype and weak type of each flat input.
    in_place: the even layout a plain (not padded) input is placed with.
    out_avals: logical shape and dtype of each flat output.
    pairs: flat output -> the flat input it is the next value of (state).
    padded_out: the flat outputs returned as :class:`PaddedArray`.
    mesh_sizes: mesh axis name -> size.
    mesh: the mesh (a plain input is padded on it, in its even layout).
  """

  result: ShardingResult
  in_shardings: list[TensorSharding]
  out_shardings: list[TensorSharding]
  out_tree: Any
  shard_fn: Callable
  recorder: Recorder
  timings: dict[str, float]
  flat_avals: list[jax.ShapeDtypeStruct]
  in_place: list[TensorSharding]
  out_avals: list[jax.ShapeDtypeStruct]
  pairs: dict[int, int]
  padded_out: list[bool]
  mesh_sizes: dict[str, int]
  mesh: Any
  _traced: Any = None

  def per_device(self):
    """The per-device program's ``shard_map`` as a ``ClosedJaxpr`` of the padded
    inputs, traced on first use (the partition rules run then) inside a
    ``jax.jit``: a later trace (``lower()``) binds that one call, not each equation."""
    if self._traced is None:
      t0 = time.perf_counter()
      with _gc.paused():
        self._traced = jax.make_jaxpr(jax.jit(self.shard_fn))(*[
            jax.ShapeDtypeStruct(self.padded_shape(i), a.dtype, weak_type=a.weak_type)
            for i, a in enumerate(self.flat_avals)])
      self.timings["partition_setup"] = (self.timings.get("partition_setup", 0.0)
                                         + time.perf_counter() - t0)
    return self._traced

  @property
  def state_inputs(self) -> frozenset[int]:
    """Flat inputs whose next value the program returns, kept padded between
    steps where split unevenly: any but a typed PRNG key array, which
    ``jax.random`` reads only as its own type (it leaves evenly, as any
    other output)."""
    return frozenset(i for i in self.pairs.values()
                     if not collectives.is_key(self.flat_avals[i].dtype))

  def padded_shape(self, i: int) -> tuple[int, ...]:
    """Input ``i``'s global shape inside the program (uneven dims padded)."""
    return self.in_shardings[i].padded_shape(self.flat_avals[i].shape, self.mesh_sizes)

  def padded_in(self, i: int) -> bool:
    """Whether input ``i`` is split unevenly inside the program."""
    return self.padded_shape(i) != tuple(self.flat_avals[i].shape)

  def apply(self, xs, padded_forms):
    """Run on the flat inputs (padded data where ``padded_forms``), inside jit."""
    ins = []
    for i, (x, form) in enumerate(zip(xs, padded_forms)):
      full, shape = self.padded_shape(i), tuple(self.flat_avals[i].shape)
      if form and tuple(x.shape) != full:       # padded for another layout
        x = x[tuple(slice(0, n) for n in shape)]
      if tuple(x.shape) != full:
        x = collectives.pad_zeros(x, [(0, f - n) for f, n in zip(full, x.shape)])
        # padded in the even layout it came in, fenced off from the move into
        # the padded layout: XLA (jaxlib 0.10.2) fused the pad into that move
        # and got it wrong (a concatenate with the padded block read garbage;
        # found by the fuzzer)
        x = jax.lax.optimization_barrier(jax.lax.with_sharding_constraint(
            x, NamedSharding(self.mesh, self.in_place[i].to_spec())))
      ins.append(x)
    outs = jaxpr_as_fun(self.per_device())(*ins)
    # an output is uneven only as padded state: any other leaves evenly (_boundary)
    res = [PaddedArray(o, tuple(a.shape)) if padded else o
           for o, a, padded in zip(outs, self.out_avals, self.padded_out)]
    return jax.tree_util.tree_unflatten(self.out_tree, res)


class _Place(Exception):
  """Raised while jax traces, before any heavy work: the state leaves ``need``
  must first be laid out as the program keeps them."""

  def __init__(self, program: Program, need: list[int]):
    super().__init__(f"state inputs {need} are laid out before the call")
    self.program, self.need = program, need


def _body(ctx: Context, result: ShardingResult, in_sh, out_sh, avals, out_leaves):
  """The per-device program: interpret the jaxpr on local blocks, then bring each
  output to its layout (a literal output is broadcast to its local shape)."""
  closed = result.jaxpr

  def body(*xs):
    ctx.recorder.clear()
    ctx.forget()
    vals = [Value(x, s, tuple(a.shape), a.dtype) for x, s, a in zip(xs, in_sh, avals)]
    try:
      outs = ctx.run_jaxpr(closed.jaxpr, (), closed.consts, vals)
      res = []
      for j, (o, s) in enumerate(zip(outs, out_sh)):
        if o.literal:
          leaf = out_leaves[j]
          res.append(jax.numpy.broadcast_to(_literal(o.x, leaf),
                                            s.local_shape(leaf.shape, ctx.mesh_sizes)))
        else:
          res.append(ctx.reshard(o, s, None, f"output {j}").x)
    finally:
      ctx.forget()
    return tuple(res)
  return body


def _literal(val, leaf):
  """A literal output as jax.jit returns it: a Python number the function
  returned stays weakly typed (``bf16_w * metrics["lr"]`` stays bf16)."""
  if leaf.weak_type:
    y = jax.numpy.asarray(np.asarray(val).item())
    if y.dtype == leaf.dtype:
      return y
  return jax.numpy.asarray(val, leaf.dtype)


def _shape_str(a) -> str:
  return f"{short_dtype(a.dtype)}[{','.join(map(str, a.shape))}]"


class Partitioned:
  """A function partitioned over a mesh; call it like the original.

  ``step(*args)`` runs the per-device program and returns global arrays (a
  :class:`PaddedArray` for state kept split unevenly); ``step.lower(*args)``
  inspects it. Each input signature (tree, shapes, dtypes, weak types) is
  partitioned once; jax compiles it once per input layout, as ``jax.jit`` does.
  """

  def __init__(self, fn: Callable, mesh, in_specs=None, out_specs=None,
               strict: bool = False, donate_argnums: Sequence[int] | int = (), *,
               windowed_einsum: float | None = None):
    if not isinstance(strict, bool):
      raise TypeError(f"strict must be True or False, got {strict!r} "
                      f"({type(strict).__name__}). strict=True raises where a primitive "
                      "without a partition rule would gather its operands.")
    self.fn = fn
    self.mesh = mesh = with_auto_axes(require_mesh(mesh))
    self.mesh_sizes = mesh_sizes_of(mesh)
    self.in_specs = in_specs
    self.out_specs = out_specs
    self.strict = strict
    self.windowed_einsum = check_windowed(windowed_einsum)
    self.donate_argnums = check_donate(donate_argnums)
    self._abstract = isinstance(mesh, AbstractMesh)
    self._mesh_type = mesh if self._abstract else mesh.abstract_mesh
    self._cache: dict[tuple, Program] = {}
    self._local = threading.local()     # .placing: a dispatch of laid-out state
    self.pairs_override: dict[int, int] | None = None   # derivative.py's jvp program
    self.reads_tracers = False     # a program built reads traced values fn closes over
    self._jvps: dict = {}
    self.__wrapped__ = fn
    self.__name__ = getattr(fn, "__name__", "partitioned")

    def run(*args):
      return self._run(*args)
    run.__name__ = run.__qualname__ = self.__name__
    self._jit = jax.jit(run, donate_argnums=self.donate_argnums)

  # -- building -------------------------------------------------------------
  def program(self, *args) -> Program:
    """The :class:`Program` for this input signature, built once and cached.

    ``args`` may be arrays, ``ShapeDtypeStruct``s, :class:`PaddedArray`s or
    scalars; the key is the tree, jax's trace-time settings and each leaf's
    logical shape, dtype and weak type (``jax.typeof(0)`` is a weak ``int32``)."""
    leaves, treedef = jax.tree_util.tree_flatten(tuple(args), is_leaf=is_padded)
    with mesh_scope(self.mesh):
      return self._program(leaves, treedef)

  def _program(self, leaves, treedef) -> Program:
    structs = infer.structs_of(self.fn, self.__name__, leaves, treedef)
    key = (treedef, infer.config_key(), tuple((tuple(s.shape), str(s.dtype),
                                               bool(s.weak_type)) for s in structs))
    prog = self._cache.get(key)
    if prog is None:
      # traced on the arguments as given, a PaddedArray as the array it stands
      # for (tracing.trace retries a layout jax refuses as the one-device program)
      args = jax.tree_util.tree_unflatten(
          treedef, [s if is_padded(x) else x for x, s in zip(leaves, structs)])
      with _gc.paused():
        prog = self._build(args, jax.tree_util.tree_unflatten(treedef, structs), structs)
      self._cache[key] = prog
    return prog

  def _build(self, args, logical_args, avals) -> Program:
    try:
      result = analyze(self.fn, self.mesh_sizes, args, self.in_specs, self.out_specs)
    except ValueError as e:
      if self.out_specs is None or not str(e).startswith("out_specs must be"):
        raise
      fn = infer.with_keywords(self.fn, logical_args, None)[0]
      outs = jax.tree_util.tree_map(_shape_str, jax.eval_shape(fn, *logical_args))
      raise ValueError(
          f"out_specs={self.out_specs} does not fit what {self.__name__} returns: "
          f"{str(outs).replace(chr(39), '')}. Give one entry per output in that "
          "structure (None leaves them to propagation), or one PartitionSpec for all "
          f"of them, on mesh {mesh_str(self.mesh_sizes)}.") from None
    self.reads_tracers |= any(isinstance(c, jax.core.Tracer) for c in result.jaxpr.consts)
    timings = dict(result.timings)
    t0 = time.perf_counter()
    out_leaves, out_tree = jax.tree_util.tree_flatten(result.out_shape)
    pairs = (pair_state(logical_args, result.out_shape) if self.pairs_override is None
             else self.pairs_override)
    in_sh, out_sh, padded_out = self._boundary(result, out_leaves, pairs)
    gather_early(result.graph, out_sh)
    ctx = Context(result.graph, self.mesh_sizes, Recorder(), self.strict, run_jaxpr,
                  self.windowed_einsum, collectives.chunks_first(self.mesh), mesh=self.mesh)
    shard_fn = jax.shard_map(_body(ctx, result, in_sh, out_sh, avals, out_leaves),
                             mesh=self.mesh,
                             in_specs=tuple(s.to_spec() for s in in_sh),
                             out_specs=tuple(s.to_spec() for s in out_sh),
                             check_vma=False)
    in_place = [evenize(s, a.shape, self.mesh_sizes) for s, a in zip(in_sh, avals)]
    timings["partition_setup"] = time.perf_counter() - t0
    return Program(result, in_sh, out_sh, out_tree, shard_fn, ctx.recorder, timings,
                   list(avals), in_place, list(out_leaves), pairs, padded_out,
                   self.mesh_sizes, self.mesh)

  def _boundary(self, result: ShardingResult, out_leaves, pairs):
    """The layouts of the program's flat inputs and outputs (no pending sums),
    and which outputs come back as :class:`PaddedArray`.

    An output with an ``out_specs`` entry takes it; one that is the next value
    of an input (``pairs``) takes that input's layout, so state keeps its
    layout from step to step, unless an annotation on the returned value
    fixes another; any other takes its propagated sharding. A
    state output split unevenly comes back padded (:class:`PaddedArray`), so
    it stays split (but a typed PRNG key array, which ``jax.random`` must
    read as one); any other uneven output leaves the program in the even
    layout nearest its sharding (``evenize``: the axes that would split a dim
    unevenly dropped), resharded inside the program."""
    jaxpr = result.jaxpr.jaxpr
    in_sh = [result.sharding(v).without_partial() for v in jaxpr.invars]
    _, _, specs = flatten_specs(self.out_specs, result.out_shape, "out_specs")
    out_sh, padded = [], []
    for j, (var, leaf, spec) in enumerate(zip(jaxpr.outvars, out_leaves, specs)):
      t = None if isinstance(var, Literal) else result.graph.tensors.get(((), var))
      if spec is not None:
        s = spec_to_pin(spec, leaf.shape, self.mesh_sizes, "out_specs")[0]
      elif j in pairs and not (t is not None and t.fixed):
        s = in_sh[pairs[j]]
      elif not isinstance(var, Literal):
        s = result.sharding(var).without_partial()
      else:
        s = TensorSharding.replicated(len(leaf.shape))
      state = (j in pairs and not s.is_even(leaf.shape, self.mesh_sizes)
               and not collectives.is_key(leaf.dtype))
      # not state: even inside (XLA's reshard of a sliced padded output crashed)
      out_sh.append(s if state else evenize(s, leaf.shape, self.mesh_sizes))
      padded.append(state)
    return in_sh, out_sh, padded

  # -- running --------------------------------------------------------------
  def _run(self, *args):
    """What ``jax.jit`` traces: the program for these arguments, on their tracers."""
    leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=is_padded)
    self._check_arity(len(args))
    prog = self._program(leaves, treedef)
    if not getattr(self._local, "placing", False):
      need = [i for i in sorted(prog.state_inputs) if not self._in_place(prog, i, leaves[i])]
      if need:
        raise _Place(prog, need)
    flat = [x.data if is_padded(x) else x for x in leaves]
    return prog.apply(flat, [is_padded(x) for x in leaves])

  def _in_place(self, prog: Program, i: int, x) -> bool:
    """Whether state input ``i`` arrives as the program keeps it: on this mesh,
    and padded if it is split unevenly."""
    if prog.padded_in(i) and not is_padded(x):
      return False
    return jax.typeof(x.data if is_padded(x) else x).sharding.mesh == self._mesh_type

  def _check_arity(self, n: int) -> None:
    bad = [d for d in self.donate_argnums if d >= n]
    if bad:
      raise ValueError(
          f"donate_argnums={self.donate_argnums} names argument {bad[0]}, but "
          f"{self.__name__} was called with {n} positional argument(s) (positions "
          f"0..{n - 1}). Pass donate_argnums only for arguments the call has.")

  def _place_leaf(self, prog: Program, i: int, x):
    """State input ``i`` laid out as the program keeps it (padded if uneven)."""
    s = prog.in_shardings[i]
    if prog.padded_in(i):
      full = prog.padded_shape(i)
      sharding = NamedSharding(self.mesh, s.to_spec())
      if is_padded(x) and tuple(x.data.shape) == full:
        return PaddedArray(jax.device_put(x.data, sharding), x.shape)
      return pad_to(x.logical() if is_padded(x) else x, full, sharding)
    value = x.logical() if is_padded(x) else x
    return jax.device_put(value, NamedSharding(self.mesh, prog.in_place[i].to_spec()))

  def _placed(self, args, prog: Program, need) -> tuple:
    """``args`` with the flat inputs ``need`` laid out as ``prog`` takes them."""
    leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=is_padded)
    for i in (i for i in need if not batched(leaves[i])):   # vmap's to lay out
      leaves[i] = self._place_leaf(prog, i, leaves[i])
    return jax.tree_util.tree_unflatten(treedef, leaves)

  def _foreign(self, leaves) -> list[int]:
    """Flat inputs committed to devices outside the mesh, or to its devices in
    another order or another mesh shape (jax refuses them)."""
    return [i for i, x in enumerate(leaves) if elsewhere(x, self.mesh)]

  def __call__(self, *args, **kwargs):
    args = infer.bind_positional(self.fn, args, kwargs)
    if self.donate_argnums:
      check_donated_alias(self.__name__, args, self.donate_argnums)
    try:
      with mesh_scope(self.mesh):
        if traced(args) or derivative.closes_over_tracers(self, args):
          # its derivative gshard's program of jax.jvp(fn)
          return derivative.traced_call(self, args, self._call)
        return self._call(*args)
    except Exception as e:     # jax_debug_nans: found op by op on one device
      raise (nans.localize(self.fn, args, self.__name__, e) if nans.failed_check(e) else e)

  def _call(self, *args):
    if self._abstract:
      raise RuntimeError(
          f"{self.__name__} is partitioned over an AbstractMesh "
          f"{mesh_str(self.mesh_sizes)}, which has no devices to run on. Inspect or "
          f"compile it with {self.__name__}.lower(*args, platform='tpu') (arrays or "
          "jax.ShapeDtypeStructs), or partition over a concrete mesh "
          "(gshard.make_mesh) to run it.")
    try:
      return self._jit(*args)
    except _Place as p:    # with any argument committed elsewhere (jax refuses it)
      foreign = self._foreign(jax.tree_util.tree_flatten(args, is_leaf=is_padded)[0])
      placed = self._placed(args, p.program, sorted(set(p.need) | set(foreign)))
    except TypeError as e:        # jax's refusal of a non-array argument: gshard's
      if (bad := infer.non_array_error(self.fn, self.__name__, args, e)) is e:
        raise
      raise bad from None
    except ValueError:
      leaves, _ = jax.tree_util.tree_flatten(args, is_leaf=is_padded)
      foreign = self._foreign(leaves)
      if not foreign:
        raise
      # arguments committed to devices outside the mesh: moved onto it
      return self._call(*self._placed(args, self.program(*args), foreign))
    self._local.placing = True     # laid out now: trace without checking again
    try:
      return self._jit(*placed)
    finally:
      self._local.placing = False

  def lower(self, *args, **kwargs):
    """Lower for inspection; ``args`` may be ``jax.ShapeDtypeStruct``s.

    The program lowered is the one steady-state calls run (inputs laid out as
    it takes them, uneven state padded: no resharding at the boundary).
    ``platform="tpu"`` (``lowering_platform=`` if ``fn`` has a ``platform``)
    lowers for TPU from here, any ``AbstractMesh``.
    """
    platform, kwargs = infer.lowering_platform(self.fn, args, kwargs)
    if self._abstract and platform is None:
      raise ValueError(
          f"{self.__name__}.lower(): the mesh is an AbstractMesh "
          f"{mesh_str(self.mesh_sizes)}, which names no platform. Pass the platform to "
          f"lower for, e.g. {self.__name__}.lower(*args, platform='tpu').")
    args = infer.bind_positional(self.fn, args, kwargs)
    self._check_arity(len(args))
    leaves, treedef = jax.tree_util.tree_flatten(tuple(args), is_leaf=is_padded)
    with mesh_scope(self.mesh):
      return self._lower(leaves, treedef, platform)

  def _lower(self, leaves, treedef, platform):
    prog = self._program(leaves, treedef)
    structs = []
    for i, x in enumerate(leaves):
      a = prog.flat_avals[i]
      if prog.padded_in(i) and (is_padded(x) or i in prog.state_inputs):
        sharding = NamedSharding(self.mesh, prog.in_shardings[i].to_spec())
        structs.append(PaddedArray(jax.ShapeDtypeStruct(prog.padded_shape(i), a.dtype,
                                                        sharding=sharding), a.shape))
      else:
        sharding = NamedSharding(self.mesh, prog.in_place[i].to_spec())
        structs.append(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding,
                                            weak_type=a.weak_type))
    placed = jax.tree_util.tree_unflatten(treedef, structs)
    prog.per_device()            # the partition rules run (timed as partition_setup)
    t0 = time.perf_counter()
    with _gc.paused():
      traced = self._jit.trace(*placed)
      lowered = traced.lower(lowering_platforms=(platform,)) if platform else traced.lower()
    prog.timings["lower"] = time.perf_counter() - t0
    return Lowered(self, prog, lowered, placed)


def partition(fn: Callable, mesh, in_specs=None, out_specs=None, strict: bool = False,
              donate_argnums: Sequence[int] | int = (), *,
              windowed_einsum: float | None = None) -> Partitioned:
  """Partition ``fn`` over ``mesh`` from its annotations.

  Args:
    fn: a function of arrays (pytrees allowed), annotated with gshard.split etc.
    mesh: a jax ``Mesh`` (``gshard.make_mesh``, or ``jax.make_mesh``: Explicit axes
      are taken as Auto) or ``AbstractMesh`` (lowering only).
    in_specs: a pytree prefix of the positional arguments with PartitionSpecs at
      the leaves; ``None`` (whole or per leaf) lets propagation decide.
    out_specs: the same for the outputs; ``None`` takes the inferred shardings,
      except that an output which is the next value of an input (same tree
      position of a returned state: same tree structure, shapes and dtypes)
      keeps that input's layout.
    strict: ``True`` raises where a primitive without a partition rule would
      gather its operands (the safe path), instead of warning.
    donate_argnums: positions of the arguments whose buffers may be reused.
    windowed_einsum: ``None`` (the default) or bytes per device. A dot whose
      plan would all-gather an operand of at least that many bytes per device
      once gathered (or reduce-scatter a result that large) runs as a ring of
      ``ppermute`` steps (GShard's windowed einsum): the same bytes sent, the
      gathered operand never held whole. ``0`` windows every such dot.

  Returns:
    A :class:`Partitioned` callable (keywords as for jax.jit); ``.lower(*args)`` inspects it.

  Example::

    step = gshard.partition(train_step, mesh, in_specs=(param_specs, P("data")))
    params, loss = step(params, batch)
  """
  return Partitioned(fn, mesh, in_specs, out_specs, strict, donate_argnums,
                     windowed_einsum=windowed_einsum)
