"""``gspmd_jit``: the same annotated function, partitioned by XLA's GSPMD instead.

The baseline gshard is measured against (``benchmarks/run.py``). While the
function is traced, every ``gshard.split`` / ``replicate`` / ``shard`` becomes
``jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))`` (the same
intent, handed to XLA's SPMD partitioner), and ``in_specs`` / ``out_specs``
become ``jax.jit``'s ``in_shardings`` / ``out_shardings``.

Example::

  step = gshard.gspmd_jit(train_step, mesh, in_specs=(param_specs, P("data")))
  params, loss = step(params, batch)

Caveat: jax caches the trace of a nested ``jax.jit`` function by the function and
its argument types, not by this switch. An inner ``jax.jit`` whose body holds
annotations, traced once by ``gshard.partition``, is reused unchanged here (and
the other way round) in the same process. Annotate outside nested jits, or clear
jax's caches (``jax.clear_caches()``) between the two.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gshard.annotate import as_sharding_constraints
from gshard.spmd.sharding import mesh_scope, require_mesh, with_auto_axes


def _to_shardings(mesh, specs):
  """A pytree prefix of PartitionSpecs (None leaves kept) -> NamedShardings."""
  if specs is None:
    return None
  return jax.tree_util.tree_map(
      lambda s: None if s is None else NamedSharding(mesh, s), specs,
      is_leaf=lambda s: s is None or isinstance(s, P))


def gspmd_jit(fn: Callable, mesh, in_specs=None, out_specs=None):
  """``jax.jit(fn)`` with gshard annotations as XLA sharding constraints.

  Args:
    fn: a function annotated with ``gshard.split`` etc.
    mesh: a concrete ``jax.sharding.Mesh`` (e.g. from ``gshard.make_mesh``); its
      axes are used as Auto, as in ``gshard.partition`` (arguments already
      committed to the mesh with Explicit axes are refused by jax: place them
      on ``gshard.make_mesh``'s, or pass NumPy arrays).
    in_specs: a pytree prefix of the positional arguments with PartitionSpecs
      at the leaves; ``None`` (whole or per leaf) leaves it to jax/XLA (an
      argument keeps the sharding it already has).
    out_specs: the same for the outputs; ``None`` lets XLA decide.

  Returns:
    The ``jax.jit``-ed function (``.lower(...)``, ``.trace(...)`` as usual).
  """

  mesh = with_auto_axes(require_mesh(mesh))

  @functools.wraps(fn)
  def constrained(*args):
    # traced under gshard's Auto mesh, where the caller set another (jax.set_mesh
    # of an Explicit one, which would make every constraint an assertion); the
    # abstract mesh, as jax.set_mesh is refused inside a trace
    with as_sharding_constraints(mesh), mesh_scope(mesh.abstract_mesh):
      return fn(*args)

  kwargs = {}
  if in_specs is not None:
    if isinstance(in_specs, list):   # a prefix of the args tuple, as in gshard.partition
      in_specs = tuple(in_specs)
    kwargs["in_shardings"] = _to_shardings(mesh, in_specs)
  if out_specs is not None:
    kwargs["out_shardings"] = _to_shardings(mesh, out_specs)
  return jax.jit(constrained, **kwargs)
