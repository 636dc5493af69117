"""Trace and propagate: the one step ``infer_shardings``, ``partition`` and
``coverage`` share, and ``infer_shardings`` itself.

:func:`analyze` traces a function with ``jax.make_jaxpr`` (annotations check
their mesh axes while it runs), pins ``in_specs`` (and ``out_specs``) on the
program's inputs (and outputs), and propagates: a :class:`ShardingResult`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import source_info_util
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gshard.annotate import mesh_context
from gshard.spmd.partition.padded import logical_args, logical_struct
from gshard.spmd.printing import format_jaxpr
from gshard.spmd.graph import Graph, source_of
from gshard.spmd.propagate import Conflict, conflicts, propagate
from gshard.spmd.sharding import (TensorSharding, check_spec_entries, mesh_scope,
                                  mesh_sizes_of, mesh_str, open_dims_of_spec, short_dtype)
from gshard.spmd.micro_batches import reshaped_reads
from gshard.spmd.tracing import live_only, non_array_error, trace

# Frames inside gshard are not the user's source line.
source_info_util.register_exclusion(__file__.rsplit("/spmd/", 1)[0])


def _is_spec_leaf(x) -> bool:
  return x is None or isinstance(x, P)


def flatten_specs(specs, tree, what: str = "in_specs", mesh_sizes=None):
  """Broadcast a pytree prefix of PartitionSpecs (or None) to the leaves of ``tree``.

  For ``in_specs`` the tree is the tuple of positional arguments (a list
  prefix counts as a tuple; a single non-tuple prefix is the one argument's).
  Returns ``(leaves, paths, specs)`` as flat lists; a prefix that does not
  fit is a ValueError naming ``what``.
  """
  leaves_with_paths, _ = jax.tree_util.tree_flatten_with_path(tree)
  paths = [jax.tree_util.keystr(p) for p, _ in leaves_with_paths]
  leaves = [x for _, x in leaves_with_paths]
  if specs is None or isinstance(specs, P):
    return leaves, paths, [specs] * len(leaves)
  if isinstance(specs, list) and isinstance(tree, tuple):
    specs = tuple(specs)
  if what == "in_specs" and not isinstance(specs, tuple):
    specs = (specs,)
  try:
    full = jax.tree.broadcast(specs, tree, is_leaf=_is_spec_leaf)
    flat = jax.tree.structure(tree).flatten_up_to(full)
  except ValueError as e:
    whose = "arguments (a tuple with one entry per positional argument" \
        if what == "in_specs" else "outputs (the structure fn returns"
    bad = _misfit(specs, tree, "")
    if bad is not None:
      path, spec, sub = bad
      if what == "in_specs" and not path:   # the tuple of positional arguments
        there = (f"{len(sub)} positional argument"
                 f"{' was' if len(sub) == 1 else 's were'} passed")
      elif what == "in_specs":
        there = f"argument {path[1:].split(']')[0]}{path[path.index(']') + 1:]} is {_kind(sub)}"
      else:
        there = f"the output{path} is {_kind(sub)}"
      e = (f"{what}{path} is {_kind(spec)}, but {there}. Give a "
           "PartitionSpec (or None) for an array, and for a pytree a PartitionSpec for "
           "all of it or a pytree of them with its structure" +
           (f", on mesh {mesh_str(mesh_sizes)}" if mesh_sizes else ""))
    raise ValueError(
        f"{what} must be a pytree prefix of the {whose}, PartitionSpecs or None at "
        f"the leaves): {e}") from None
  return leaves, paths, flat


def _misfit(spec, sub, path: str):
  """The first place a spec prefix does not fit its tree (dicts, tuples and
  lists): (path, spec there, tree there), or None."""
  if spec is None or _is_spec_leaf(spec):
    return None
  if isinstance(spec, dict):
    if not isinstance(sub, dict) or set(spec) != set(sub):
      return path, spec, sub
    kids = [(f"{path}[{k!r}]", spec[k], sub[k]) for k in spec]
  elif isinstance(spec, (tuple, list)):
    if not isinstance(sub, (tuple, list)) or len(spec) != len(sub):
      return path, spec, sub
    kids = [(f"{path}[{i}]", a, b) for i, (a, b) in enumerate(zip(spec, sub))]
  else:
    return None
  for p, a, b in kids:
    bad = _misfit(a, b, p)
    if bad is not None:
      return bad
  return None


def _kind(x) -> str:
  """What a user reads ``x`` as: ``an array f32[8,8]``, ``a dict with keys
  ['w']``, ``a tuple of 2``."""
  if isinstance(x, dict):
    return f"a dict with keys {sorted(map(str, x))}"
  if isinstance(x, (tuple, list)):
    return f"a {type(x).__name__} of {len(x)}"
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return f"an array {short_dtype(x.dtype)}[{','.join(map(str, x.shape))}]"
  return f"a {type(x).__name__}"


def spec_to_pin(spec: P, shape, mesh_sizes, where: str):
  """A checked (sharding, open dims) for an argument spec; errors name ``where``.
  A ``NamedSharding`` stands for its spec."""
  shape = tuple(shape)
  rank = len(shape)
  what = "the output" if where.startswith("out_specs") else "the argument"
  if isinstance(spec, NamedSharding):
    other = dict(spec.mesh.shape)
    if other != dict(mesh_sizes):
      raise ValueError(
          f"{where}: a NamedSharding on mesh {mesh_str(other)} for {what} of shape "
          f"{shape}; gshard partitions over mesh {mesh_str(mesh_sizes)}. Give its "
          f"PartitionSpec ({spec.spec}) or a NamedSharding on that mesh.")
    spec = spec.spec
  if not isinstance(spec, P):
    raise TypeError(
        f"{where}: got {spec!r} ({type(spec).__name__}) for {what} of shape {shape}, on "
        f"mesh {mesh_str(mesh_sizes)}; give a jax.sharding.PartitionSpec, e.g. "
        f"P({', '.join(repr(a) for a in list(mesh_sizes)[:rank])}), or None to let "
        "propagation decide.")
  check_spec_entries(spec, f"{where}: {what} of shape {shape}, on mesh "
                           f"{mesh_str(mesh_sizes)}")
  if len(spec) > rank:
    raise ValueError(
        f"{where}: {what} has shape {shape} (rank {rank}) but its spec {spec} "
        f"has {len(spec)} entries, on mesh {mesh_str(mesh_sizes)}. Give at most one "
        f"entry per dimension, e.g. {P(*list(spec)[:rank])}.")
  open_dims = open_dims_of_spec(spec)
  entries = [None if i in open_dims else e for i, e in enumerate(spec)]
  seen = set()
  for e in entries:
    for a in ((e,) if isinstance(e, str) else tuple(e or ())):
      if a not in mesh_sizes:
        raise ValueError(
            f"{where}: spec {spec} for shape {shape} names mesh axis {a!r}, which is "
            f"not in the mesh {mesh_str(mesh_sizes)}. Use one of {list(mesh_sizes)}.")
      if a in seen:
        raise ValueError(
            f"{where}: spec {spec} for shape {shape} uses mesh axis {a!r} twice, on "
            f"mesh {mesh_str(mesh_sizes)}. A mesh axis can split only one dimension.")
      seen.add(a)
  return TensorSharding.from_spec(P(*entries), rank), open_dims


@dataclasses.dataclass
class ShardingResult:
  """What propagation found for one traced program.

  Attributes:
    jaxpr: the traced ``ClosedJaxpr``.
    mesh_sizes: mesh axis name -> size.
    graph: every tensor (nested jaxprs included) with its sharding.
    conflicts: where tensors disagreed, what was chosen and why.
    unsupported: (primitive, source line) of equations without a sharding rule.
    sweeps: propagation sweeps to the fixed point.
  """

  jaxpr: Any
  mesh_sizes: dict[str, int]
  graph: Graph
  unsupported: list[tuple[str, str]]
  sweeps: int
  out_shape: Any = None
  timings: dict[str, float] = dataclasses.field(default_factory=dict)

  @functools.cached_property
  def conflicts(self) -> list[Conflict]:
    """Where tensors disagreed, what was chosen and why (read on first use)."""
    return conflicts(self.graph)

  def sharding(self, var, scope: tuple = ()) -> TensorSharding:
    """The sharding of ``var`` (in the nested scope ``scope``; top level by default)."""
    t = self.graph.tensors.get((scope, var))
    if t is None:
      return TensorSharding.replicated(len(getattr(var.aval, "shape", ())))
    return t.sharding

  @property
  def shardings(self) -> dict[tuple, TensorSharding]:
    """(scope, var) -> sharding, for every variable of the program."""
    return {k: t.sharding for k, t in self.graph.tensors.items()}

  @property
  def in_shardings(self) -> list[TensorSharding]:
    """The sharding of each flat input of the program."""
    return [self.sharding(v) for v in self.jaxpr.jaxpr.invars]

  @property
  def out_shardings(self) -> list[TensorSharding]:
    """The sharding of each flat output of the program."""
    return [self.sharding(v) for v in self.jaxpr.jaxpr.outvars]

  def pretty(self, source: bool = True) -> str:
    """The jaxpr, every variable typed like ``f32[64@data,1024@model]``."""
    def of(scope, var):
      t = self.graph.tensors.get((scope, var))
      return t.sharding if t is not None else None
    return format_jaxpr(self.jaxpr.jaxpr, of, source_of=source_of if source else None)

  def __str__(self) -> str:
    text = self.pretty()
    if self.conflicts:
      text += "\n\nconflicts settled:\n" + "\n".join(f"  {c}" for c in self.conflicts)
    if self.unsupported:
      text += "\n\nno sharding rule (outputs left replicated):\n" + "\n".join(
          f"  {p} at {s}" for p, s in self.unsupported)
    return text


class Keywords(dict):
  """The keyword arguments of a call that take no position in the function's
  signature (keyword-only, after a skipped default, into ``**kwargs``): passed
  on as keywords, the last positional argument of the traced call. A pytree
  with its keys sorted (a call's keyword order changes nothing)."""


jax.tree_util.register_pytree_with_keys(
    Keywords,
    lambda k: ([(jax.tree_util.DictKey(n), k[n]) for n in sorted(k)], tuple(sorted(k))),
    lambda names, values: Keywords(zip(names, values)))


def structs_of(fn: Callable, name: str, leaves, treedef) -> list:
  """:func:`logical_struct` of each leaf; a non-array leaf is gshard's error."""
  try:
    return [logical_struct(x) for x in leaves]
  except TypeError as e:
    raise non_array_error(fn, name, jax.tree_util.tree_unflatten(treedef, leaves), e) from None


def lowering_platform(fn: Callable, args: tuple, kwargs: dict) -> tuple[str | None, dict]:
  """The platform ``lower`` lowers for, and the keywords left for ``fn``:
  ``lowering_platform=`` always names it; ``platform=`` does unless ``fn``
  has a parameter of that name that ``args`` leave open (then it is ``fn``'s,
  as ``jax.jit``'s ``lower`` passes its keywords on)."""
  kwargs = dict(kwargs)
  platform = kwargs.pop("lowering_platform", None)
  if platform is None and "platform" in kwargs:
    try:
      params = list(inspect.signature(fn, follow_wrapped=False).parameters.values())
    except (TypeError, ValueError):
      params = []
    own = [i for i, q in enumerate(params) if q.name == "platform"
           and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)]
    if not own or (own[0] < len(args) and params[own[0]].kind != params[0].KEYWORD_ONLY):
      platform = kwargs.pop("platform")
  return platform, kwargs


def bind_positional(fn: Callable, args: tuple, kwargs: dict) -> tuple:
  """``args`` with the keyword arguments ``kwargs`` put at their positions in
  ``fn``'s own signature (a wrapper's, not what it wraps), traced as
  ``jax.jit`` traces them; those that take no position follow as one
  :class:`Keywords`, passed to ``fn`` as keywords (see :func:`with_keywords`)."""
  if not kwargs:
    return args
  try:
    bound = inspect.signature(fn, follow_wrapped=False).bind(*args, **kwargs)
  except (TypeError, ValueError):   # no signature, or one they do not fit: fn says
    return tuple(args) + (Keywords(kwargs),)
  return bound.args + ((Keywords(bound.kwargs),) if bound.kwargs else ())


def with_keywords(fn: Callable, args: tuple, in_specs):
  """``fn`` and ``in_specs`` for ``args`` (as :func:`bind_positional` gives
  them): a function of the positional arguments and the trailing
  :class:`Keywords` if there are any, and ``in_specs`` with ``None``
  (propagation decides) for the keywords and for trailing positions it does
  not cover whose parameters have defaults (given, here, by keyword)."""
  keywords = bool(args) and isinstance(args[-1], Keywords)
  n = len(args) - keywords
  if isinstance(in_specs, (tuple, list)) and len(in_specs) < n and _defaulted(
      fn, len(in_specs), n):
    in_specs = tuple(in_specs) + (None,) * (n - len(in_specs))
  if not keywords:
    return fn, in_specs

  def call(*xs):
    return fn(*xs[:-1], **xs[-1])
  call.__name__ = getattr(fn, "__name__", "fn")
  if isinstance(in_specs, (tuple, list)) and len(in_specs) == n:
    in_specs = tuple(in_specs) + (None,)
  return call, in_specs


def _defaulted(fn: Callable, start: int, stop: int) -> bool:
  """Whether ``fn``'s parameters at positions ``start:stop`` all have defaults."""
  try:
    params = list(inspect.signature(fn, follow_wrapped=False).parameters.values())
  except (TypeError, ValueError):
    return False
  positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  return len(positional) >= stop and all(p.default is not p.empty
                                         for p in positional[start:stop])


def pinned_graph(jaxpr, mesh_sizes, leaves, paths, specs) -> Graph:
  """The propagation graph of ``jaxpr`` with the inputs pinned to their
  ``in_specs`` (``flatten_specs``'s leaves, paths and specs; None: free)."""
  graph = Graph(jaxpr, mesh_sizes)
  for var, leaf, path, spec in zip(jaxpr.invars, leaves, paths, specs):
    if spec is not None:
      where = f"in_specs{path}"
      sharding, open_dims = spec_to_pin(spec, np.shape(leaf), mesh_sizes, where)
      graph.pin(graph.tensor((), var), sharding, open_dims, where)
  return graph

# jax settings that change what a trace makes, as jax.jit keys its traces on
# them (its trace context is private): dtypes, precision, random bits, promotion
_TRACE_SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision",
                   "jax_threefry_partitionable", "jax_default_prng_impl",
                   "jax_numpy_rank_promotion", "jax_numpy_dtype_promotion",
                   "jax_softmax_custom_jvp", "jax_enable_checks", "jax_random_seed_offset",
                   "jax_explicit_x64_dtypes")


def config_key() -> tuple:
  """The current values of jax's trace-time settings (a program traced under
  others is not this one: a cache of programs keys on them)."""
  return tuple(str(getattr(jax.config, name, None)) for name in _TRACE_SETTINGS)


def _dtype(a):
  """An argument's dtype; a Python scalar's as jax takes it (``1``: int32)."""
  return a.dtype if hasattr(a, "dtype") else jax.typeof(a).dtype


def pair_state(args, out_shape) -> dict[int, int]:
  """Which outputs are the next value of which inputs, as flat leaf indices.

  Each top-level element of a tuple (or list) output, else the whole output,
  is matched with a positional argument of the same tree structure, leaf
  shapes and dtypes: the argument at its own position first, else the first
  one not matched yet.
  """
  def elements(xs):
    out, k = [], 0
    for x in xs:
      leaves, tree = jax.tree_util.tree_flatten(x)
      out.append((tree, tuple((tuple(np.shape(a)), str(_dtype(a))) for a in leaves), k))
      k += len(leaves)
    return out

  ins = elements(args)

  def match(outs):
    pairs, used = {}, set()
    for k, (tree, sig, off) in enumerate(outs):
      order = ([k] if k < len(ins) else []) + [i for i in range(len(ins)) if i != k]
      for i in order:
        if sig and i not in used and ins[i][:2] == (tree, sig):
          used.add(i)
          pairs.update({off + n: ins[i][2] + n for n in range(len(sig))})
          break
    return pairs

  pairs = match(elements(out_shape)) if type(out_shape) in (tuple, list) else {}
  return pairs or match(elements((out_shape,)))


def hint_state(graph, args, out_shape) -> None:
  """Hint each state output (:func:`pair_state`) with its input: it is
  returned in the input's layout anyway, so where a tie left it open,
  propagation gives it that layout (``propagate.apply_hints`` says where)."""
  jaxpr = graph.top
  for j, i in pair_state(args, out_shape).items():
    o, t = graph.tensor((), jaxpr.outvars[j]), graph.tensor((), jaxpr.invars[i])
    if o is not None and t is not None and o is not t:
      graph.hints.append((o, t))


def analyze(fn: Callable, mesh_sizes, args: Sequence[Any], in_specs=None,
            out_specs=None) -> ShardingResult:
  """Trace ``fn(*args)``, pin ``in_specs``/``out_specs``, propagate.

  Args:
    fn: the function.
    mesh_sizes: mesh axis name -> size.
    args: its positional arguments (arrays or ``ShapeDtypeStruct``s).
    in_specs: a pytree prefix of ``args``; None entries are left to propagation.
    out_specs: a pytree prefix of the outputs, or None. An output that is also
      an input keeps the input's pin.

  Returns:
    A :class:`ShardingResult`; ``timings`` has ``trace`` and ``propagate`` seconds.
  """
  timings = {}
  t0 = time.perf_counter()
  args = logical_args(args)
  fn, in_specs = with_keywords(fn, tuple(args), in_specs)
  leaves, paths, specs = flatten_specs(in_specs, tuple(args), mesh_sizes=mesh_sizes)
  with mesh_context(mesh_sizes):
    closed, out_shape = trace(fn, args)
  closed = live_only(reshaped_reads(closed))
  timings["trace"] = time.perf_counter() - t0
  t1 = time.perf_counter()
  jaxpr = closed.jaxpr
  graph = pinned_graph(jaxpr, mesh_sizes, leaves, paths, specs)
  if out_specs is not None:
    out_leaves, out_paths, flat = flatten_specs(out_specs, out_shape, "out_specs")
    for var, leaf, path, spec in zip(jaxpr.outvars, out_leaves, out_paths, flat):
      t = graph.tensor((), var)
      if spec is not None and t is not None and not t.fixed:
        where = f"out_specs{path}"
        sharding, open_dims = spec_to_pin(spec, leaf.shape, mesh_sizes, where)
        graph.pin(t, sharding, open_dims, where)
  hint_state(graph, args, out_shape)
  sweeps = propagate(graph)
  timings["propagate"] = time.perf_counter() - t1
  return ShardingResult(closed, dict(mesh_sizes), graph, graph.unsupported,
                        sweeps, out_shape, timings)


def infer_shardings(fn: Callable, mesh, in_specs=None) -> Callable[..., ShardingResult]:
  """Trace ``fn`` and propagate shardings over its whole jaxpr.

  Args:
    fn: the function (a train step, say), annotated with ``gshard.split`` etc.
    mesh: a jax ``Mesh`` / ``AbstractMesh`` (or ``gshard.make_mesh``).
    in_specs: a pytree prefix of the positional arguments, PartitionSpecs at the
      leaves; ``None`` (whole or per leaf) lets propagation decide.

  Returns:
    A function of the arguments (arrays or ``ShapeDtypeStruct``s) returning a
    :class:`ShardingResult`.

  Example::

    res = gshard.infer_shardings(step, mesh, in_specs=(param_specs, P("data")))(params, x)
    print(res)
  """
  mesh_sizes = mesh_sizes_of(mesh)

  def run(*args):
    with mesh_scope(mesh):       # under jax.set_mesh of an Explicit mesh too
      return analyze(fn, mesh_sizes, args, in_specs)
  return run
