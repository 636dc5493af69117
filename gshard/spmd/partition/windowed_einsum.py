"""Windowed einsum: a ``dot_general`` that would gather an operand (or
reduce-scatter its result) runs as a ring of ``ppermute`` steps instead.

GShard §3.3.2 option (c) as a loop; XLA calls it windowed einsum or
collective matmul. Opt-in: ``gshard.partition(..., windowed_einsum=bytes)``.

**Gather** (``kind="gather"``). The local plan (``plan.plan_local``)
gathers operand ``j`` over mesh axes ``A`` (``n`` devices) on one dim ``d``,
whose factor ``f`` the plan leaves split only over the axes before ``A`` (the
prefix). Device ``a`` of the ring holds block ``a`` of ``n`` of the prefix
block. Megatron's sequence parallel::

    x f32[B, T@model, D]  .  W f32[D, H@model]  ->  y f32[B, T, H@model]
    plan: all_gather x over model on T, then the local dot
    ring: for s in 0..n-1: k = (a + s) % n          # the block this device holds
            y[:, k*T/n:(k+1)*T/n] = x_k . W_a        # its rows of y
            x_k -> device a - 1                      # n-1 ppermutes in all

Where ``f`` is also a factor of the other operand (a batch dim, or a
contracting dim: ``dW = x^T dy`` with ``x`` split on the contracted T), that
operand is sliced to block ``k`` along ``f``; where the result has no ``f``
(``f`` contracted), the steps' partial products are added (in f32 for 16-bit
floats, cast once at the end) instead of written to rows.

**Reduce-scatter** (``kind="scatter"``, the dual). The plan's result is a
pending sum over ``A`` (a contracting dim split over ``A``) and its
propagated layout reduce-scatters it over ``A`` on dim ``e`` (factor ``f``).
Each step computes the partial product of one block of ``f`` (operands
holding ``f`` sliced to it) and adds the sum received from the next device::

    for s in 0..n-1: b = (a + s + 1) % n
        acc = recv + partial(block b)         # s = 0: no recv
        acc -> device a - 1                   # s < n-1
    device a ends with the full sum of its block a

Both send what the collective they replace sends (``n-1`` blocks =
``(n-1)/n`` of the gathered operand, or of the full partial result) and hold
two blocks at a time instead of the whole.

Loops. The gather whose factor is in the result and the reduce-scatter are
unrolled: ``n-1`` collective-permutes in straight-line code, as XLA's own
collective matmul, so its schedulers may overlap each permute with the
neighbouring step's dot (mesh axes are small: ``n <= 64``). The ring of
blocks of one value is made once per trace (``Context.once``): a second dot
of the same operand reads the same blocks, as XLA's CSE would make it, so
the record matches the compiled program. The contracted gather is a
``lax.fori_loop`` carrying the block and the sum (one ppermute in the loop
body, run ``n-1`` times): unrolled, XLA fuses the ``n`` additions into one
that reads all ``n`` partial products at once, each the size of the result.

When. At or above the threshold, and only where the ring holds less than
what it replaces (:func:`_ring_bytes`): over 2 devices the two blocks are
the gathered operand, so it never runs there. The plan's collective is also
kept for a dim not divisible by its shards (padding), bool results, and a
gather or scatter that is not exactly the minor-most axes of one dim.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from gshard.spmd import collectives
from gshard.spmd.partition.context import Context, Value
from gshard.spmd.sharding import TensorSharding, itemsize


@dataclasses.dataclass(frozen=True)
class Window:
  """How one ``dot_general`` runs as a ring.

  Attributes:
    kind: ``gather`` (operand ``operand`` circulates) or ``scatter`` (the
      partial result circulates).
    operand: the circulating operand (``gather``), else None.
    axes: the ring's mesh axes, major first; ``n`` devices.
    block: the local length of one block of the windowed factor.
    op_dims: per operand, the dim holding the windowed factor (None: none).
    result_dim: the result dim holding it (None: contracted, ``gather`` only).
    results: the result shardings the ring produces.
    gathered: bytes per device the plan's collective would hold whole.
    held: bytes per device the ring holds at a time (:func:`_ring_bytes`).
  """

  kind: str
  operand: int | None
  axes: tuple[str, ...]
  n: int
  block: int
  op_dims: tuple[int | None, ...]
  result_dim: int | None
  results: tuple[TensorSharding, ...]
  gathered: int
  held: int


def _local_bytes(s: TensorSharding, shape, dtype, sizes) -> int:
  return math.prod(s.local_shape(shape, sizes)) * itemsize(dtype)


def cut_axes(wide: TensorSharding, narrow: TensorSharding):
  """``(dim, axes)`` when ``narrow`` is ``wide`` with the minor-most ``axes`` of
  one dim removed (an all-gather of them), else None.

  ``[_, (data, model), _]`` vs ``[_, (data,), _]`` -> ``(1, ("model",))``.
  """
  if len(wide.dims) != len(narrow.dims):
    return None
  cut = None
  for d, (w, s) in enumerate(zip(wide.dims, narrow.dims)):
    if w == s:
      continue
    if cut is not None or len(w) <= len(s) or w[:len(s)] != s:
      return None
    cut = (d, tuple(w[len(s):]))
  return cut


def _dims_of(rule_dims, factor) -> int | None:
  """The dim of one operand (or result) whose factors are exactly ``factor``."""
  hits = [d for d, fs in enumerate(rule_dims) if fs == factor]
  return hits[0] if len(hits) == 1 else None


def _holds(factor, rule_dims_list, shardings, prefix) -> tuple[int | None, ...] | None:
  """Per tensor, the dim holding ``factor`` (split over ``prefix`` only), or
  None where the tensor has no such dim; None if one holds it otherwise."""
  out = []
  for dims, s in zip(rule_dims_list, shardings):
    if any(factor[0] in fs for fs in dims) and _dims_of(dims, factor) is None:
      return None           # in a compound dim: not windowed
    d = _dims_of(dims, factor)
    if d is not None and (s is None or s.dims[d] != prefix):
      return None
    out.append(d)
  return tuple(out)


def choose(ctx: Context, eqn, plan, ins: list[Value], scope) -> Window | None:
  """The ring ``eqn`` runs as, or None for the plan's collectives.

  Only with ``ctx.windowed_einsum`` set, for ``dot_general``: the largest
  operand the plan gathers on one dim, if its gathered bytes per device reach
  the threshold; else the result, if its full partial sum does; in both, only
  where the ring holds less (:func:`_ring_bytes`).
  """
  threshold = ctx.windowed_einsum
  if threshold is None or eqn.primitive.name != "dot_general":
    return None
  out_var = eqn.outvars[0]
  if np.dtype(out_var.aval.dtype) == np.bool_:
    return None
  rule, sizes = plan.rule, ctx.mesh_sizes
  best = None
  for j, (v, s) in enumerate(zip(ins, plan.operands)):
    if s is None or v.literal or s.partial != v.sharding.partial:
      continue
    cut = cut_axes(v.sharding, s)
    if cut is None:
      continue
    d, axes = cut
    n = ctx.num_shards(axes)
    if n < 2 or v.shape[d] % ctx.num_shards(v.sharding.dims[d]):
      continue
    gathered = _local_bytes(s, v.shape, v.dtype, sizes)
    if gathered < threshold or (best is not None and gathered <= best.gathered):
      continue
    factor = rule.operands[j][d]
    op_dims = _holds(factor, rule.operands, plan.operands, s.dims[d])
    res_dims = _holds(factor, rule.results, plan.results, s.dims[d])
    if op_dims is None or res_dims is None or op_dims[j] != d:
      continue
    held = _ring_bytes(ctx, eqn, plan, ins, op_dims, j, res_dims[0], n)
    result = _local_bytes(plan.results[0], tuple(out_var.aval.shape), out_var.aval.dtype,
                          sizes)
    if held >= gathered + (result if res_dims[0] is None else 0):
      continue
    best = Window("gather", j, axes, n, v.shape[d] // ctx.num_shards(v.sharding.dims[d]),
                  op_dims, res_dims[0], tuple(plan.results), gathered, held)
  if best is not None:
    return best
  return _scatter(ctx, eqn, plan, ins, scope, threshold)


def _ring_bytes(ctx: Context, eqn, plan, ins, op_dims, j, e, n: int) -> int:
  """Bytes per device the ring holds at a time, beyond the operands and the
  result: two blocks of what circulates (the one in use, the one arriving), a
  partial product (and the running sum, when it is not the result), and one
  block of every other operand holding the windowed factor (sliced per step).

  The plan instead holds the gathered operand (and the result), or the
  full partial result before its reduce-scatter: a ring that would hold as
  much is not used (e.g. ``dW = x^T dy`` with ``dy`` much larger than ``x``:
  its blocks of ``dy`` cost more than gathering ``x``).
  """
  sizes, out_var = ctx.mesh_sizes, eqn.outvars[0]
  shape, dtype = tuple(out_var.aval.shape), out_var.aval.dtype
  slices = sum(_local_bytes(s, v.shape, v.dtype, sizes) // n
               for i, (v, s, d) in enumerate(zip(ins, plan.operands, op_dims))
               if i != j and d is not None)
  result = _local_bytes(plan.results[0], shape, dtype, sizes)
  if j is None:                       # reduce-scatter: sums of one block circulate
    return 3 * (result // n) + slices
  block = _local_bytes(ins[j].sharding, ins[j].shape, ins[j].dtype, sizes)
  if e is None:                       # contracted: a running sum and a product
    return 2 * block + 2 * (result // itemsize(dtype)) * \
        _accumulates_in(dtype).itemsize + slices
  return 2 * block + result // n + slices


def _scatter(ctx: Context, eqn, plan, ins, scope, threshold) -> Window | None:
  """The dual: the result's reduce-scatter over ``A`` as a ring."""
  out_var = eqn.outvars[0]
  if type(out_var).__name__ == "DropVar":
    return None
  res, target = plan.results[0], ctx.target(scope, out_var)
  cut = cut_axes(target, res)
  if cut is None:
    return None
  e, axes = cut
  if not set(axes) <= res.partial or target.partial != res.partial - set(axes):
    return None
  shape, dtype, sizes = tuple(out_var.aval.shape), out_var.aval.dtype, ctx.mesh_sizes
  n = ctx.num_shards(axes)
  if n < 2 or shape[e] % ctx.num_shards(target.dims[e]):
    return None
  full = _local_bytes(res, shape, dtype, sizes)
  if full < threshold:
    return None
  factor = plan.rule.results[0][e]
  op_dims = _holds(factor, plan.rule.operands, plan.operands, res.dims[e])
  if op_dims is None or _dims_of(plan.rule.results[0], factor) != e:
    return None
  held = _ring_bytes(ctx, eqn, plan, ins, op_dims, None, e, n)
  if held >= full:
    return None
  return Window("scatter", None, axes, n, shape[e] // ctx.num_shards(target.dims[e]),
                op_dims, e, (target,), full, held)


def _block(x, k, length: int, dim: int | None):
  return x if dim is None else lax.dynamic_slice_in_dim(x, k * length, length, axis=dim)


def _accumulates_in(dtype):
  """The dtype partial products are added in: f32 for 16-bit floats."""
  if jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype).itemsize < 4:
    return np.dtype(np.float32)
  return np.dtype(dtype)


def run(ctx: Context, eqn, window: Window, plan, ins: list[Value], xs: list,
        params: dict) -> list:
  """The ring's local result: ``xs`` are the operands as the plan holds them
  (masked), except the circulating one, which is as it arrived. Each
  ``ppermute`` is recorded against ``eqn``."""
  n, axes = window.n, window.axes
  index = ctx.linear_index(axes)

  def bind(operands, k, **extra):
    return eqn.primitive.bind(*[x if blk else _block(x, k, window.block, d)
                                for (x, blk), d in zip(operands, window.op_dims)],
                              **dict(params, **extra))

  def send(x, s, what, src, dst, shape, dtype):
    ctx.record("ppermute", axes, int(np.size(x)) * itemsize(x.dtype), eqn,
               f"{what} windowed einsum step {s + 1}/{n - 1}", src, dst, shape, dtype)
    return collectives.permute(x, axes, ctx.mesh_sizes, lambda i: (i - 1) % n)

  out_var = eqn.outvars[0]
  if window.kind == "scatter":
    acc = None
    for s in range(n):
      part = bind([(x, False) for x in xs], (index + s + 1) % n)
      acc = part if acc is None else acc + part
      if s < n - 1:
        acc = send(acc, s, "result 0", plan.results[0], window.results[0],
                   tuple(out_var.aval.shape), out_var.aval.dtype)
    return [acc]

  j, e, v = window.operand, window.result_dim, ins[window.operand]

  def step_operands(blk):
    return [(blk, True) if i == j else (x, False) for i, x in enumerate(xs)]

  def ring_step(s, blk):
    return send(blk, s, f"operand {j}", v.sharding, plan.operands[j], v.shape, v.dtype)

  if e is None:
    # The windowed factor is contracted: the steps' partial products are
    # added. A loop carries the sum: unrolled, XLA fuses the n additions into
    # one that reads all n partial products at once.
    acc_dtype = _accumulates_in(out_var.aval.dtype)
    for s in range(n - 1):       # recorded per step; the loop body runs them
      ctx.record("ppermute", axes, int(np.size(xs[j])) * itemsize(xs[j].dtype), eqn,
                 f"operand {j} windowed einsum step {s + 1}/{n - 1}", v.sharding,
                 plan.operands[j], v.shape, v.dtype)

    def body(s, carry):
      blk, acc = carry
      nxt = collectives.permute(blk, axes, ctx.mesh_sizes, lambda i: (i - 1) % n)
      return nxt, acc + bind(step_operands(blk), (index + s) % n,
                             preferred_element_type=acc_dtype)
    local = plan.results[0].local_shape(tuple(out_var.aval.shape), ctx.mesh_sizes)
    blk, acc = lax.fori_loop(0, n - 1, body, (xs[j], jnp.zeros(local, acc_dtype)))
    acc = acc + bind(step_operands(blk), (index + n - 1) % n,
                     preferred_element_type=acc_dtype)
    return [acc.astype(out_var.aval.dtype)]

  # The windowed factor is in the result: each step writes its rows. The ring
  # of blocks is made once per value (a second dot of the same operand reads
  # the same blocks, as XLA's CSE would make it).
  def ring():
    blocks = [xs[j]]
    for s in range(n - 1):
      blocks.append(ring_step(s, blocks[-1]))
    return blocks
  blocks = ctx.once(("windowed einsum ring", v.sharding, axes), xs[j], ring)
  out = None
  for s, blk in enumerate(blocks):
    k = (index + s) % n                 # the block this device holds now
    part = bind(step_operands(blk), k)
    if out is None:
      shape = list(np.shape(part))
      shape[e] *= n
      out = jnp.zeros(shape, part.dtype)
    out = lax.dynamic_update_slice_in_dim(out, part, k * window.block, axis=e)
  return [out]
