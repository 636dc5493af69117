"""``jax_debug_nans`` / ``jax_debug_infs`` with a partitioned function.

``jax.jit`` finds a NaN in its output, re-runs the function op by op and
raises ``FloatingPointError`` at the primitive that made it, with the user's
line. A partitioned program's re-run is its per-device program under
``shard_map``, whose op-by-op form jax cannot re-run (its internal error,
from gshard's frames). :func:`localize` re-runs the user's function op by op
on the logical values instead: jax's own error at the user's line, or, where
that run makes no NaN, gshard's error saying the partitioned program alone
did (a gshard bug).
"""

from __future__ import annotations

import jax

from gshard.spmd.partition.padded import unpad


def failed_check(e: BaseException) -> bool:
  """Whether ``e`` is jax's NaN / inf check failing on a partitioned call."""
  on = jax.config.jax_debug_nans or jax.config.jax_debug_infs
  return bool(on) and (isinstance(e, FloatingPointError)
                       or type(e).__name__ == "InternalFloatingPointError")


def localize(fn, args, name: str, err: BaseException) -> BaseException:
  """Run ``fn(*args)`` op by op (raising jax's ``FloatingPointError`` where a
  primitive makes a NaN or inf); the error to raise where it does not."""
  with jax.disable_jit():
    fn(*unpad(args))
  return FloatingPointError(
      f"jax_debug_nans / jax_debug_infs: the partitioned {name} produced a NaN or inf "
      f"({err}), but running {name} op by op on one device did not. The partitioned "
      "program alone makes it: a gshard bug. Please report it with this program "
      "(gshard.partition(..., strict=True) shows any safe path it took).")
