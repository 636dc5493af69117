"""Batched matrix factorisations and solves, and FFTs.

Each operand and result is a batch (its leading dims, the same for every one
of them) of cores the primitive works on whole: matrices, vectors of
eigenvalues or pivots, the transformed dims of an FFT. The batch dims share
factors across all of them, like an elementwise op's; every core dim gets a
blocked factor of its own. A batch split over the mesh is factored, solved or
transformed where it lies, with no communication (each device its own
matrices); a split core dim is gathered first.

``cholesky(f32[8,4,4])`` is ``abc->ade blocked={bcde}``; ``eigh`` of it is
``abc->ade,af blocked={bcdef}`` (vectors, values); ``fft(c64[8,16,32],
fft_lengths=(32,))`` is ``abc->abd blocked={cd}`` (its per-device form works
round an XLA:CPU layout bug: ``partition/linalg.py``).
"""

from __future__ import annotations

import functools

from gshard.spmd.partition import linalg as partition
from gshard.spmd.registry import register
from gshard.spmd.rules._core import FactorRule, Factors, shapes

# Primitive -> the core rank of its first operand (the rest of its dims are
# the batch). Every one of them is computed matrix by matrix (LAPACK's loop
# over the batch on CPU), so a device's block of the batch gives the values
# the whole batch would.
MATRIX_CORE = {
    "cholesky": 2, "eigh": 2, "eig": 2, "qr": 2, "svd": 2, "lu": 2,
    "triangular_solve": 2, "lu_pivots_to_permutation": 1, "tridiagonal_solve": 1,
    "schur": 2, "hessenberg": 2, "tridiagonal": 2, "symmetric_product": 2,
    "cholesky_update": 2,
    # Householder QR's parts (jnp.linalg.qr(mode="raw"), slogdet(method="qr"),
    # jax.scipy.linalg.qr_multiply, hessenberg(calc_q=True))
    "geqrf": 2, "geqp3": 2, "ormqr": 2, "householder_product": 2,
}


def batched_rule(in_avals, out_avals, *, core: int, **params) -> FactorRule:
  """Leading dims shared by every operand and result (the batch); the last
  ``rank - batch`` dims of each tensor blocked, where ``batch`` is the first
  operand's rank less ``core``."""
  del params
  ins, outs = shapes(in_avals), shapes(out_avals)
  batch = len(ins[0]) - core
  lead = ins[0][:batch]
  if batch < 0 or any(tuple(s[:batch]) != tuple(lead) for s in ins + outs):
    raise NotImplementedError("operands and results do not share the batch dims")
  f = Factors()
  shared = [(f(n),) for n in lead]

  def dims(shape):
    return shared + [(f(n, blocked=True),) for n in shape[batch:]]
  return f.rule([dims(s) for s in ins], [dims(s) for s in outs])


def fft_rule(in_avals, out_avals, *, fft_lengths, **params) -> FactorRule:
  """The dims ``fft_lengths`` names (the last ones) are transformed whole."""
  return batched_rule(in_avals, out_avals, core=len(fft_lengths), **params)


for _name, _core in MATRIX_CORE.items():
  register(_name, functools.partial(batched_rule, core=_core))
register("fft", fft_rule, partition=partition.fft_rule)
