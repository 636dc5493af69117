"""Saving and restoring train state with orbax-checkpoint.

A partitioned step returns global ``jax.Array``s (and, for state split
unevenly, ``gshard.PaddedArray``: the padded global array plus its logical
shape). orbax-checkpoint saves global arrays as they are laid out, each process
writing the shards it holds, and restores them onto any sharding. This module
adds what a gshard step needs on top:

- :func:`abstract_args`: the step's arguments as restore targets, each a
  ``jax.ShapeDtypeStruct`` with the sharding the step places it with (a padded
  struct for uneven state), so that nobody writes abstract targets by hand and
  restored state goes into the step without being moved again;
- :func:`save` / :func:`restore`: orbax's ``StandardSave`` / ``StandardRestore``
  (a directory, or a step of an ``ocp.CheckpointManager``) that also record
  each leaf's logical shape, so that padded state restores onto a mesh that
  pads it differently (another mesh shape, another process count), and that
  check the checkpoint against the target, leaf by leaf, with errors that say
  what differs.

Example::

  import orbax.checkpoint as ocp
  mngr = ocp.CheckpointManager("/ckpt", options=ocp.CheckpointManagerOptions(max_to_keep=2))
  for i in range(start, steps):
    params, opt_state, loss = step(params, opt_state, tokens, targets)
    gshard.checkpoint.save(mngr, (params, opt_state), step=i + 1)
  mngr.wait_until_finished()

  # later, on any mesh or number of processes:
  target = gshard.checkpoint.abstract_args(step, params_shapes, opt_shapes, tokens, targets)
  params, opt_state = gshard.checkpoint.restore(mngr, target[:2])   # latest step

Every process calls :func:`save` and :func:`restore` (with the same directory,
which all processes must see: a shared or cloud file system on a cluster).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gshard.spmd.collectives import is_key, key_shape

_META = "gshard"                 # our key in the checkpoint's custom metadata
_FORMAT = 1


# -- padded leaves ------------------------------------------------------------------

def is_padded(x) -> bool:
  """Whether ``x`` is a padded value: a pytree node (such as ``gshard.PaddedArray``)
  whose one child is its padded array ``.data`` and whose ``.shape`` is the
  logical shape."""
  if isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
    return False
  data = getattr(x, "data", None)
  if data is None or not hasattr(data, "shape") or not hasattr(x, "shape"):
    return False
  try:
    children = jax.tree_util.tree_structure(x).children()
  except Exception:  # noqa: BLE001  (not a pytree node)
    return False
  leaves = jax.tree_util.tree_leaves(x)
  return len(children) == 1 and len(leaves) == 1 and leaves[0] is data


def _with_data(node, data):
  """The padded node ``node`` with its padded array replaced by ``data``."""
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(node), [data])


def _padded_class():
  """``gshard.PaddedArray`` where it exists (the package is imported: this is
  its submodule)."""
  return getattr(sys.modules["gshard"], "PaddedArray", None)


def _name(path) -> str:
  """A leaf's path as orbax names it: ``params.layers.0.w1`` (dict keys, sequence
  indices and attribute names alike, so a namedtuple read back as a dict agrees)."""
  parts = []
  for k in path:
    for attr in ("key", "idx", "name"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return ".".join(parts)


def _flatten(tree, what: str):
  """(name, leaf) pairs with padded nodes as leaves, and the treedef. Two
  leaves whose names collide (``{'a.b': x, 'a': {'b': y}}``) are an error:
  their metadata would be one entry, and one of them would come back wrong."""
  pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_padded)
  named = [(_name(p), x) for p, x in pairs]
  seen: dict[str, str] = {}
  for (name, _), (path, _) in zip(named, pairs):
    if name in seen:
      raise ValueError(
          f"gshard.checkpoint.{what}: the leaves at {seen[name]} and "
          f"{jax.tree_util.keystr(path)} are both named {name!r} in a checkpoint (keys "
          "are joined with dots). Rename a key so that no two leaves' dotted paths agree.")
    seen[name] = jax.tree_util.keystr(path)
  return named, treedef


def _stored(x):
  """What is written for a leaf: a padded node's padded array, else the leaf."""
  return x.data if is_padded(x) else x


def _is_key(x) -> bool:
  """Whether ``x`` (an array or struct) holds typed PRNG keys."""
  return hasattr(x, "dtype") and is_key(x.dtype)


def _written(x):
  """The array written for a leaf: typed keys as their key data (uint32), which
  orbax pads and truncates between layouts as it does any array (keys it
  does not: a key leaf restored for another padding came back with the
  padding rows, or failed inside orbax)."""
  x = _stored(x)
  return jax.random.key_data(x) if _is_key(x) else x


def _data_target(x):
  """The restore target of a key leaf's key data: its shape and a trailing
  unsplit dim, on the key target's mesh."""
  shape = tuple(x.shape) + key_shape(x)
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding):
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    sharding = NamedSharding(sharding.mesh, P(*spec))
  return jax.ShapeDtypeStruct(shape, np.uint32, sharding=sharding)


# -- restore targets ------------------------------------------------------------------

def abstract_args(step, *args) -> tuple:
  """The arguments of ``step`` as restore targets, laid out as the step wants them.

  ``args`` are the step's positional arguments, or anything of their shapes and
  dtypes: arrays, ``jax.ShapeDtypeStruct`` (``jax.eval_shape(init, key)``
  gives them without computing anything), padded values. The result has their
  tree structure with every leaf a ``jax.ShapeDtypeStruct(shape, dtype,
  sharding=NamedSharding(step.mesh, spec))`` carrying the layout the step
  places that argument with (from ``in_specs`` and propagation). A leaf the
  step splits unevenly and keeps padded comes back as a padded node of the
  padded struct (``gshard.PaddedArray``), so it restores padded.

  Pass the restore targets of the state you saved, for example
  ``abstract_args(step, params, opt_state, tokens, targets)[:2]``.

  Example::

    shapes = jax.eval_shape(lambda k: init(k), jax.random.key(0))
    target = gshard.checkpoint.abstract_args(step, shapes, opt_shapes, batch, batch)
  """
  if not callable(getattr(step, "program", None)):
    raise TypeError(f"abstract_args: step must be a partitioned function "
                    f"(gshard.partition(fn, mesh, ...)), got {step!r}. Partition the train "
                    "step first; its in_specs decide where each leaf is restored.")
  leaves, treedef = jax.tree_util.tree_flatten(tuple(args), is_leaf=is_padded)
  logical = [jax.ShapeDtypeStruct(x.shape, x.dtype) if is_padded(x) else x for x in leaves]
  prog = step.program(*jax.tree_util.tree_unflatten(treedef, logical))
  state = getattr(prog, "state_inputs", frozenset())
  padded_class = _padded_class()
  out = []
  for i, x in enumerate(leaves):
    aval = prog.flat_avals[i]
    shape = tuple(aval.shape)
    inside = prog.in_shardings[i]
    full = tuple(inside.padded_shape(shape, step.mesh_sizes))
    if full != shape and (is_padded(x) or (i in state and padded_class is not None)):
      data = jax.ShapeDtypeStruct(full, aval.dtype,
                                  sharding=NamedSharding(step.mesh, inside.to_spec()))
      out.append(_with_data(x, data) if is_padded(x) else padded_class(data, shape))
    else:
      out.append(jax.ShapeDtypeStruct(
          shape, aval.dtype, sharding=NamedSharding(step.mesh, prog.in_place[i].to_spec()),
          weak_type=bool(getattr(aval, "weak_type", False))))
  return tuple(jax.tree_util.tree_unflatten(treedef, out))


# -- save -------------------------------------------------------------------------------

def _dtype_str(x) -> str:
  """The leaf's dtype; a Python scalar's as jax takes it into a step, so a
  saved ``(w, 0, 0.1)`` matches ``abstract_args``'s int32 and float32 targets."""
  return str(x.dtype if hasattr(x, "dtype") else jax.typeof(x).dtype)


def _as_target(x):
  """A restore target leaf: a Python or NumPy scalar stands for a
  ``ShapeDtypeStruct`` of its shape and jax's dtype."""
  if is_padded(x) or hasattr(x, "shape") and hasattr(x, "dtype") and not np.isscalar(x):
    return x
  aval = jax.typeof(x)
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


def _is_manager(x) -> bool:
  import orbax.checkpoint as ocp
  return isinstance(x, ocp.CheckpointManager)


def save(destination, state, *, step: int | None = None, force: bool = False,
         wait: bool | None = None) -> bool:
  """Save ``state`` (a pytree of global arrays, padded values, numpy arrays and
  scalars) with orbax-checkpoint; every process calls it.

  Args:
    destination: an ``ocp.CheckpointManager`` (then ``step`` is required) or a
      directory that must not exist yet.
    state: what to save; a padded value is written as its padded array, and its
      logical shape is recorded in the checkpoint's metadata.
    step: the step number, for a ``CheckpointManager``.
    force: passed to ``CheckpointManager.save`` (save even off its interval).
    wait: block until the checkpoint is written. Default: ``True`` for a
      directory; ``False`` for a manager, which writes in the background (call
      ``mngr.wait_until_finished()`` before the program exits).

  Returns:
    Whether a checkpoint was started (a manager skips steps off its interval).
  """
  import orbax.checkpoint as ocp

  pairs, treedef = _flatten(state, "save")
  for name, x in pairs:
    if not (is_padded(x) or hasattr(x, "shape") and hasattr(x, "dtype")
            or isinstance(x, (bool, int, float, complex, np.generic))):
      raise TypeError(
          f"gshard.checkpoint.save: leaf {name} is a {type(x).__name__} ({x!r:.60}), "
          "not an array or a number; a checkpoint holds arrays. Keep it out of the "
          "saved state (save configuration separately, e.g. as JSON beside it), or "
          "mark it static in your pytree node.")
  stored = jax.tree_util.tree_unflatten(treedef, [_written(x) for _, x in pairs])
  meta = {_META: {"format": _FORMAT, "leaves": {
      name: {"shape": [int(n) for n in np.shape(_stored(x))],
             "logical": [int(n) for n in np.shape(x)],
             "dtype": _dtype_str(_stored(x)),
             **({"key_impl": str(jax.random.key_impl(_stored(x)))}
                if _is_key(_stored(x)) else {})}
      for name, x in pairs}}}
  if _is_manager(destination):
    if step is None:
      raise ValueError("gshard.checkpoint.save(manager, state): pass step=<the step "
                       "number>, which the CheckpointManager names the checkpoint by.")
    started = destination.save(step, args=ocp.args.StandardSave(stored),
                               custom_metadata=meta, force=force)
    if wait:
      destination.wait_until_finished()
    return started
  if step is not None:
    raise ValueError(f"gshard.checkpoint.save({str(destination)!r}, ..., step={step}): "
                     "step numbers name the checkpoints of an ocp.CheckpointManager; "
                     "for a directory, put the step in its name.")
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.fspath(destination), stored, custom_metadata=meta, force=force)
    if wait is None or wait:
      ckptr.wait_until_finished()
  return True


# -- restore ----------------------------------------------------------------------------

class _DropItemMetadataWarning(logging.Filter):
  """orbax warns that a manager without a handler registry cannot read item
  metadata; restore reads only the step's custom metadata, so the warning
  would mislead."""

  def filter(self, record) -> bool:
    return "could not be restored. Please provide a `CheckpointHandlerRegistry`" not in \
        record.getMessage()


@contextlib.contextmanager
def _quiet_item_metadata():
  logger, f = logging.getLogger("absl"), _DropItemMetadataWarning()
  logger.addFilter(f)
  try:
    yield
  finally:
    logger.removeFilter(f)


def restore(source, target, *, step: int | None = None):
  """Restore a checkpoint written by :func:`save` onto ``target``'s layouts;
  every process calls it.

  Args:
    source: an ``ocp.CheckpointManager`` or a checkpoint directory.
    target: the state's tree of ``jax.ShapeDtypeStruct`` with shardings
      (:func:`abstract_args`); padded nodes where the state should come back
      padded. Its structure must be the saved state's.
    step: for a manager, the step to restore; default its latest.

  Returns:
    The state in ``target``'s structure: arrays with ``target``'s shardings, and
    padded nodes of their padded arrays. A leaf saved padded for another mesh
    is re-padded (or its padding dropped) for this one; the logical values are
    exactly those saved.

  Raises:
    FileNotFoundError: no checkpoint (for a manager: no finished step).
    ValueError: the checkpoint does not match ``target`` (a leaf missing or
      extra, another logical shape or dtype), or a target sharding cannot hold
      its leaf; the message names the leaf.
  """
  import orbax.checkpoint as ocp

  if _is_manager(source):
    if step is None:
      step = source.latest_step()
      if step is None:
        raise FileNotFoundError(
            f"gshard.checkpoint.restore: no finished checkpoint in {source.directory} "
            "(a checkpoint whose save was interrupted is not listed).")
    with _quiet_item_metadata():
      meta = source.metadata(step)
    where = f"{source.directory} step {step}"

    def run(restore_target):
      return source.restore(step, args=ocp.args.StandardRestore(restore_target, strict=False))
  else:
    if step is not None:
      raise ValueError("gshard.checkpoint.restore(directory, ..., step=...): step "
                       "numbers select the checkpoints of an ocp.CheckpointManager.")
    path = os.fspath(source)
    if not os.path.isdir(path):
      raise FileNotFoundError(f"gshard.checkpoint.restore: no checkpoint directory {path!r}.")
    ckptr = ocp.StandardCheckpointer()
    meta = ckptr.metadata(path)
    where = path

    def run(restore_target):
      with ckptr:
        return ckptr.restore(path, restore_target, strict=False)

  recorded = (meta.custom_metadata or {}).get(_META)
  if recorded is None:
    raise ValueError(
        f"gshard.checkpoint.restore: {where} was not written by gshard.checkpoint.save "
        "(its metadata has no record of the logical shapes). Restore it with orbax "
        "directly: ocp.StandardCheckpointer().restore(path, target).")
  saved = recorded["leaves"]
  pairs, treedef = _flatten(jax.tree.map(_as_target, target, is_leaf=is_padded),
                           "restore")
  _check_structure(saved, [k for k, _ in pairs], where)
  for key, x in pairs:
    _check_leaf(key, x, saved[key], where)
  as_data = [_is_key(_stored(x)) and "key_impl" in saved[k] for k, x in pairs]
  restore_target = jax.tree_util.tree_unflatten(
      treedef, [_data_target(_stored(x)) if d else _stored(x)
                for (_, x), d in zip(pairs, as_data)])
  restored = run(restore_target)
  flat = [jax.random.wrap_key_data(r, impl=saved[k]["key_impl"]) if d
          else _weak(r) if getattr(x, "weak_type", False) else r
          for (k, x), d, r in zip(pairs, as_data, jax.tree_util.tree_leaves(restored))]
  return jax.tree_util.tree_unflatten(
      treedef, [_with_data(x, r) if is_padded(x) else r for (_, x), r in zip(pairs, flat)])


def _weak(x):
  """``x`` weakly typed, as its target: a step counter traced from a Python
  ``0`` (``TrainState.step``) is a weak ``int32``, and a strong one restored
  into the step would trace it anew (orbax restores every array strong)."""
  from jax.extend.core.primitives import convert_element_type_p
  if jax.typeof(x).weak_type:
    return x
  return convert_element_type_p.bind(x, new_dtype=x.dtype, weak_type=True, sharding=None)


def _check_structure(saved: dict, wanted: list[str], where: str) -> None:
  have, want = set(saved), set(wanted)
  missing, extra = sorted(want - have), sorted(have - want)
  if missing or extra:
    lines = [f"gshard.checkpoint.restore: the checkpoint at {where} does not have the "
             "target's structure."]
    if missing:
      lines.append(f"  in the target, not in the checkpoint: {', '.join(missing[:8])}"
                   + (" ..." if len(missing) > 8 else ""))
    if extra:
      lines.append(f"  in the checkpoint, not in the target: {', '.join(extra[:8])}"
                   + (" ..." if len(extra) > 8 else ""))
    lines.append("  Build the target from the same state tree you saved (e.g. "
                 "gshard.checkpoint.abstract_args(step, ...)[:2] for (params, opt_state)).")
    raise ValueError("\n".join(lines))


def _check_leaf(key: str, x, saved: dict, where: str) -> None:
  logical = tuple(x.shape)
  data = _stored(x)
  saved_logical = tuple(saved["logical"])
  if saved_logical != logical:
    raise ValueError(
        f"gshard.checkpoint.restore: leaf {key}: the checkpoint at {where} holds shape "
        f"{list(saved_logical)}, the target wants {list(logical)}. The checkpoint is of "
        "another model or configuration; build the target from the state you saved.")
  if saved["dtype"] != _dtype_str(data):
    raise ValueError(
        f"gshard.checkpoint.restore: leaf {key}: the checkpoint holds {saved['dtype']}, "
        f"the target wants {_dtype_str(data)}. Restore with the saved dtype and convert "
        "after.")
  stored = tuple(saved.get("shape", saved_logical))
  if (not is_padded(x) and getattr(x, "sharding", None) is None
      and stored != saved_logical):
    raise ValueError(
        f"gshard.checkpoint.restore: leaf {key}: the target gives no sharding (a "
        f"ShapeDtypeStruct of shape {list(logical)}, as jax.eval_shape makes), and the "
        f"checkpoint at {where} holds it padded to {list(stored)} for an uneven split; "
        "orbax would place it as saved, which jax cannot hold at the logical shape. "
        "Give the target's layouts: gshard.checkpoint.abstract_args(step, ...), or "
        "jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P())) for a "
        "replicated leaf.")
  full = tuple(data.shape)
  if any(f < n for f, n in zip(full, logical)):
    raise ValueError(f"gshard.checkpoint.restore: leaf {key}: a padded array of shape "
                     f"{list(full)} cannot hold the logical shape {list(logical)}.")
  sharding = getattr(data, "sharding", None)
  if isinstance(sharding, NamedSharding):
    _check_divides(key, full, sharding)


def _check_divides(key: str, shape, sharding: NamedSharding) -> None:
  sizes = dict(sharding.mesh.shape)
  for d, entry in enumerate(tuple(sharding.spec)[:len(shape)]):
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    unknown = [a for a in axes if a not in sizes]
    if unknown:
      raise ValueError(
          f"gshard.checkpoint.restore: leaf {key}: its target sharding {sharding.spec} "
          f"names mesh axis {unknown[0]!r}, which the mesh {sizes} does not have.")
    n = int(np.prod([sizes[a] for a in axes], dtype=np.int64))
    if shape[d] % n:
      raise ValueError(
          f"gshard.checkpoint.restore: leaf {key}: the mesh {sizes} cannot hold shape "
          f"{list(shape)} as {sharding.spec}: dim {d} of {shape[d]} does not split "
          f"{n} ways, and jax places arrays only evenly. Restore it padded (the "
          f"target gshard.checkpoint.abstract_args(step, ...) gives) or with that dim "
          "unsplit.")


__all__ = ["abstract_args", "is_padded", "restore", "save"]
