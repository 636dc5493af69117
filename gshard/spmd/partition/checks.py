"""The checks of :func:`gshard.partition`'s own arguments (``windowed_einsum``,
``donate_argnums``, a donated array passed twice): each bad value is an error
that names it and says what to pass instead.
"""

from __future__ import annotations

import jax
import numpy as np

from gshard.spmd.sharding import short_dtype


def check_windowed(windowed_einsum) -> float | None:
  """``windowed_einsum`` as a byte threshold (``None``: never); anything else
  is an error that says what to pass."""
  if windowed_einsum is None:
    return None
  ok = isinstance(windowed_einsum, (int, float, np.integer, np.floating)) and \
      not isinstance(windowed_einsum, (bool, np.bool_))
  if not ok or not windowed_einsum >= 0:     # also refuses NaN
    raise ValueError(
        f"windowed_einsum={windowed_einsum!r}: expected None (never) or a size in bytes "
        "per device >= 0: a dot_general whose operand gather (or result "
        "reduce-scatter) would hold at least that many bytes runs as a ring of "
        "ppermutes instead. Pass e.g. windowed_einsum=0 (every such dot_general) or "
        "windowed_einsum=2**20 (1 MiB and up).")
  return float(windowed_einsum)


def check_donated_alias(name: str, args, donated) -> None:
  """A donated array passed twice (``ema = params``, then
  ``step(params, ema)``) is an error before the call: XLA would free the
  buffer while the other use still reads it (XLA:CPU crashes)."""
  seen: dict[int, int] = {}          # id of an array -> the first argument holding it
  for pos, arg in enumerate(args):
    for leaf in jax.tree_util.tree_leaves(arg):
      if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
        continue
      first = seen.get(id(leaf))
      if first is None:
        seen[id(leaf)] = pos
      elif first in donated or pos in donated:
        arr = f"{short_dtype(leaf.dtype)}[{','.join(map(str, leaf.shape))}]"
        what = (f"arguments {first} and {pos} hold the same array ({arr})"
                if first != pos else f"argument {pos} holds one array ({arr}) twice")
        raise ValueError(
            f"{name}: {what}, and "
            f"donate_argnums={tuple(donated)} donates it: its buffer would be "
            "freed while the other use still reads it. Pass a copy for one of "
            "them (e.g. jax.tree.map(jnp.copy, ema)) or do not donate it.")


def check_donate(donate_argnums) -> tuple[int, ...]:
  """``donate_argnums`` as a sorted tuple of ints; anything else is an error."""
  nums = (donate_argnums,) if isinstance(donate_argnums, (int, np.integer)) or \
      not isinstance(donate_argnums, (tuple, list, range)) else tuple(donate_argnums)
  for n in nums:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
      raise TypeError(f"donate_argnums={donate_argnums!r}: {n!r} is not an int. Give "
                      "the positions of the arguments to donate: an int or a tuple of "
                      "ints, e.g. donate_argnums=(0,).")
    if n < 0:
      raise ValueError(f"donate_argnums={donate_argnums!r}: {n} is negative. Count "
                       "positions from 0 (the first argument is 0).")
  return tuple(sorted({int(n) for n in nums}))
