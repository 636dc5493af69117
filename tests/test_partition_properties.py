"""Random programs, random meshes, random specs: partitioning never changes a result.

Hypothesis draws a mesh of up to 8 real devices (1-D or 2-D), a program over
the primitives gshard partitions itself (elementwise, dot_general, reshape,
transpose, broadcast, reduce_sum/max/min, cumsum, argmax, softmax and
logsumexp chains) with random ``gshard.shard`` / ``gshard.split`` annotations,
and random valid ``in_specs`` (each split dim divisible). Then:

* the partitioned result equals the unpartitioned result, for the program
  and for ``jax.value_and_grad`` of a loss over it;
* with random ``out_specs``, every device's shard of every output equals the
  numpy block of the unpartitioned result that the spec assigns to that
  device (a per-device reference computed on the host, sharing no code with
  gshard);
* no equation of these programs takes the safe path (PartitionWarning is an
  error here: every primitive drawn has a partition rule).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import gshard
from gshard.spmd.source import source_of
from helpers_partition import assert_named_sharding, check_shards_against_reference, mesh

pytestmark = pytest.mark.filterwarnings("error::gshard.PartitionWarning")

MESHES = [((8,), ("x",)), ((4,), ("x",)), ((2,), ("x",)), ((2, 4), ("x", "y")),
          ((4, 2), ("x", "y")), ((2, 2), ("x", "y")), ((1, 8), ("x", "y")),
          ((8, 1), ("x", "y"))]
DIM_SIZES = (2, 4, 8, 12, 16)
MAX_ELEMS = 1024
MAX_RANK = 3

UNARY = {
    "sin": jnp.sin, "tanh": jnp.tanh, "neg": jnp.negative, "cos": jnp.cos,
    "abs": jnp.abs, "logistic": jax.nn.sigmoid, "gelu": jax.nn.gelu,
    "exp_tanh": lambda x: jnp.exp(jnp.tanh(x)),
}
BINARY = {"add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply,
          "max": jnp.maximum, "min": jnp.minimum}


# -- programs -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Program:
  """A straight-line program over ``tensors``: inputs and op results, in order.

  ``ops[k]`` makes tensor ``k``; each op is a tuple ``(kind, *args)`` whose
  tensor arguments are indices of earlier tensors. ``("input", j)`` reads the
  j-th argument.
  """

  ops: tuple[tuple, ...]
  inputs: tuple[tuple[tuple[int, ...], int | None], ...]   # (shape, index bound)
  outputs: tuple[int, ...]

  @property
  def input_shapes(self) -> list[tuple[int, ...]]:
    return [shape for shape, _ in self.inputs]

  @property
  def float_inputs(self) -> tuple[int, ...]:
    return tuple(j for j, (_, bound) in enumerate(self.inputs) if bound is None)

  def make_inputs(self, rng) -> list[np.ndarray]:
    return [rng.standard_normal(shape).astype(np.float32) if bound is None
            else rng.integers(0, bound, shape).astype(np.int32)
            for shape, bound in self.inputs]

  def __call__(self, *xs):
    env = []
    for op in self.ops:
      env.append(_apply(op, env, xs))
    return tuple(env[i] for i in self.outputs)


def _apply(op, env, xs):
  kind, *a = op
  if kind == "input":
    return jnp.asarray(xs[a[0]])
  if kind == "unary":
    return UNARY[a[0]](env[a[1]])
  if kind == "binary":
    return BINARY[a[0]](env[a[1]], env[a[2]])
  if kind == "affine":
    return env[a[0]] * a[1] + a[2]
  if kind == "matmul":          # [..., k] x [k, n] -> [..., n]
    return jnp.einsum("...k,kn->...n", env[a[0]], env[a[1]])
  if kind == "bmm":             # [b, m, k] x [b, k, n] -> [b, m, n]
    return jnp.einsum("bmk,bkn->bmn", env[a[0]], env[a[1]])
  if kind == "gram":            # [m, k] x [n, k] -> [m, n]
    return jnp.einsum("mk,nk->mn", env[a[0]], env[a[1]])
  if kind == "reshape":
    return jnp.reshape(env[a[0]], a[1])
  if kind == "transpose":
    return jnp.transpose(env[a[0]], a[1])
  if kind == "broadcast":       # a new dim of size a[2] at position a[1]
    x = jnp.expand_dims(env[a[0]], a[1])
    shape = list(x.shape)
    shape[a[1]] = a[2]
    return jnp.broadcast_to(x, shape)
  if kind == "reduce":
    fn = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min, "mean": jnp.mean}[a[0]]
    return fn(env[a[1]], axis=a[2])
  if kind == "softmax":
    return jax.nn.softmax(env[a[0]], axis=a[1])
  if kind == "logsumexp":
    return jax.nn.logsumexp(env[a[0]], axis=a[1])
  if kind == "cumsum":
    return jnp.cumsum(env[a[0]], axis=a[1])
  if kind == "argmax":          # the index as f32, so the chain continues
    return jnp.argmax(env[a[0]], axis=a[1]).astype(jnp.float32)
  if kind == "slice":           # x[..., start:stop:step, ...] on dim a[1]
    idx = [slice(None)] * env[a[0]].ndim
    idx[a[1]] = slice(a[2], a[3], a[4])
    return env[a[0]][tuple(idx)]
  if kind == "pad":             # zero (low, high) padding of dim a[1]
    widths = [(0, 0)] * env[a[0]].ndim
    widths[a[1]] = (a[2], a[3])
    return jnp.pad(env[a[0]], widths)
  if kind == "concat":
    return jnp.concatenate([env[a[0]], env[a[1]]], axis=a[2])
  if kind == "flip":
    return jnp.flip(env[a[0]], axis=a[1])
  if kind == "take":            # a lookup: rows of dim a[2] at int indices a[1]
    return jnp.take(env[a[0]], env[a[1]], axis=a[2])
  if kind == "shard":
    return gshard.shard(env[a[0]], P(*a[1]))
  if kind == "split":
    return gshard.split(env[a[0]], a[1], a[2])
  raise ValueError(kind)


def _spec_entry(axes):
  return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


@st.composite
def specs(draw, shape, sizes: dict[str, int]):
  """A valid PartitionSpec for ``shape``: each axis once, every split divisible."""
  free = list(sizes)
  free = draw(st.permutations(free))
  entries = []
  for n in shape:
    axes = []
    for a in list(free):       # split with probability 2/3 where it divides
      divides = n % (math.prod(sizes[b] for b in axes) * sizes[a]) == 0
      if draw(st.integers(0, 2)) and divides:
        axes.append(a)
        free.remove(a)
    entries.append(_spec_entry(axes))
  while entries and entries[-1] is None and draw(st.booleans()):
    entries.pop()             # a shorter spec leaves trailing dims unsplit
  return tuple(entries)


def _size(shape) -> int:
  return math.prod(shape)


@st.composite
def programs(draw, sizes: dict[str, int]):
  """A random Program (and its input shapes) whose annotations fit ``sizes``."""
  ops: list[tuple] = []
  shapes: list[tuple[int, ...]] = []
  inputs: list[tuple[tuple[int, ...], int | None]] = []
  is_index: list[bool] = []      # int32 indices: only ``take`` reads them

  def add_input(shape, bound=None):
    """A new argument: f32, or int32 indices in [0, bound)."""
    ops.append(("input", len(inputs)))
    inputs.append((tuple(shape), bound))
    shapes.append(tuple(shape))
    is_index.append(bound is not None)
    return len(shapes) - 1

  def dims(k):
    return tuple(draw(st.sampled_from(DIM_SIZES)) for _ in range(k))

  rank = draw(st.integers(1, MAX_RANK))
  first = dims(rank)
  while _size(first) > MAX_ELEMS:
    first = first[1:]
  add_input(first)
  n_ops = draw(st.integers(1, 7))
  kinds = ["unary", "binary", "affine", "matmul", "bmm", "gram", "reshape", "transpose",
           "broadcast", "reduce", "softmax", "logsumexp", "cumsum", "argmax", "slice",
           "pad", "concat", "flip", "take", "shard", "split"]
  for _ in range(n_ops):
    kind = draw(st.sampled_from(kinds))
    i = draw(st.sampled_from([k for k, idx in enumerate(is_index) if not idx]))
    s = shapes[i]
    r = len(s)
    if kind == "unary":
      op, out = ("unary", draw(st.sampled_from(sorted(UNARY))), i), s
    elif kind == "binary":
      same = [j for j, t in enumerate(shapes) if t == s and not is_index[j]]
      j = draw(st.sampled_from(same)) if draw(st.booleans()) else add_input(s)
      op, out = ("binary", draw(st.sampled_from(sorted(BINARY))), i, j), s
    elif kind == "affine":
      op, out = ("affine", i, draw(st.sampled_from([0.5, -1.5, 2.0])),
                 draw(st.sampled_from([0.0, 0.25]))), s
    elif kind == "matmul" and r >= 1:
      n = draw(st.sampled_from(DIM_SIZES))
      if _size(s[:-1]) * n > MAX_ELEMS:
        continue
      w = add_input((s[-1], n))
      op, out = ("matmul", i, w), s[:-1] + (n,)
    elif kind == "bmm" and r == 3:
      n = draw(st.sampled_from(DIM_SIZES))
      if s[0] * s[1] * n > MAX_ELEMS:
        continue
      w = add_input((s[0], s[2], n))
      op, out = ("bmm", i, w), (s[0], s[1], n)
    elif kind == "gram" and r == 2:
      n = draw(st.sampled_from(DIM_SIZES))
      w = add_input((n, s[1]))
      op, out = ("gram", i, w), (s[0], n)
    elif kind == "reshape" and r >= 1:
      if r >= 2 and draw(st.booleans()):           # merge dims d, d+1
        d = draw(st.integers(0, r - 2))
        out = s[:d] + (s[d] * s[d + 1],) + s[d + 2:]
      elif r < MAX_RANK:                             # split dim d into (a, n / a)
        d = draw(st.integers(0, r - 1))
        divs = [a for a in range(2, s[d]) if s[d] % a == 0]
        if not divs:
          continue
        a = draw(st.sampled_from(divs))
        out = s[:d] + (a, s[d] // a) + s[d + 1:]
      else:
        continue
      op = ("reshape", i, out)
    elif kind == "transpose" and r >= 2:
      perm = tuple(draw(st.permutations(range(r))))
      op, out = ("transpose", i, perm), tuple(s[p] for p in perm)
    elif kind == "broadcast" and r < MAX_RANK:
      n = draw(st.sampled_from(DIM_SIZES))
      if _size(s) * n > MAX_ELEMS:
        continue
      pos = draw(st.integers(0, r))
      op, out = ("broadcast", i, pos, n), s[:pos] + (n,) + s[pos:]
    elif kind == "reduce" and r >= 2:
      ax = draw(st.integers(0, r - 1))
      op = ("reduce", draw(st.sampled_from(["sum", "max", "min", "mean"])), i, ax)
      out = s[:ax] + s[ax + 1:]
    elif kind == "softmax" and r >= 1:
      op, out = ("softmax", i, draw(st.integers(0, r - 1))), s
    elif kind == "logsumexp" and r >= 2:
      ax = draw(st.integers(0, r - 1))
      op, out = ("logsumexp", i, ax), s[:ax] + s[ax + 1:]
    elif kind == "cumsum" and r >= 1:
      op, out = ("cumsum", i, draw(st.integers(0, r - 1))), s
    elif kind == "argmax" and r >= 2:
      ax = draw(st.integers(0, r - 1))
      op, out = ("argmax", i, ax), s[:ax] + s[ax + 1:]
    elif kind == "slice":
      d = draw(st.integers(0, r - 1))
      start = draw(st.integers(0, s[d] - 1))
      stop = draw(st.integers(start + 1, s[d]))
      step = draw(st.sampled_from([1, 1, 2]))
      out = s[:d] + (len(range(start, stop, step)),) + s[d + 1:]
      op = ("slice", i, d, start, stop, step)
    elif kind == "pad":
      d = draw(st.integers(0, r - 1))
      lo, hi = draw(st.integers(0, 4)), draw(st.integers(0, 4))
      if _size(s) // s[d] * (s[d] + lo + hi) > MAX_ELEMS:
        continue
      op, out = ("pad", i, d, lo, hi), s[:d] + (s[d] + lo + hi,) + s[d + 1:]
    elif kind == "concat":
      d = draw(st.integers(0, r - 1))
      n = draw(st.sampled_from(DIM_SIZES))
      if _size(s) // s[d] * (s[d] + n) > MAX_ELEMS:
        continue
      j = add_input(s[:d] + (n,) + s[d + 1:])
      op, out = ("concat", i, j, d), s[:d] + (s[d] + n,) + s[d + 1:]
    elif kind == "flip":
      op, out = ("flip", i, draw(st.integers(0, r - 1))), s
    elif kind == "take" and r <= 2:
      d = draw(st.integers(0, r - 1))
      k = draw(st.sampled_from(DIM_SIZES))
      j = add_input((k,), bound=s[d])
      op, out = ("take", i, j, d), s[:d] + (k,) + s[d + 1:]
    elif kind == "shard":
      op, out = ("shard", i, draw(specs(s, sizes))), s
    elif kind == "split":
      d = draw(st.integers(0, r - 1))
      ok = [a for a in sizes if s[d] % sizes[a] == 0]
      if not ok:
        continue
      op, out = ("split", i, d, draw(st.sampled_from(ok))), s
    else:
      continue
    ops.append(op)
    shapes.append(out)
    is_index.append(False)
  last = len(shapes) - 1
  outs = [last]
  if draw(st.booleans()) and last > 0:
    other = draw(st.integers(0, last - 1))
    if ops[other][0] != "input":        # an intermediate as a second output
      outs.append(other)
  prog = Program(tuple(ops), tuple(inputs), tuple(outs))
  return prog, [shapes[o] for o in outs]


@st.composite
def cases(draw, with_out_specs: bool = False):
  """(mesh, program, inputs, in_specs, out_specs or None)."""
  mesh_shape, names = draw(st.sampled_from(MESHES))
  sizes = dict(zip(names, mesh_shape))
  prog, out_shapes = draw(programs(sizes))
  in_specs = tuple(P(*draw(specs(s, sizes))) if j == 0 or draw(st.integers(0, 3))
                   else None for j, s in enumerate(prog.input_shapes))
  out_specs = (tuple(P(*draw(specs(s, sizes))) for s in out_shapes)
               if with_out_specs else None)
  seed = draw(st.integers(0, 2 ** 31 - 1))
  rng = np.random.default_rng(seed)
  xs = prog.make_inputs(rng)
  return mesh(mesh_shape, names), prog, xs, in_specs, out_specs


def _tol(ref) -> dict:
  """f32 tolerance: reductions over split dims add in another order."""
  scale = max([1.0] + [float(np.max(np.abs(np.asarray(r)))) for r in jax.tree.leaves(ref)
                       if np.size(r)])
  return dict(rtol=2e-5, atol=2e-5 * scale)


COLLECTIVES = frozenset({"psum", "pmax", "pmin", "all_gather", "all_to_all",
                         "reduce_scatter", "ppermute"})


def _collective_eqns(jaxpr):
  """Every collective equation of ``jaxpr``, inner jaxprs included."""
  for e in jaxpr.eqns:
    if e.primitive.name in COLLECTIVES:
      yield e
    for p in e.params.values():
      inner = getattr(p, "jaxpr", p)
      if hasattr(inner, "eqns"):
        yield from _collective_eqns(inner)


# -- properties -----------------------------------------------------------------

@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases(with_out_specs=True))
def test_random_program_matches_unpartitioned_per_device(case):
  """Forward: global result equal, and every device holds its numpy block."""
  m, prog, xs, in_specs, out_specs = case
  ref = prog(*xs)
  step = gshard.partition(prog, m, in_specs=in_specs, out_specs=out_specs)
  out = step(*xs)
  tol = _tol(ref)
  assert len(out) == len(ref)
  for k, (o, r, spec) in enumerate(zip(out, ref, out_specs)):
    assert o.shape == r.shape and o.dtype == r.dtype, (k, o.shape, r.shape)
    assert_named_sharding(o, m, spec, f"output {k}")
    np.testing.assert_allclose(np.asarray(o), np.asarray(r), err_msg=f"output {k}", **tol)
    check_shards_against_reference(o, r, spec, m, what=f"output {k}", **tol)


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_random_program_value_and_grad_matches_unpartitioned(case):
  """``value_and_grad`` of a weighted sum of the outputs, w.r.t. every input."""
  m, prog, xs, in_specs, _ = case

  def loss(*args):
    total = 0.0
    for k, o in enumerate(prog(*args)):
      w = np.cos(np.arange(o.size, dtype=np.float32) + k).reshape(o.shape)
      total = total + jnp.sum(o * w)
    return total

  fn = jax.value_and_grad(loss, argnums=prog.float_inputs)
  ref = fn(*xs)
  step = gshard.partition(fn, m, in_specs=in_specs)
  out = step(*xs)
  low = step.lower(*xs)
  for k, (o, s) in enumerate(zip(jax.tree.leaves(out), low.out_shardings)):
    assert_named_sharding(o, m, s.to_spec(), f"output {k}")
  tol = _tol(ref)
  np.testing.assert_allclose(np.asarray(out[0]), np.asarray(ref[0]), err_msg="value",
                             **tol)
  for j, (g, r) in enumerate(zip(out[1], ref[1])):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), err_msg=f"grad {j}",
                               **tol)
  # the per-device program (so its HLO metadata) names, for each collective, the
  # user line that explain() names, under the equation's jvp/transpose name stack
  emitted = {source_of(e) for e in _collective_eqns(low.per_device_jaxpr())
             if str(e.source_info.name_stack)}
  declared = {c.source for c in low.collectives() if c.source != "program output"}
  assert emitted == declared, (emitted, declared)


def test_generator_covers_every_kind():
  """The strategy reaches every op kind and every mesh (a blind generator would
  make the properties above vacuous)."""
  seen_kinds, seen_meshes = set(), set()

  @settings(max_examples=300, derandomize=True, database=None,
            suppress_health_check=list(HealthCheck))
  @given(st.sampled_from(MESHES).flatmap(
      lambda mk: st.tuples(st.just(mk), programs(dict(zip(mk[1], mk[0]))))))
  def collect(arg):
    (mk, (prog, _)) = arg
    seen_meshes.add(mk)
    seen_kinds.update(op[0] for op in prog.ops)

  collect()
  assert seen_meshes == set(MESHES)
  assert seen_kinds >= {"input", "unary", "binary", "affine", "matmul", "bmm", "gram",
                        "reshape", "transpose", "broadcast", "reduce", "softmax",
                        "logsumexp", "cumsum", "argmax", "slice", "pad", "concat",
                        "flip", "take", "shard", "split"}


def test_reference_helpers_catch_a_wrong_layout():
  """The per-device check fails on an output laid out another way than claimed."""
  m = mesh((2, 4), ("x", "y"))
  ref = np.arange(64, dtype=np.float32).reshape(8, 8)
  x = jax.device_put(ref, jax.sharding.NamedSharding(m, P("x", "y")))
  check_shards_against_reference(x, ref, P("x", "y"), m)
  with pytest.raises(AssertionError):
    check_shards_against_reference(x, ref, P("y", "x"), m)
  with pytest.raises(AssertionError):
    check_shards_against_reference(x, ref + 1, P("x", "y"), m)

