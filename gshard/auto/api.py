"""``gshard.auto_shard``: find the layouts, check them with gshard itself, explain them.

One call (:func:`auto_shard`) runs, for the arguments given:

1. **trace** the function (``jax.make_jaxpr``) and build gshard's propagation
   graph, with the user's ``in_specs`` and annotations as pins (constraints);
2. **search** (``search.py``): the reduced problem and its exact solve under
   the memory limit, then each argument's runner-up;
3. **realize** (``realize.py``): the arguments' layouts as ``in_specs``, plus
   the few annotations propagation needs to follow the solver elsewhere;
4. **check**: partition the function with them (the real gshard, per-device
   program traced, nothing compiled) and count its collectives' bytes; predict
   its memory from the propagated layouts.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
from collections.abc import Callable, Mapping
from numbers import Real
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh

from gshard.annotate import mesh_context
from gshard.auto import layouts as L
from gshard.auto import realize as R
from gshard.auto.annotations import annotate
from gshard.auto.memory import ProgramMemory
from gshard.auto.plan import Choice, Cost, Plan
from gshard.auto.problem import link_state
from gshard.auto.search import Options, add_runner_ups, least_memory, search
from gshard.auto.solve import Infeasible
from gshard.spmd import _gc
from gshard.spmd.infer import flatten_specs, pinned_graph
from gshard.spmd.tracing import trace
from gshard.spmd.inspect import format_bytes
from gshard.spmd.partition.api import Partitioned, pair_state, partition
from gshard.spmd.partition.padded import logical_args
from gshard.spmd.sharding import TensorSharding, mesh_scope, mesh_sizes_of, mesh_str

# Under a memory limit, when the first plan compiles to more than the limit:
PROBES = (0.001, 0.005, 0.02)   # budgets just above the model's least memory, m (1 + d)
IMPROVE_ROUNDS = 2              # then budgets stepped up from the fitting one by
IMPROVE_STEP = 0.05             # 5%, then 10% more, ... while the plan still fits


@dataclasses.dataclass
class _Attempt:
  """One solve under a budget, realized and checked."""

  found: Any                    # search.Search
  opts: Options                 # with the budget solved under as memory_limit
  in_specs: Any
  annotations: list
  cost: Cost

  @property
  def key(self):
    return _program_key(self.in_specs, self.annotations)

  @property
  def memory(self) -> float:
    """Its compiled memory per device, else (no compile: an AbstractMesh) the model's."""
    m = self.cost.compiled_memory
    return self.cost.memory if m is None else m

  def fits(self, limit) -> bool:
    return limit is None or self.memory <= limit


def _program_key(in_specs, annotations) -> tuple:
  """What gshard partitions: two budgets' plans may realize to the same one."""
  return str(in_specs), tuple(annotations)


def _number(x) -> bool:
  """A real number that is not a bool and not NaN."""
  return isinstance(x, Real) and not isinstance(x, bool) and not math.isnan(x)


def _check_options(mesh_sizes, memory_limit, bandwidth, latency, min_bytes, time_limit):
  if memory_limit is not None and (not _number(memory_limit) or memory_limit <= 0):
    raise ValueError(f"memory_limit={memory_limit!r}: give the bytes one device may hold "
                     "(a positive number, e.g. 16 * 2**30), or None for no limit.")
  if bandwidth is not None and not isinstance(bandwidth, Mapping):
    raise ValueError(f"bandwidth={bandwidth!r}: give a dict from mesh axis name to its "
                     f"relative bandwidth, e.g. {{{next(iter(mesh_sizes))!r}: 1.0}}.")
  for a, bw in (bandwidth or {}).items():
    if a not in mesh_sizes:
      raise ValueError(f"bandwidth names mesh axis {a!r}, which is not in the mesh "
                       f"{mesh_str(mesh_sizes)}. Use one of {list(mesh_sizes)}.")
    if not _number(bw) or not 0 < bw < math.inf:
      raise ValueError(f"bandwidth[{a!r}]={bw!r}: give a positive relative bandwidth "
                       "(1.0 for the slowest axis, larger for faster ones).")
  if not _number(latency) or not 0 <= latency < math.inf:
    raise ValueError(f"latency={latency!r}: give the bytes a collective costs beyond "
                     "what it sends (a number >= 0).")
  if not _number(min_bytes) or not 0 <= min_bytes < math.inf:
    raise ValueError(f"min_bytes={min_bytes!r}: give the size in bytes below which a "
                     "value stays replicated (a number >= 0).")
  if not _number(time_limit) or time_limit <= 0:
    raise ValueError(f"time_limit={time_limit!r}: give the seconds the integer program "
                     "may run (a positive number).")


def _arg_names(fn, n: int) -> list[str]:
  try:
    params = list(inspect.signature(fn).parameters.values())
  except (TypeError, ValueError):
    params = []
  names = []
  positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  rest = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), None)
  for i in range(n):
    if i < len(positional):
      names.append(positional[i].name)
    elif rest is not None:
      names.append(f"{rest}[{i - len(positional)}]")
    else:
      names.append(f"args[{i}]")
  return names


def _leaf_name(path: str, names: list[str]) -> str:
  """``[0]['w1']`` -> ``params['w1']``."""
  if path.startswith("["):
    end = path.index("]")
    head = path[1:end]
    if head.isdigit() and int(head) < len(names):
      return names[int(head)] + path[end + 1:]
  return path


def _structs(args):
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x))
      if not isinstance(x, jax.ShapeDtypeStruct) else x, args)


class AutoShard:
  """``gshard.auto_shard(fn, mesh, ...)``: call it on the arguments to get a :class:`Plan`."""

  def __init__(self, fn: Callable, mesh, in_specs=None, memory_limit=None,
               bandwidth: Mapping[str, float] | None = None, latency: float = 1024.0,
               min_bytes: int = 4096, time_limit: float = 60.0,
               runner_up_seconds: float = 10.0, tie_layers: bool = True,
               check_memory: bool = True):
    self.fn = fn
    self.check_memory = bool(check_memory)
    self.mesh = mesh
    self.mesh_sizes = mesh_sizes_of(mesh)
    _check_options(self.mesh_sizes, memory_limit, bandwidth, latency, min_bytes,
                   time_limit)
    self.in_specs = in_specs
    if memory_limit is not None and math.isinf(memory_limit):
      memory_limit = None      # no limit
    self.opts = Options(None if memory_limit is None else float(memory_limit),
                        dict(bandwidth or {}), float(latency), int(min_bytes),
                        float(time_limit), float(runner_up_seconds), bool(tie_layers))
    self.__name__ = getattr(fn, "__name__", "fn")

  def _abstract_mesh(self):
    if isinstance(self.mesh, AbstractMesh):
      return self.mesh
    if isinstance(self.mesh, Mapping):
      return AbstractMesh(tuple(self.mesh.values()), tuple(self.mesh))
    return self.mesh.abstract_mesh

  def __call__(self, *args, **kwargs) -> Plan:
    if kwargs:
      raise TypeError(
          f"auto_shard({self.__name__})(..., {', '.join(f'{k}=...' for k in kwargs)}): "
          "give the step's arguments by position; the plan's in_specs are per "
          "position, as gshard.partition's in_specs are.")
    try:
      with mesh_scope(self.mesh):     # under jax.set_mesh of an Explicit mesh too
        return self._search(*args)
    except TimeoutError as e:
      raise TimeoutError(
          f"auto_shard({self.__name__}, time_limit={self.opts.time_limit:g}): {e}. Raise "
          "time_limit (the seconds the integer program may run); a larger program "
          "needs longer.") from None

  def _search(self, *args) -> Plan:
    secs: dict[str, float] = {}
    t0 = time.perf_counter()
    ms = self.mesh_sizes
    args = logical_args(args)
    leaves, paths, specs = flatten_specs(self.in_specs, tuple(args), mesh_sizes=ms)
    with mesh_context(ms), _gc.paused():     # as gshard.partition builds: spmd/_gc.py
      closed, out_shape = trace(self.fn, args)
      jaxpr = closed.jaxpr
      graph = pinned_graph(jaxpr, ms, leaves, paths, specs)
      link_state(graph, jaxpr, pair_state(args, out_shape))
    secs["trace"] = time.perf_counter() - t0
    structs = _structs(args)
    evaluate = self._evaluator(structs)
    limit = self.opts.memory_limit
    cache: dict = {}

    def attempt(budget) -> _Attempt:
      """Solve under ``budget`` (the model's bytes), realize, check: an
      :class:`_Attempt`. Raises :class:`Infeasible`."""
      opts = dataclasses.replace(self.opts, memory_limit=budget)
      with _gc.paused():
        found = search(graph, jaxpr, ms, opts, paths, cache=cache, runner_ups=False)
      for k, v in found.seconds.items():
        secs[k] = secs.get(k, 0.0) + v
      prob, choice = found.problem, found.choice
      t1 = time.perf_counter()
      inputs = []
      for var in jaxpr.invars:
        t = graph.tensors.get(((), var))
        s = prob.layout(t, choice) if t is not None else TensorSharding.replicated(0)
        inputs.append((var, s))
      with _gc.paused():
        real = R.realize(jaxpr, ms, prob, choice, inputs, self.opts.min_bytes,
                         exact=limit is not None)
      secs["realize"] = secs.get("realize", 0.0) + time.perf_counter() - t1
      tree = jax.tree_util.tree_structure(tuple(args))
      in_specs = jax.tree_util.tree_unflatten(tree, [s.to_spec() for _, s in inputs])
      t2 = time.perf_counter()
      annotations = real.annotations
      if annotations:
        # the solver's model is a model: keep the annotations only where the
        # partitioned program sends fewer bytes with them than without, or
        # (under a limit) holds less
        with_ = evaluate(in_specs, annotations, graph=real.graph, jaxpr=jaxpr, compiled=False)
        without = evaluate(in_specs, [], compiled=False)
        if without.bytes <= with_.bytes and (limit is None or without.memory <= with_.memory):
          annotations = []
      key = _program_key(in_specs, annotations)
      cost = checked.get(key)
      if cost is None:       # another budget's plan realized to the same program
        cost = checked[key] = evaluate(in_specs, annotations, compiled=self.check_memory)
      secs["check"] = secs.get("check", 0.0) + time.perf_counter() - t2
      return _Attempt(found, opts, in_specs, annotations, cost)

    checked: dict = {}
    try:
      first = attempt(limit)
    except Infeasible as e:     # no layout fits in the model
      if not self._compiles():
        raise self._infeasible(e.minimum + cache["mem"].scalar_args) from None
      # what does fit is XLA's to say: the least-memory plans, compiled,
      # fit or give the least memory actually reached
      first = None
    best = first
    if first is None or not first.fits(limit):
      best = self._search_edge(attempt, first, limit, paths, graph, jaxpr, cache)
    found, opts, in_specs, annotations, cost = (best.found, best.opts, best.in_specs,
                                                best.annotations, best.cost)
    t3 = time.perf_counter()
    found = add_runner_ups(found, opts)
    secs["runner_ups"] = time.perf_counter() - t3
    choices = self._choices(found, jaxpr, paths, len(args))
    return Plan(in_specs, annotations, cost, found.bytes, choices, dict(ms),
                limit, secs, found.size, found.status, evaluate)

  # -- the memory limit ----------------------------------------------------------
  def _compiles(self) -> bool:
    """Whether plans are compiled and measured (a concrete mesh, ``check_memory``)."""
    return self.check_memory and not isinstance(self.mesh, (AbstractMesh, Mapping))

  def _search_edge(self, attempt, first: _Attempt | None, limit: float, paths, graph,
                   jaxpr, cache) -> _Attempt:
    """The plan that fits ``limit`` when the solver's first plan compiled to
    more (XLA holds buffers the model does not count), or when the model
    found none (``first`` None: its estimate may be above what XLA needs, and
    the error should name the memory XLA reaches, not the model's).

    First the plan without a limit (the fewest bytes: returned if it fits),
    then the plans at the model's least memory (``PROBES``: a few budgets
    just above it, whose tied optima realize to different programs): they
    do not depend on the limit, so a limit that one of them fits is never
    reported infeasible, whatever a smaller limit found. None fits: no
    layout fits, and the error says the least compiled memory they reached
    (raised to that, the limit fits one; where no probe solves, the model's
    least); a TimeoutError instead when a probe's solve stopped at
    ``time_limit`` (its plan is not the best at its budget). Then, for fewer
    bytes, the budget is stepped up from the fitting probe's
    (``IMPROVE_ROUNDS``, ``IMPROVE_STEP``) while the plan still fits,
    keeping the fitting plan that sends least; not when the model found no
    plan at the limit (the probe is returned)."""
    # the plan without a limit first: the model may put it above what XLA
    # needs, and then above the least-memory plans (a limit it fits was refused)
    free = attempt(None)
    if free.fits(limit):
      return free
    # the first solve's cuts depend on the limit: the probes start from the
    # replicated program's peaks alone, so they are the same for every limit
    cache["sets"] = cache["mem"].peak_sets()
    least = least_memory(graph, jaxpr, self.mesh_sizes, self.opts, paths, cache)
    probes, best = {free.key: free}, None    # program -> attempt
    for d in PROBES:
      try:
        a = attempt(least * (1 + d))
      except Infeasible:
        # the solution peaked where no row looked yet (a cut, kept): the
        # least over the rows is higher now
        least = least_memory(graph, jaxpr, self.mesh_sizes, self.opts, paths, cache)
        try:
          a = attempt(least * (1 + d))
        except Infeasible:
          continue
      if a.key in probes:
        continue
      probes[a.key] = a
      if a.fits(limit):
        best = a
        break
    if best is None:
      # the probes' least: a limit that large fits one of them (the first
      # plan's memory depends on the limit, so it promises nothing)
      if not probes:              # none solved: the model's least is all there is
        raise self._infeasible(least)
      reached = min(a.memory for a in probes.values())
      unproven = [a for a in probes.values() if a.found.status != "optimal"]
      if unproven:
        # a plan the solver had when its time ran out is not its best one, and
        # the best may compile to less: 'no layout fits' would be a guess
        raise TimeoutError(
            f"memory_limit={format_bytes(limit)} ({limit:.0f} bytes): no plan found "
            f"fits (the least memory reached is {format_bytes(reached)}), but the "
            f"integer program stopped at its time limit at {len(unproven)} of the "
            f"{len(probes)} least-memory budgets, before proving its plan best "
            f"({unproven[0].found.status}); a better plan may fit")
      raise self._infeasible(reached)
    # the fitting plans sit near the least memory (compiled memory rises in
    # plateaus): step the budget up from there, not down from the top
    budget, step = best.opts.memory_limit, IMPROVE_STEP
    for _ in range(IMPROVE_ROUNDS if first is not None else 0):
      budget = min(budget * (1 + step), first.found.memory.peak)
      try:
        a = attempt(budget)
      except Infeasible:
        break
      if not a.fits(limit):
        break
      if a.cost.bytes < best.cost.bytes:
        best = a
      step *= 2
    return best

  # -- pieces ------------------------------------------------------------------
  def _evaluator(self, structs):
    """``evaluate(in_specs, annotations)``: bytes sent by gshard's partitioned
    program and the memory predicted from its propagated layouts."""
    def evaluate(in_specs, annotations, graph=None, jaxpr=None, compiled=True) -> Cost:
      fn = annotate(self.fn, annotations)
      part = Partitioned(fn, self._abstract_mesh(), in_specs)
      prog = part.program(*structs)
      prog.per_device()
      cols = tuple(prog.recorder.collectives)
      if graph is None:
        graph, jaxpr = prog.result.graph, prog.result.jaxpr.jaxpr
      used = ProgramMemory(graph, jaxpr, self.mesh_sizes).of(R.layout_in(graph))
      measured = None
      if compiled and self._compiles():
        m = partition(fn, self.mesh, in_specs=in_specs).lower(*structs).compile()
        m = m.memory_analysis()
        measured = float(m.temp_size_in_bytes + m.argument_size_in_bytes
                         + m.output_size_in_bytes - m.alias_size_in_bytes)
      return Cost(float(sum(c.bytes for c in cols)), used.peak, used.arguments,
                  used.activations, cols, measured)
    return evaluate

  def _choices(self, found, jaxpr, paths, nargs) -> list[Choice]:
    prob, choice = found.problem, found.choice
    names = _arg_names(self.fn, nargs)
    by_var: dict[int, list[int]] = {}
    for i, var in enumerate(jaxpr.invars):
      t = prob.graph.tensors.get(((), var))
      vi = prob.var_of(t) if t is not None else None
      if vi is not None:
        by_var.setdefault(vi, []).append(i)
    out = []
    for vi, idx in by_var.items():
      v = prob.vars[vi].item
      first = prob.graph.tensors[((), jaxpr.invars[idx[0]])]
      tensors = [prob.graph.tensors[((), jaxpr.invars[i])] for i in idx]
      held = sum(L.local_bytes(t.shape, t.dtype, prob.layout(t, choice), self.mesh_sizes)
                 for t in tensors)
      ru = found.runner_ups.get(vi)
      ru_spec = None
      if ru is not None and ru.choice is not None:
        ru_spec = v.layout_of(prob.member(first)[1], v.candidates[ru.choice]).to_spec()
      out.append(Choice(tuple(_leaf_name(paths[i], names) for i in idx), tuple(first.shape),
                        str(first.dtype), prob.layout(first, choice).to_spec(), float(held),
                        ru_spec, ru.bytes if ru else math.inf, ru.memory if ru else math.inf,
                        ru.exact if ru else True))
    out.sort(key=lambda c: -c.held)
    return out

  def _infeasible(self, minimum: float) -> ValueError:
    limit = self.opts.memory_limit
    return ValueError(
        f"memory_limit={format_bytes(limit)} ({limit:.0f} bytes) per device: no layout "
        f"of {self.__name__}'s arguments on mesh {mesh_str(self.mesh_sizes)} fits. The "
        f"smallest memory per device any layout reached is {format_bytes(minimum)} "
        f"({minimum:.0f} bytes). Raise memory_limit to at least {minimum:.0f}, use a mesh "
        "with more devices, a smaller batch, or remat (jax.checkpoint) to keep fewer "
        "activations.")


def auto_shard(fn: Callable, mesh, *, in_specs=None, memory_limit: float | None = None,
               bandwidth: Mapping[str, float] | None = None, latency: float = 1024.0,
               min_bytes: int = 4096, time_limit: float = 60.0,
               runner_up_seconds: float = 10.0, tie_layers: bool = True,
               check_memory: bool = True) -> AutoShard:
  """Find layouts for ``fn``'s arguments (and the few annotations it needs).

  Args:
    fn: a function of arrays (a train step, say), annotated or not.
    mesh: a jax ``Mesh`` / ``AbstractMesh`` (or ``gshard.make_mesh``).
    in_specs: optional pytree prefix of the arguments with PartitionSpecs: these
      layouts are constraints (a ``None`` leaf, or ``P.UNCONSTRAINED`` in a
      dim, leaves it free; a ``None`` inside a spec pins that dim unsplit, as
      in ``gshard.partition``). Annotations in ``fn`` are constraints too.
    memory_limit: bytes one device may hold (arguments + activations, as the
      compiled program's ``memory_analysis()`` counts them), or None.
    bandwidth: relative bandwidth per mesh axis (default 1.0 each); bytes sent
      over an axis weigh ``1 / bandwidth``.
    latency: bytes a collective costs beyond what it sends (ties go to fewer
      collectives).
    min_bytes: values smaller than this stay replicated.
    time_limit: seconds each solve of the integer program may run. A solve
      stopped there keeps the best plan it has (the plan's status says so);
      where no plan fits the limit and one of the least-memory solves was
      stopped, a ``TimeoutError`` says so (a better plan may fit), never
      'no layout fits'.
    runner_up_seconds: seconds, in all, for the exact runner-up of each
      argument (after that, runner-ups hold the rest of the plan fixed;
      marked ``~``). They explain the plan and do not change it: 10 s keeps
      a Transformer's whole search within tens of seconds.
    tie_layers: variables whose surroundings look alike (the copies of a
      repeated layer) share one choice: each layer is solved once.
    check_memory: compile the partitioned program (on a concrete mesh) and
      read ``memory_analysis()``; if it exceeds ``memory_limit``, try the
      plans at the model's least memory, then step the budget up from the
      one that fits (fewer bytes).

  Returns:
    A function of the arguments (arrays or ``ShapeDtypeStruct``s) returning a
    :class:`~gshard.auto.plan.Plan`.

  Example::

    plan = gshard.auto_shard(train_step, mesh, memory_limit=16 * 2**30)(*args)
    print(plan)
    step = gshard.partition(plan.annotate(train_step), mesh, in_specs=plan.in_specs)
  """
  return AutoShard(fn, mesh, in_specs, memory_limit, bandwidth, latency, min_bytes,
                   time_limit, runner_up_seconds, tie_layers, check_memory)
