"""``concatenate`` and ``split`` along a split dim whose result is wanted split.

Where the result is wanted split along the joined dim (an annotation, a
consumer), each operand's split moves to another of its dims (an
all-to-all), the op runs locally and the result moves back, where that sends
less than gathering the dim (GSPMD's way). Before, the dim was always
gathered: a batch assembled from two halves and annotated split sent 4x
GSPMD's bytes. (Propagation does not carry the split across the op: always
carrying it sent more on rolls, shifts and padding by concatenation.)

Both ops only move data, so every value and cotangent is compared bit for bit
with ``jax.jit``'s, over random meshes, shapes (uneven pieces included),
dtypes, in_specs and annotations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import gshard
from helpers_partition import mesh

pytestmark = pytest.mark.filterwarnings("error::gshard.PartitionWarning")

MESHES = [((8,), ("x",)), ((4,), ("x",)), ((2, 4), ("x", "y")), ((4, 2), ("x", "y")),
          ((2, 2), ("x", "y"))]
OTHER = (1, 2, 4, 6, 8)


def _spec(draw, rank: int, names) -> P:
  """A random spec of ``rank`` dims, each mesh axis used at most once."""
  free = list(names)
  entries = []
  for _ in range(rank):
    if free and draw(st.booleans()):
      a = draw(st.sampled_from(free))
      free.remove(a)
      entries.append(a)
    else:
      entries.append(None)
  return P(*entries)


@st.composite
def cases(draw):
  shape, names = draw(st.sampled_from(MESHES))
  rank = draw(st.integers(2, 3))
  d = draw(st.integers(0, rank - 1))
  others = [draw(st.sampled_from(OTHER)) for _ in range(rank)]
  lengths = [draw(st.integers(1, 17)) for _ in range(draw(st.integers(2, 3)))]
  dtype = draw(st.sampled_from([np.float32, np.int32, jnp.bfloat16]))
  specs = tuple(_spec(draw, rank, names) for _ in lengths)
  inner = _spec(draw, rank, names) if draw(st.booleans()) else None
  cut = draw(st.integers(1, sum(lengths) - 1))
  return shape, names, d, others, lengths, dtype, specs, inner, cut


def _inputs(d, others, lengths, dtype):
  out = []
  for k, n in enumerate(lengths):
    shape = list(others)
    shape[d] = n
    x = np.arange(np.prod(shape)).reshape(shape) * (k + 2) % 97 - 40
    out.append(jnp.asarray(x, dtype))
  return out


@settings(deadline=None)
@given(cases())
def test_concatenate_and_split_along_a_split_dim_equal_the_plain_program(case):
  shape, names, d, others, lengths, dtype, specs, inner, cut = case
  m = mesh(shape, names)
  xs = _inputs(d, others, lengths, dtype)

  def f(*pieces):
    y = jnp.concatenate(pieces, axis=d)
    if inner is not None:
      y = gshard.shard(y, inner)
    a, b = jnp.split(y * 3, [cut], axis=d)
    return y - 1, a, b

  want = jax.jit(f)(*xs)
  got = gshard.partition(f, m, in_specs=specs)(*xs)
  for g, w in zip(got, want):
    assert g.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(gshard.unpad(g)), np.asarray(w))
  if dtype == np.int32:
    return
  cts = tuple(jnp.asarray(np.asarray(w) * 0.5 + 1, w.dtype) for w in want)

  def back(*pieces):
    return jax.vjp(f, *pieces)[1](cts)

  for g, w in zip(gshard.partition(back, m, in_specs=specs)(*xs), jax.jit(back)(*xs)):
    assert g.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(gshard.unpad(g)), np.asarray(w))


def _sent(fn, m, specs, *args) -> dict:
  low = gshard.partition(fn, m, in_specs=specs).lower(*args)
  out: dict = {}
  for c in low.collectives():
    out[c.kind] = out.get(c.kind, 0) + c.bytes
  return out


def test_a_batch_assembled_from_two_halves_moves_by_all_to_all():
  """Two data-split halves concatenated along the batch, annotated split,
  then a matmul: the halves move by all-to-all, not a gather: the bytes
  GSPMD sends (14,343 here; the gather sent 57,351). Its gradient's split,
  with the halves' gradients pinned split (out_specs), likewise."""
  m = mesh((8,), ("x",))
  a = jnp.linspace(-1, 1, 64 * 128).reshape(64, 128)
  b = a[::-1] * 2
  w = jnp.eye(128) / 2

  def f(a, b, w):
    x = gshard.split(jnp.concatenate([a, b], axis=0), 0, "x")
    return jnp.sum(jnp.tanh(x @ w))

  specs = (P("x"), P("x"), P())
  sent = _sent(f, m, specs, a, b, w)
  assert "all_gather" not in sent and sent["all_to_all"] == 3584 * 2 + 7168, sent
  grad = jax.grad(f, argnums=(0, 1))
  low = gshard.partition(grad, m, in_specs=specs, out_specs=(P("x"), P("x"))).lower(a, b, w)
  assert "all_gather" not in {c.kind for c in low.collectives()}, low.collectives()
  got = low.compile()(a, b, w)
  for g, want in zip(got, jax.jit(grad)(a, b, w)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-6, atol=1e-7)
    assert g.sharding.spec[0] == "x"     # the gradients come back split as the halves
