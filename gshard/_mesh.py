"""``make_mesh``: a device mesh with Auto axes."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh


def make_mesh(shape: Sequence[int], names: Sequence[str], *, devices=None) -> Mesh:
  """A mesh of ``shape`` named ``names`` whose axes are all ``Auto``.

  ``jax.make_mesh`` defaults to Explicit axes; ``gshard.partition`` takes such
  a mesh too and uses its axes as Auto (``gshard.spmd.sharding.with_auto_axes``).

  Example::

    mesh = gshard.make_mesh((2, 4), ("data", "model"))   # 8 devices
  """
  shape, names = tuple(shape), tuple(names)
  if len(shape) != len(names):
    raise ValueError(f"make_mesh(shape={shape}, names={names}): give one name per "
                     "mesh dimension.")
  if len(set(names)) != len(names):
    raise ValueError(f"make_mesh(shape={shape}, names={names}): names must be distinct.")
  if not all(isinstance(a, str) for a in names):
    raise TypeError(f"make_mesh(shape={shape}, names={names}): names must be strings.")
  if not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s >= 1
             for s in shape):
    raise ValueError(f"make_mesh(shape={shape}, names={names}): every size must be a "
                     "positive int.")
  n = 1
  for s in shape:
    n *= int(s)
  if devices is not None:
    if n > len(devices):
      raise ValueError(
          f"make_mesh(shape={shape}, names={names}) needs {n} devices but devices= has "
          f"{len(devices)}. Pass {n} devices, or a shape of {len(devices)} devices.")
  elif n > jax.device_count():
    raise ValueError(
        f"make_mesh(shape={shape}, names={names}) needs {n} devices but "
        f"{jax.device_count()} are available. On CPU, set XLA_FLAGS="
        f"--xla_force_host_platform_device_count={n} before importing jax, or use "
        f"jax.sharding.AbstractMesh({shape}, {names}) to lower without devices.")
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape),
                       devices=devices)
