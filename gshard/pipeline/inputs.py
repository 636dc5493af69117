"""What ``layer_fn``'s ``x`` carries through a pipeline, beyond activations.

``keys_as_data``: typed PRNG keys ride through the stage buffers as their key
data (the buffers are masked, shifted and summed, which key arrays are not).
``warn_draws``: a random draw in ``layer_fn`` not made from per-row keys that
``x`` carries differs from the plain loop's (it draws per micro-batch).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from jax.extend.core import Literal

from gshard.spmd.collectives import is_key
from gshard.spmd.graph import sub_jaxprs
from gshard.spmd.partition.context import PartitionWarning
from gshard.spmd.source import source_of


def keys_as_data(x):
  """``x`` with its typed PRNG key leaves as their key data (uint32), and the
  function that wraps such a tree's leaves back (None: ``x`` has no keys).
  The pipeline buffers, masks, shifts and collects ``x`` with arithmetic that
  key arrays do not have; ``layer_fn`` and ``loss_fn`` still see keys."""
  leaves, tree = jax.tree.flatten(x)
  dtypes = [jnp.result_type(a) for a in leaves]
  keyed = [is_key(d) for d in dtypes]
  if not any(keyed):
    return x, None

  def wrap(y):
    return tree.unflatten([jax.random.wrap_key_data(a, dtype=d) if k else a
                           for a, d, k in zip(tree.flatten_up_to(y), dtypes, keyed)])
  return tree.unflatten([jax.random.key_data(a) if k else a
                         for a, k in zip(leaves, keyed)]), wrap


_DRAWS = frozenset({"random_bits", "threefry2x32", "rng_bit_generator", "rng_uniform"})


def warn_draws(jaxpr, from_x: set, rows: int) -> None:
  """A random draw in ``layer_fn`` (dropout) is made per micro-batch: its
  shape (and so its values) are not the whole batch's draw the plain loop
  makes from the same key. Not so for a draw per row from keys ``x`` carries
  (their leading dim the rows): each row draws from its own key either way."""
  found = _batch_draw(jaxpr, from_x, rows)
  if found is not None:
    draw, where = found
    warnings.warn(PartitionWarning(
        f"pipeline.run: layer_fn draws random numbers ({draw.primitive.name} at "
        f"{source_of(where)}). The pipeline runs layer_fn on one micro-batch at a "
        "time, so each draws its own bits for its rows: the values (a dropout mask) "
        "are as random, but not the plain loop's, which draws for the whole batch at "
        "once. For the same values, draw the randomness outside and pass it in x "
        "(the bits, or one key per row)."), stacklevel=4)


def _batch_draw(jaxpr, from_x: set, rows: int, outer=None):
  """The first draw of ``jaxpr`` not made from per-row keys derived from ``x``
  (``from_x``: its variables that depend on x) and the equation whose line
  names it (an inner jaxpr's: its outer equation), or None."""
  from_x = set(from_x)
  for eqn in jaxpr.eqns:
    reads = [not isinstance(v, Literal) and v in from_x for v in eqn.invars]
    if eqn.primitive.name in _DRAWS:
      key = eqn.invars[0] if eqn.invars else None
      shape = getattr(getattr(key, "aval", None), "shape", ())
      if not (reads and reads[0] and shape and shape[0] == rows):
        return eqn, outer or eqn
    for path, sub in sub_jaxprs(eqn.params):
      call = path == ("jaxpr",) and len(sub.invars) == len(eqn.invars)
      inner = {v for v, r in zip(sub.invars, reads) if r} if call else set()
      found = _batch_draw(sub, inner, rows, outer or eqn)
      if found is not None:
        return found
    if any(reads):
      from_x.update(eqn.outvars)
  return None
