"""Partition rule for FFTs: the generic rule, the transform bound on a block
with no size-1 batch dims.

XLA:CPU's FFT runs only on the default (row-major) layout, and its layout
assignment does not hold it to one (jaxlib 0.10.2): where a batch dim of
size 1 comes first and the next dim is all-gathered after the transform,
XLA lays the result out with the gathered dim major (the same bytes, since
the other dim has size 1) and the FFT then fails a check ("RET_CHECK failure
... fft_thunk.cc ... IsMonotonicWithDim0Major"). The same program written by
hand with ``shard_map`` fails the same way. The size-1 batch dims are
reshaped away around the transform, which leaves XLA no such layout to pick.
"""

from __future__ import annotations

import functools

from jax import lax

from gshard.spmd.partition.generic import generic_rule


def _without_unit_batch_dims(x, *, fft_lengths, **params):
  """``fft`` bound on ``x`` with its size-1 batch dims reshaped away."""
  core = len(fft_lengths)
  lead = tuple(x.shape[:x.ndim - core])
  kept = tuple(n for n in lead if n != 1)
  if kept == lead:
    return lax.fft_p.bind(x, fft_lengths=fft_lengths, **params)
  y = lax.fft_p.bind(x.reshape(kept + tuple(x.shape[x.ndim - core:])),
                     fft_lengths=fft_lengths, **params)
  return y.reshape(lead + tuple(y.shape[len(kept):]))


# ``fft`` on local blocks of the batch (``rules/linalg.py``)
fft_rule = functools.partial(generic_rule, bind=_without_unit_batch_dims)
