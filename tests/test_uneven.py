"""Uneven shapes: dims whose size is not a multiple of their mesh axes.

A dim of n split k ways is held as blocks of ceil(n/k); the tail of the last
block is padding that must never reach a result. Checked here against
``jax.jit`` on one device:

* a language model's vocabulary of 50 (and GPT-2's 50257) over ``model=4``:
  embedding lookup, tied logits, ``log_softmax``, ``take_along_axis``
  cross-entropy, ``argmax``, and the gradients;
* uneven ``in_specs`` and ``out_specs`` (jax itself only places even
  shardings), outputs with their logical shapes;
* max / min / sum / mean / argmin / argmax over an uneven split dim, with
  data chosen so that a padding 0 would win, and a dot contracting one;
* hypothesis: random shapes (dims 1..13, mostly uneven), random specs on
  (2, 4), (4,) and (8,) meshes, random chains of elementwise ops, reductions
  and dots, forward and ``value_and_grad``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gshard
from gshard.spmd.partition.padded import pad_to
from helpers_numerics import check_steps
from helpers_partition import assert_named_sharding, assert_trees_close, mesh

pytestmark = pytest.mark.filterwarnings("error::gshard.PartitionWarning")

M24 = ((2, 4), ("data", "model"))


def rand(*shape, seed=0, scale=1.0):
  return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def kinds(low) -> set[str]:
  return {c.kind for c in low.collectives()}


def even_part(spec, shape, sizes) -> P:
  """The spec jax can place: trailing axes that split a dim unevenly dropped."""
  out = []
  for n, e in zip(shape, list(spec) + [None] * (len(shape) - len(spec))):
    axes = [] if e is None else [e] if isinstance(e, str) else list(e)
    while axes and n % math.prod(sizes[a] for a in axes):
      axes.pop()
    out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  return P(*out)


# -- a vocabulary that does not divide the model axis -----------------------------

def lm(table, tokens, targets):
  """Embedding lookup, tied logits, log_softmax, gold log-prob, argmax."""
  tokens = gshard.split(tokens, 0, "data")
  x = jnp.tanh(table[tokens])
  logits = x @ table.T
  logp = jax.nn.log_softmax(logits, axis=-1)
  gold = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return -gold.mean(), jnp.argmax(logits, axis=-1), logp


def lm_loss(table, tokens, targets):
  return lm(table, tokens, targets)[0]


def lm_batch(vocab, d_model, seed=0):
  rng = np.random.default_rng(seed)
  table = rng.standard_normal((vocab, d_model)).astype(np.float32)
  tokens = rng.integers(0, vocab, (8, 6)).astype(np.int32)
  targets = rng.integers(0, vocab, (8, 6)).astype(np.int32)
  block = -(-vocab // 4)
  edges = [0, block - 1, block, 3 * block - 1, 3 * block, vocab - 1]
  tokens[0] = edges                 # first / last row of each block, the last row
  targets[1] = edges
  targets[2] = edges[::-1]
  return table, tokens, targets


# d_model 18: the model axis does not divide it, so the table cannot move to
# its feature split and the lookup is the vocab-split masked one
@pytest.mark.parametrize("vocab,d_model", [(50, 18), (50257, 8)])
def test_uneven_vocabulary_lm_forward(vocab, d_model):
  m = mesh(*M24)
  args = lm_batch(vocab, d_model)
  step = gshard.partition(lm, m, in_specs=(P("model"), P("data"), P("data")),
                          out_specs=(P(), P("data"), P("data", None, "model")))
  out = step(*args)
  ref = jax.jit(lm)(*args)
  assert_trees_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(ref[1]))
  assert out[2].shape == (8, 6, vocab)                  # the logical shape
  assert_trees_close(out[2], ref[2], rtol=1e-5, atol=1e-4)
  assert_named_sharding(out[2], m, P("data"), "logp")   # vocab: only the even part
  low = step.lower(*args)
  assert low.in_shardings[0].to_spec() == P("model", None)
  # the table is never gathered; the logits only where they leave the program,
  # for the even layout jax arrays hold (their vocabulary does not divide model)
  assert {(c.kind, c.role) for c in low.collectives() if c.kind == "all_gather"} <= \
      {("all_gather", "output 2")}, low.explain()
  local_vocab = -(-vocab // 4)
  jaxpr = low.per_device_jaxpr()
  assert jaxpr.invars[0].aval.shape == (local_vocab, d_model)


# d_model 18: the model axis does not divide it, so the table cannot move to
# its feature split and the lookup is the vocab-split masked one
@pytest.mark.parametrize("vocab,d_model", [(50, 18), (50257, 8)])
def test_uneven_vocabulary_lm_value_and_grad(vocab, d_model):
  m = mesh(*M24)
  args = lm_batch(vocab, d_model, seed=1)
  fn = jax.value_and_grad(lm_loss)
  step = gshard.partition(fn, m, in_specs=(P("model"), P("data"), P("data")),
                          out_specs=(P(), P("model")))
  out = step(*args)
  ref = jax.jit(fn)(*args)
  assert out[1].shape == (vocab, d_model)
  assert_trees_close(out, ref, rtol=1e-5, atol=1e-5)
  low = step.lower(*args)
  assert "all_gather" not in kinds(low), low.explain()
  # the gradient leaves the program in its vocab-split (padded) layout
  assert low.out_shardings[1].to_spec() == P("model", None)


def test_uneven_vocabulary_sgd_steps():
  """Several SGD steps on the table: the padding rows stay out of the result."""
  m = mesh(*M24)
  table, tokens, targets = lm_batch(50, 16, seed=2)

  def sgd(table, tokens, targets):
    loss, g = jax.value_and_grad(lm_loss)(table, tokens, targets)
    return table - 0.5 * g, loss

  step = gshard.partition(sgd, m, in_specs=(P("model"), P("data"), P("data")),
                          out_specs=(P("model"), P()))
  # against a float64 run, within the bound the 1-device f32 run's error gives
  # (helpers_numerics); the longest sum is the softmax's over the 50 words
  got, _ = check_steps(step, jax.jit(sgd), jax.jit(sgd), (table,), (tokens, targets),
                       n=table.shape[0])
  assert got.shape == (50, 16)


# -- uneven in_specs and out_specs -------------------------------------------------

@pytest.mark.parametrize("shape,spec,out_spec", [
    ((6, 30), P(None, "model"), P(None, "model")),
    ((6, 30), P(None, "model"), P()),
    ((7, 30), P("data", "model"), P("model", "data")),
    ((6, 30), P(), P(None, ("data", "model"))),
    ((5, 3), P("data", "model"), P(("model", "data"))),
    ((1, 1), P("data", "model"), P("model", "data")),
])
def test_uneven_in_and_out_specs(shape, spec, out_spec):
  m = mesh(*M24)
  sizes = {"data": 2, "model": 4}
  x = rand(*shape)
  fn = lambda a: jnp.sin(a) * 2.0 + 1.0   # noqa: E731
  step = gshard.partition(fn, m, in_specs=(spec,), out_specs=out_spec)
  out = step(x)
  assert out.shape == shape and out.dtype == np.float32
  np.testing.assert_allclose(np.asarray(out), np.sin(x) * 2 + 1, rtol=1e-6, atol=1e-6)
  # the output is the next value of ``a`` (same shape and dtype): state split
  # unevenly stays split, padded (gshard.PaddedArray); an even one is a jax.Array
  if even_part(out_spec, shape, sizes) == P(*(list(out_spec) + [None] * (2 - len(out_spec)))):
    assert_named_sharding(out, m, out_spec, "output")
  else:
    assert isinstance(out, gshard.PaddedArray), type(out)
    assert_named_sharding(out.data, m, out_spec, "output data")
  low = step.lower(x)
  # inside the program the value is split as asked: ceil(n / k) per device
  assert low.in_shardings[0].to_spec() == P(*(list(spec) + [None] * (2 - len(spec))))
  local = low.per_device_jaxpr().invars[0].aval.shape
  for n, e, got in zip(shape, list(spec) + [None, None], local):
    k = 1 if e is None else math.prod(sizes[a] for a in ((e,) if isinstance(e, str) else e))
    assert got == -(-n // k), (shape, spec, local)


def test_uneven_output_of_a_reduction_keeps_its_split():
  """max over dim 0 of f32[6, 30] split (_, model): the result f32[30] stays
  split over model inside (pmax-free: the reduced dim is not split), and is
  gathered once where it leaves the program: jax arrays hold only even
  layouts, and 30 does not divide over model=4."""
  m = mesh(*M24)
  x = -np.abs(rand(6, 30)) - 1.0
  step = gshard.partition(lambda a: jnp.max(a, 0), m, in_specs=(P(None, "model"),),
                          out_specs=P("model"))
  out = step(x)
  assert out.shape == (30,)
  np.testing.assert_array_equal(np.asarray(out), x.max(0))
  assert [(c.kind, c.axes, c.role) for c in step.lower(x).collectives()] == [
      ("all_gather", ("model",), "output 0")]


# -- reductions and contractions over an uneven split dim ----------------------------

REDUCTIONS = [
    ("max", lambda a: jnp.max(a, 1), "neg"),
    ("min", lambda a: jnp.min(a, 1), "pos"),
    ("sum", lambda a: jnp.sum(a, 1), "any"),
    ("mean", lambda a: jnp.mean(a, 1), "any"),
    ("argmax", lambda a: jnp.argmax(a, 1), "neg"),
    ("argmin", lambda a: jnp.argmin(a, 1), "pos"),
    ("argmax all padding-like", lambda a: jnp.argmax(a, 1), "zeros-neg"),
    # no cross-device product collective: reduce_prod gathers its dim (still exact)
    ("prod (gathered)", lambda a: jnp.prod(a, 1), "pos"),
    ("max of all", jnp.max, "neg"),
    ("min of all", jnp.min, "pos"),
    ("logsumexp", lambda a: jax.nn.logsumexp(a, axis=1), "neg"),
    ("any", lambda a: jnp.any(a > 5.0, 1), "pos"),
    ("all", lambda a: jnp.all(a < 0.0, 1), "neg"),
]


def _reduction_input(kind):
  x = rand(6, 30, seed=3)
  if kind == "neg":          # every entry < 0: a padding 0 would be the max
    return -np.abs(x) - 0.5
  if kind == "pos":          # every entry > 0: a padding 0 would be the min
    return np.abs(x) + 0.5
  if kind == "zeros-neg":    # ties at the max, some in the last (padded) block
    y = -np.abs(x) - 0.5
    y[:, [2, 27, 29]] = -0.25
    return y
  return x


@pytest.mark.parametrize("name,fn,kind", REDUCTIONS, ids=[r[0] for r in REDUCTIONS])
@pytest.mark.parametrize("spec", [P(None, "model"), P("data", "model"),
                                  P(None, ("data", "model"))],
                         ids=["30 over 4", "30 over 4, rows over 2", "30 over 8"])
def test_reduction_over_an_uneven_split_dim(name, fn, kind, spec):
  m = mesh(*M24)
  x = _reduction_input(kind)
  step = gshard.partition(fn, m, in_specs=(spec,))
  out = step(x)
  want = jax.jit(fn)(x)
  assert out.shape == want.shape and out.dtype == want.dtype
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
  low = step.lower(x)
  if "gathered" not in name:
    assert "all_gather" not in kinds(low), low.explain()     # reduced where it lies


def test_dot_contracting_an_uneven_split_dim():
  """f32[6,30] @ f32[30,13], both split on the 30 over model: local dots on
  8-row blocks (padding zero on both sides), one psum; grads too."""
  m = mesh(*M24)
  a, b = rand(6, 30), rand(30, 13, seed=1)
  fn = lambda a, b: a @ b   # noqa: E731
  step = gshard.partition(fn, m, in_specs=(P(None, "model"), P("model")))
  np.testing.assert_allclose(np.asarray(step(a, b)), a @ b, rtol=1e-5, atol=1e-5)
  low = step.lower(a, b)
  assert [(c.kind, c.axes) for c in low.collectives()] == [("psum", ("model",))]
  grad = jax.value_and_grad(lambda a, b: jnp.sum(jnp.tanh(a @ b)), argnums=(0, 1))
  gstep = gshard.partition(grad, m, in_specs=(P(None, "model"), P("model")),
                           out_specs=(P(), (P(None, "model"), P("model"))))
  out = gstep(a, b)
  assert [g.shape for g in out[1]] == [(6, 30), (30, 13)]
  assert_trees_close(out, jax.jit(grad)(a, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec_x,spec_y", [(P(None, None, "b"), P(None, "a", "b")),
                                           (P(None, "a"), P(None, "a", "b")),
                                           (P(None, None, "b"), P(None, ("a", "b")))])
@pytest.mark.parametrize("axis", [0, 2])
def test_concatenate_with_an_input_padded_at_the_boundary(spec_x, spec_y, axis):
  """x [8,5,2] and y [2,5,2] (or [8,5,1] on axis 2) with the 5 split
  unevenly: a plain uneven input is padded inside the program before it moves
  into its padded layout, and XLA (jaxlib 0.10.2) fused that pad into the
  move and got it wrong (the concatenate read garbage rows; found by the
  fuzzer). Bit-exact."""
  m = mesh((2, 2), ("a", "b"))
  x = np.arange(8 * 5 * 2, dtype=np.float32).reshape(8, 5, 2)
  y = -np.arange(40, dtype=np.float32)[:20 if axis == 0 else 40].reshape(
      (2, 5, 2) if axis == 0 else (8, 5, 1)) - 1
  if axis == 2:
    spec_y = P(*spec_y[:2])
  fn = lambda x, y: jnp.concatenate([x, y], axis=axis)   # noqa: E731
  got = gshard.unpad(gshard.partition(fn, m, in_specs=(spec_x, spec_y))(x, y))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(fn)(x, y)))


def test_padding_never_leaks_into_a_nonlinear_chain():
  """exp of the padding is 1, not 0: a sum after exp must still mask it."""
  m = mesh(*M24)
  x = rand(6, 30)
  fn = lambda a: (jnp.sum(jnp.exp(a), 1), jnp.max(jnp.cos(a) - 2.0, 1),   # noqa: E731
                  jnp.exp(a) @ jnp.ones((30,), jnp.float32))
  step = gshard.partition(fn, m, in_specs=(P(None, "model"),))
  assert_trees_close(step(x), jax.jit(fn)(x), rtol=1e-5, atol=1e-5)


# -- hypothesis: random uneven programs ---------------------------------------------

MESHES = [((2, 4), ("a", "b")), ((4,), ("a",)), ((8,), ("a",))]
UNARY = {"sin": jnp.sin, "tanh": jnp.tanh, "exp": lambda x: jnp.exp(0.5 * x),
         "relu": jax.nn.relu, "affine": lambda x: 1.5 * x - 0.25}
BINARY = {"add": jnp.add, "mul": jnp.multiply, "max": jnp.maximum, "sub": jnp.subtract}
REDUCE = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min, "mean": jnp.mean,
          "argmax": lambda x, axis: jnp.argmax(x, axis).astype(jnp.float32),
          "argmin": lambda x, axis: jnp.argmin(x, axis).astype(jnp.float32),
          "logsumexp": jax.nn.logsumexp}


@dataclasses.dataclass(frozen=True)
class Chain:
  """x0 -> op -> op -> ...; ops read the running value and maybe a new input."""

  inputs: tuple[tuple[int, ...], ...]
  ops: tuple[tuple, ...]

  def __call__(self, *xs):
    y = xs[0]
    for op in self.ops:
      kind, *a = op
      if kind == "unary":
        y = UNARY[a[0]](y)
      elif kind == "binary":
        y = BINARY[a[0]](y, xs[a[1]])
      elif kind == "reduce":
        y = REDUCE[a[0]](y, axis=a[1])
      elif kind == "dot":                    # [..., k] @ [k, n]
        y = y @ xs[a[0]]
      elif kind == "softmax":
        y = jax.nn.softmax(y, axis=a[0])
      elif kind == "shard":
        y = gshard.shard(y, P(*a[0]))
    return y


@st.composite
def any_spec(draw, shape, sizes):
  """Each mesh axis at most once; any dim, divisible or not."""
  free = list(draw(st.permutations(list(sizes))))
  out = []
  for _ in shape:
    axes = [a for a in list(free) if draw(st.integers(0, 1))]
    for a in axes:
      free.remove(a)
    out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  return tuple(out)


@st.composite
def chains(draw):
  shape, names = draw(st.sampled_from(MESHES))
  sizes = dict(zip(names, shape))
  dim = st.integers(1, 13)
  cur = tuple(draw(dim) for _ in range(draw(st.integers(1, 3))))
  inputs = [cur]
  ops = []
  for _ in range(draw(st.integers(1, 5))):
    kind = draw(st.sampled_from(["unary", "binary", "reduce", "dot", "softmax", "shard"]))
    if kind == "unary":
      ops.append(("unary", draw(st.sampled_from(sorted(UNARY)))))
    elif kind == "binary":
      inputs.append(cur)
      ops.append(("binary", draw(st.sampled_from(sorted(BINARY))), len(inputs) - 1))
    elif kind == "reduce" and len(cur) >= 1:
      ax = draw(st.integers(0, len(cur) - 1))
      ops.append(("reduce", draw(st.sampled_from(sorted(REDUCE))), ax))
      cur = cur[:ax] + cur[ax + 1:]
    elif kind == "dot" and len(cur) >= 1:
      n = draw(dim)
      inputs.append((cur[-1], n))
      ops.append(("dot", len(inputs) - 1))
      cur = cur[:-1] + (n,)
    elif kind == "softmax" and len(cur) >= 1:
      ops.append(("softmax", draw(st.integers(0, len(cur) - 1))))
    elif kind == "shard":
      ops.append(("shard", draw(any_spec(cur, sizes))))
  chain = Chain(tuple(inputs), tuple(ops))
  in_specs = tuple(P(*draw(any_spec(s, sizes))) if draw(st.integers(0, 3)) else None
                   for s in inputs)
  rng = np.random.default_rng(draw(st.integers(0, 2 ** 31 - 1)))
  xs = [rng.standard_normal(s).astype(np.float32) for s in inputs]
  return mesh(shape, names), chain, xs, in_specs


def _tol(ref):
  scale = max([1.0] + [float(np.max(np.abs(np.asarray(r)))) for r in jax.tree.leaves(ref)
                       if np.size(r)])
  return dict(rtol=5e-5, atol=5e-5 * scale)


def partitioned_and_jit(fn, m, xs, in_specs):
  """``fn`` on ``xs`` through gshard and through ``jax.jit`` (the reference)."""
  return gshard.partition(fn, m, in_specs=in_specs)(*xs), jax.jit(fn)(*xs)


HYP = settings(max_examples=max(1, settings().max_examples // 2),
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@HYP
@given(chains())
def test_random_uneven_chain_forward(case):
  m, chain, xs, in_specs = case
  out, ref = partitioned_and_jit(chain, m, xs, in_specs)
  assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **_tol(ref))


@HYP
@given(chains())
def test_random_uneven_chain_value_and_grad(case):
  m, chain, xs, in_specs = case

  def loss(*args):
    y = chain(*args)
    return jnp.sum(y * np.cos(np.arange(y.size, dtype=np.float32)).reshape(y.shape))

  fn = jax.value_and_grad(loss, argnums=tuple(range(len(xs))))
  out, ref = partitioned_and_jit(fn, m, xs, in_specs)
  for k, (g, r) in enumerate(zip(jax.tree.leaves(out), jax.tree.leaves(ref))):
    assert g.shape == r.shape, (k, g.shape, r.shape)
  tol = _tol(ref)
  for k, (g, r) in enumerate(zip(jax.tree.leaves(out), jax.tree.leaves(ref))):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), err_msg=f"leaf {k}", **tol)


# -- integers: exact, with scalars that scale a split value ----------------------------
#
# XLA (jaxlib 0.10.2) folds a length-1 dynamic slice of a rank-1 int32 array computed
# as ``dynamic_slice(a) * scalar`` into a slice of ``a``, dropping the multiply; gshard
# slices in two steps where a value moves from one axis to two, so ``x * jnp.sum(x)``
# split over ``('a', 'b')`` returned ``x``. Integer results must be equal, bit for bit.

INT_MESHES = MESHES + [((4, 2), ("a", "b")), ((2, 2, 2), ("a", "b", "c"))]
INT_DTYPES = [np.int8, np.uint8, np.int16, np.int32, np.uint32]
INT_BINARY = {"add": jnp.add, "mul": jnp.multiply, "max": jnp.maximum, "sub": jnp.subtract}
INT_REDUCE = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}


@dataclasses.dataclass(frozen=True)
class IntChain:
  """x0 -> op -> ...: elementwise ops, scaling by a reduction of the running value
  (a scalar, or the value reduced over one axis and broadcast back), layouts."""

  ops: tuple[tuple, ...]

  def __call__(self, *xs):
    y = xs[0]
    for kind, *a in self.ops:
      if kind == "scale":                     # y * reduce(y) (promotes small ints)
        y = y * INT_REDUCE[a[0]](y, axis=a[1], keepdims=a[1] is not None)
      elif kind == "binary":
        y = INT_BINARY[a[0]](y, xs[a[1]])
      elif kind == "neg":
        y = -y
      elif kind == "shard":
        y = gshard.shard(y, P(*a[0]))
    return y


@st.composite
def int_chains(draw):
  shape, names = draw(st.sampled_from(INT_MESHES))
  sizes = dict(zip(names, shape))
  dtype = draw(st.sampled_from(INT_DTYPES))
  cur = tuple(draw(st.integers(1, 11)) for _ in range(draw(st.sampled_from([1, 1, 2]))))
  n_inputs, ops = 1, []
  for _ in range(draw(st.integers(1, 4))):
    kind = draw(st.sampled_from(["scale", "scale", "binary", "neg", "shard", "shard"]))
    if kind == "scale":
      axis = draw(st.sampled_from([None] + list(range(len(cur)))))
      ops.append(("scale", draw(st.sampled_from(sorted(INT_REDUCE))), axis))
    elif kind == "binary":
      ops.append(("binary", draw(st.sampled_from(sorted(INT_BINARY))), n_inputs))
      n_inputs += 1
    elif kind == "neg":
      ops.append(("neg",))
    else:
      ops.append(("shard", draw(any_spec(cur, sizes))))
  ops.append(("shard", draw(any_spec(cur, sizes))))
  in_specs = tuple(P(*draw(any_spec(cur, sizes))) if draw(st.integers(0, 2)) else P()
                   for _ in range(n_inputs))
  rng = np.random.default_rng(draw(st.integers(0, 2 ** 31 - 1)))
  xs = [rng.integers(0, 6, cur).astype(dtype) for _ in range(n_inputs)]
  return mesh(shape, names), IntChain(tuple(ops)), xs, in_specs


def test_int8_sum_scaling_a_value_split_over_two_axes():
  """The fuzz case: an int32 sum of int8 data scales a value split over ('a', 'b')."""
  x = np.arange(1, 6, dtype=np.int8)
  f = lambda x: gshard.shard(x * jnp.sum(x), P(("a", "b")))
  out = gshard.partition(f, mesh((4, 2), ("a", "b")), in_specs=(P(),))(x)
  np.testing.assert_array_equal(np.asarray(out), 15 * np.arange(1, 6, dtype=np.int32))
  assert out.dtype == np.int32


@st.composite
def scaled_then_split_further(draw):
  """The shape of that bug: a small int vector scaled by its own (promoted)
  reduction, then laid out over two or three mesh axes."""
  shape, names = draw(st.sampled_from([m for m in INT_MESHES if len(m[0]) > 1]))
  out = tuple(draw(st.permutations(list(names)))[:draw(st.integers(2, len(names)))])
  in_spec = draw(st.sampled_from([P(), P(names[0]), P(names[-1])]))
  n = draw(st.integers(1, 11))
  dtype = draw(st.sampled_from(INT_DTYPES))
  reduce = draw(st.sampled_from(sorted(INT_REDUCE)))
  x = np.random.default_rng(draw(st.integers(0, 99))).integers(1, 6, (n,)).astype(dtype)
  return mesh(shape, names), reduce, in_spec, P(out), x


@HYP
@given(scaled_then_split_further())
def test_a_scaled_vector_split_further_is_exact(case):
  m, reduce, in_spec, out_spec, x = case
  f = lambda x: gshard.shard(x * INT_REDUCE[reduce](x), out_spec)
  out = gshard.partition(f, m, in_specs=(in_spec,))(x)
  ref = jax.jit(f)(x)
  assert out.dtype == ref.dtype
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


@HYP
@given(int_chains())
def test_random_integer_chain_is_exact(case):
  m, chain, xs, in_specs = case
  out, ref = partitioned_and_jit(chain, m, xs, in_specs)
  assert out.shape == ref.shape and out.dtype == ref.dtype, (out.dtype, ref.dtype)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_a_mesh_with_explicit_axes_runs_uneven_outputs():
  """``jax.make_mesh`` gives Explicit axes by default; gshard runs on its devices
  as on Auto ones (jax refused to slice the padding off an uneven output)."""
  explicit = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  x = np.arange(1, 6, dtype=np.int8)          # int32 out: not state, sliced to 5
  f = lambda x: gshard.shard(x * jnp.sum(x), P(("a", "b")))
  out = gshard.partition(f, explicit, in_specs=(P(),))(x)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(f)(x)))
  assert out.shape == (5,)


def test_a_context_mesh_with_explicit_axes():
  """Under ``jax.set_mesh`` of an Explicit mesh (jax's default), the call, the
  lowering and the arrays placed on that mesh all work (shard_map refused
  gshard's Auto mesh under the Explicit context)."""
  explicit = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  x = np.arange(1, 9, dtype=np.float32)
  f = lambda x: gshard.shard(jnp.sin(x) * 2, P(("a", "b")))
  want = np.asarray(jax.jit(f)(x))
  with jax.set_mesh(explicit):
    step = gshard.partition(f, explicit, in_specs=(P("a"),))
    placed = jax.device_put(x, jax.sharding.NamedSharding(explicit, P("a")))
    np.testing.assert_allclose(np.asarray(step(x)), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(step(placed)), want, rtol=1e-6)
    assert "all-gather" not in step.lower(x).compile().as_text()


@HYP
@given(st.data())
def test_an_uneven_output_leaves_the_program_in_its_even_layout(data):
  """An output split unevenly that is not state (no PaddedArray) leaves the
  program laid out evenly: the axes that would split a dim unevenly dropped
  (``even_part``), resharded inside the program, and the values equal one
  device's. XLA's own reshard of a padded output sliced back outside the
  program crashed the process (jaxlib 0.10.2: a [6] output split over
  ('a', 'b') of a 2x2 mesh, next to a cumsum split over 'b': a segfault in a
  dynamic-slice fusion; fuzz seed 20261310, program 638)."""
  shape, names = data.draw(st.sampled_from([((2, 2), ("a", "b")), ((2, 4), ("a", "b")),
                                            ((4, 2), ("a", "b")), ((8,), ("a",))]))
  m = mesh(shape, names)
  sizes = dict(zip(names, shape))
  n = data.draw(st.integers(2, 13), label="length")
  cols = data.draw(st.sampled_from([1, 3, 4]), label="columns")
  axes = data.draw(st.permutations(names), label="axes order")
  k = data.draw(st.integers(1, len(names)), label="axes")
  split = tuple(axes[:k])
  spec = P(split if len(split) > 1 else split[0])
  first = data.draw(st.sampled_from([None, *names]), label="input split")
  x = np.arange(1, n * cols + 1, dtype=np.float32).reshape(n, cols) / 4

  def f(x):
    return jnp.cumsum(x, axis=0), gshard.shard(gshard.shard(x, P(first)) * 2, spec)

  step = gshard.partition(f, m, in_specs=(None,))
  got, want = step(x), jax.jit(f)(x)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  out = step.lower(x).out_shardings[1].to_spec()
  assert out == even_part(spec, (n, cols), sizes), (out, spec)
  assert_named_sharding(got[1], m, even_part(spec, (n, cols), sizes), "output 1")


def test_a_padded_output_beside_a_split_cumsum_runs():
  """Fuzz seed 20261310, program 638: before outputs left the program evenly,
  XLA's reshard of this [6] output sliced from its padded [8] over ('a', 'b')
  segfaulted the process."""
  m = mesh((2, 2), ("a", "b"))
  x = np.array([0.75, -1., -1., -2., 0.25, 1.5], np.float32)

  def f(x0):
    v1 = jnp.cumsum(x0, axis=0)
    return v1, jnp.max(v1, axis=0), gshard.shard(gshard.shard(x0, P("b")), P(("a", "b")))

  got = gshard.partition(f, m, in_specs=(None,))(x)
  for g, w in zip(got, jax.jit(f)(x)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_a_compiled_step_takes_the_plain_uneven_arrays_it_was_lowered_with():
  """``step.lower(t).compile()(t)``: the program keeps an uneven input padded;
  the compiled step pads a plain array on the way in, as the step does
  (found by review: jax's shape error before), and takes the padded state
  the step returns as it is."""
  m = mesh((2, 4), ("data", "model"))
  def f(s, x):   # returns the next state: "t" is kept padded between steps
    return {"t": s["t"] * 2 + x.sum()}, x

  step = gshard.partition(f, m, in_specs=({"t": P("model")}, P("data")))
  t = jnp.arange(60.0).reshape(10, 6)
  x = jnp.ones((8, 3))
  compiled = step.lower({"t": t}, x).compile()
  for args in (({"t": t}, x), (step({"t": t}, x)[0], x)):
    got = compiled(*args)
    want = jax.jit(f)(*gshard.unpad(args))
    for g, w in zip(jax.tree.leaves(gshard.unpad(got)), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.integers(3, 9), cols=st.integers(3, 9), batch=st.integers(1, 3),
       spec=st.sampled_from([P(None, "model"), P("model", None), P("data", "model")]),
       wrap=st.sampled_from(["vmap", "vmap(jit)", "jit(vmap)"]))
def test_a_partitioned_step_with_uneven_state_under_vmap(rows, cols, batch, spec, wrap):
  """An ensemble: vmap of a partitioned SGD step whose weight is split
  unevenly (kept as a PaddedArray between steps). Under vmap the state came
  out held as [B, ...padded] with the logical shape of one member, so its
  values read as the wrong shape; it is now [B, ...logical], and feeds the
  next vmapped step. Two steps equal vmap of the plain step."""
  def step(w, x):
    g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
    return w - 0.1 * g, jnp.sum(g)

  f = gshard.partition(step, mesh(*M24), in_specs=(spec, P("data")))
  vm = {"vmap": lambda g: jax.vmap(g, in_axes=(0, None)),
        "vmap(jit)": lambda g: jax.vmap(jax.jit(g), in_axes=(0, None)),
        "jit(vmap)": lambda g: jax.jit(jax.vmap(g, in_axes=(0, None)))}[wrap]
  ws = np.linspace(-1, 1, batch * rows * cols, dtype=np.float32).reshape(batch, rows, cols)
  x = np.cos(np.arange(4 * rows, dtype=np.float32)).reshape(4, rows)
  got, want = (ws, None), (ws, None)
  for i in range(2):
    got, want = vm(f)(got[0], x), jax.vmap(step, in_axes=(0, None))(want[0], x)
    assert got[0].shape == (batch, rows, cols), (i, got[0])
    # one row of x times a column of w per output: sums of `rows` products
    assert_trees_close(got, want, rtol=1e-5, atol=1e-5 * rows, what=f"step {i}")


def test_vmap_of_uneven_state_elsewhere_than_in_front_is_an_error():
  """The batch dims of a PaddedArray are in front: vmap putting them
  elsewhere (out_axes=1), or mapping over a dim that holds padding (the
  padded rows would be mapped as data; found by a second reader), is an
  error naming the fix."""
  f = gshard.partition(lambda w: w * 2, mesh(*M24), in_specs=P(None, "model"))
  # state that enters vmap as a plain array comes back as one (any out_axes)
  got = jax.vmap(f, out_axes=1)(jnp.ones((4, 3, 10)))
  assert not isinstance(got, gshard.PaddedArray) and got.shape == (3, 4, 10)
  # as a PaddedArray (an ensemble's state, stacked), it comes back as one
  ensemble = jax.tree.map(lambda a: jnp.stack([a] * 4), f(jnp.ones((3, 10))))
  assert ensemble.shape == (4, 3, 10)
  with pytest.raises(ValueError, match=r"batch dim is not in front.*out_axes=0"):
    jax.vmap(f, out_axes=1)(ensemble)
  rows = gshard.partition(lambda w: w * 2, mesh(*M24), in_specs=P("model", None))(
      jnp.ones((5, 7)))                               # f32[5,7] held as f32[8,7]
  for mapped in (lambda: jax.vmap(lambda r: r)(rows),
                 lambda: jax.lax.scan(lambda c, r: (c, None), 0, rows)):
    with pytest.raises(ValueError, match=r"held as \(8, 7\).*lost its dim\(s\) \[0\]"
                       r".*gshard.unpad"):
      mapped()
  # a jax.tree.map to shapes, names or per-leaf scalars (logging, norms) is
  # left as it was (and prints)
  for f in (lambda a: a.shape, lambda a: None, lambda a: str(a.dtype), jnp.linalg.norm):
    mapped = jax.tree.map(f, rows)
    assert mapped.shape == (5, 7) and "[5, 7]" in repr(mapped)


# A state output split unevenly comes back a PaddedArray; a gradient shaped like
# its weight is one. Its operators and array methods act on the logical value,
# as jax.Array's do: ``0.1 * g`` raised TypeError (no __rmul__).
_OPS = {
    "scalar * p": lambda p, a: 0.5 * p, "p * scalar": lambda p, a: p * 0.5,
    "a - scalar * p": lambda p, a: a - 0.1 * p, "p + a": lambda p, a: p + a,
    "a + p": lambda p, a: a + p, "p - p": lambda p, a: p - p, "-p": lambda p, a: -p,
    "abs": lambda p, a: abs(p), "p ** 2": lambda p, a: p ** 2,
    "p / 3": lambda p, a: p / 3, "3 / (p + 10)": lambda p, a: 3 / (p + 10),
    "p // 2": lambda p, a: p // 2, "p % 3": lambda p, a: p % 3,
    "p > a": lambda p, a: p > a, "p <= 0": lambda p, a: p <= 0,
    "p == a": lambda p, a: p == a, "p != p": lambda p, a: p != p,
    "p @ a.T": lambda p, a: p @ a.T, "a.T @ p": lambda p, a: a.T @ p,
    "p.T": lambda p, a: p.T, "p.sum(0)": lambda p, a: p.sum(0),
    "p.mean()": lambda p, a: p.mean(), "p.astype(bf16)": lambda p, a: p.astype(jnp.bfloat16),
    "p.reshape(-1)": lambda p, a: p.reshape(-1), "p.at[0].set(7)": lambda p, a: p.at[0].set(7),
    "p.max(axis=1)": lambda p, a: p.max(axis=1),
}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.sampled_from([5, 6, 7, 9, 10, 11, 13]), cols=st.integers(1, 4),
       dtype=st.sampled_from(["float32", "int32"]), op=st.sampled_from(sorted(_OPS)))
def test_a_padded_array_computes_as_its_logical_value(rows, cols, dtype, op):
  m = mesh(*M24)
  logical = jnp.arange(rows * cols, dtype=dtype).reshape(rows, cols) - 3
  other = jnp.ones((rows, cols), dtype) * 2
  padded = pad_to(logical, (8 * -(-rows // 8), cols), NamedSharding(m, P(("data", "model"))))
  assert isinstance(padded, gshard.PaddedArray)
  fn = _OPS[op]
  want = fn(logical, other)
  for got in (fn(padded, other), jax.jit(fn)(padded, other)):
    assert not isinstance(got, gshard.PaddedArray)
    assert got.dtype == want.dtype and got.shape == want.shape, op
    if not jnp.issubdtype(want.dtype, jnp.floating):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=op)
    else:
      # a multiply-add fused or not (jit), a dot's cols products summed in
      # another order: each rounding at most eps of the terms' magnitude
      big_p, big_a = float(jnp.abs(logical).max()), 2.0
      terms = cols * big_p * big_a + big_p + big_a
      np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                 rtol=0, atol=cols * float(jnp.finfo(want.dtype).eps) * terms,
                                 err_msg=op)
  # its rows, and no more (indexing alone never stops: jax clamps the index)
  rows_seen = [np.asarray(r).tolist() for r in itertools.islice(padded, rows + 1)]
  assert rows_seen == np.asarray(logical).tolist()
  assert padded.block_until_ready() is padded


def test_an_uneven_gradient_returned_padded_takes_an_sgd_update():
  # partition(jax.grad(loss)): the gradient is paired with its weight (same
  # structure, shape and dtype) and comes back padded; the user's update reads it
  w, x = jnp.linspace(-1, 1, 140).reshape(10, 14), jnp.linspace(0, 1, 60).reshape(6, 10)

  def loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)
  g = gshard.partition(jax.grad(loss), mesh(*M24),
                       in_specs=(P(None, "model"), P("data")))(w, x)
  assert isinstance(g, gshard.PaddedArray)
  want = jax.jit(jax.grad(loss))(w, x)
  new = jax.tree.map(lambda p, d: p - 0.1 * d, w, g)
  # one dot of 6 rows, a tanh and a square: a few ulps of the result
  np.testing.assert_allclose(np.asarray(new), np.asarray(w - 0.1 * want), rtol=0,
                             atol=16 * np.finfo(np.float32).eps)
  with pytest.raises(TypeError, match="unhashable"):
    hash(g)
