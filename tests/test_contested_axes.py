"""Two factors of one contraction want the same mesh axes: the cheaper wins.

``einsum('bsm,ebm->bse', x, w)`` with x split on b and w split on e over the
same mesh axes (one axis, or a tuple of two or three): the dot either moves w
from e to b (one all-to-all of w's block) or gathers x whole. Propagation must
pick whichever sends fewer bytes, whatever the mesh, the order of the tuple
and the sizes; the partitioned program must equal jax's.
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


@settings(max_examples=20, deadline=None)
@given(shape=st.sampled_from([(8,), (4,), (2, 4), (4, 2), (2, 2), (2, 2, 2)]),
       reverse=st.booleans(), b_per=st.sampled_from([1, 2, 4]),
       e_per=st.sampled_from([1, 2, 4]), s=st.sampled_from([1, 4, 16]),
       m=st.sampled_from([3, 5]))   # never E: the output is no state of x
def test_the_cheaper_of_moving_w_or_gathering_x(shape, reverse, b_per, e_per, s, m):
  names = ("a", "b", "c")[:len(shape)]
  axes = names[::-1] if reverse else names
  n = int(np.prod(shape))
  B, E = n * b_per, n * e_per
  kx, kw = jax.random.split(jax.random.PRNGKey(b_per * 7 + e_per))
  x = jax.random.normal(kx, (B, s, m))
  w = jax.random.normal(kw, (E, B, m))

  def f(x, w):
    return jnp.einsum("bsm,ebm->bse", x, w)

  part = gshard.partition(f, mesh(shape, names), in_specs=(P(axes), P(axes)))
  lowered = part.lower(x, w)
  move_w = (n - 1) * w.size * 4 // (n * n)     # all-to-all of w's block
  gather_x = (n - 1) * x.size * 4 // n        # all-gather of x
  assert lowered.total_bytes() == min(move_w, gather_x), lowered.explain()
  # the same m products summed on each side, in any order: each side is off
  # the exact sum by at most m ulps of the sum of their magnitudes
  got, want = np.asarray(gshard.unpad(part(x, w))), np.asarray(jax.jit(f)(x, w))
  bound = 2 * m * np.finfo(np.float32).eps * np.asarray(f(jnp.abs(x), jnp.abs(w)))
  assert (np.abs(got - want) <= bound).all()


@pytest.mark.parametrize("shape,b", [((2, 2, 2), 4), ((2, 2, 2), 6), ((2, 2, 2), 12),
                                     ((4, 2), 4)])
def test_a_batch_the_tuple_splits_unevenly_moves_one_operand_once(shape, b):
  # B not a multiple of the devices: taking the whole tuple for the batch was
  # priced as a free split of the result, but an unpinned dim gets no more
  # shards than elements and an uneven output leaves the program even, so the
  # dot moved w and then gathered its own result (896 B -> 2240 B for B=4).
  names = ("a", "b", "c")[:len(shape)]
  x = jax.random.normal(jax.random.PRNGKey(0), (b, 4, 8))
  w = jax.random.normal(jax.random.PRNGKey(1), (16, b, 8))

  def f(x, w):
    return jnp.einsum("bsm,ebm->bse", x, w)

  part = gshard.partition(f, mesh(shape, names), in_specs=(P(names), P(names)))
  lowered = part.lower(x, w)
  assert len(lowered.collectives()) == 1, lowered.explain()
  got, want = np.asarray(gshard.unpad(part(x, w))), np.asarray(jax.jit(f)(x, w))
  bound = 2 * 8 * np.finfo(np.float32).eps * np.asarray(f(jnp.abs(x), jnp.abs(w)))
  assert (np.abs(got - want) <= bound).all()


def test_a_contracted_factor_does_not_take_the_tuple_whole():
  # x [a@a, b@b, c], w [(b, c)@(a, b), d]: the contracted b wants (a, b) whole
  # from w, and a wants a. Taken whole, the result [a, d] is left unsplit and
  # its partial sum becomes a full psum (2304 B), priced as a reduce-scatter
  # into the split it lost; one axis at a time sends 1792 B.
  x = jax.random.normal(jax.random.PRNGKey(0), (16, 4, 8))
  w = jax.random.normal(jax.random.PRNGKey(1), (4, 8, 16))

  def f(x, w):
    return jnp.einsum("abc,bcd->ad", x, w)

  part = gshard.partition(f, mesh((2, 2), ("a", "b")), in_specs=(P("a", "b"), P(("a", "b"))))
  assert part.lower(x, w).total_bytes() <= 1792
  got, want = np.asarray(part(x, w)), np.asarray(jax.jit(f)(x, w))
  bound = 2 * 32 * np.finfo(np.float32).eps * np.asarray(f(jnp.abs(x), jnp.abs(w)))
  assert (np.abs(got - want) <= bound).all()


@settings(max_examples=20, deadline=None)
@given(shape=st.sampled_from([(2, 2), (2, 4), (4, 2), (2, 2, 2)]), k=st.integers(1, 2),
       per=st.sampled_from([1, 2]), n2_per=st.sampled_from([1, 3]),
       m=st.sampled_from([1, 3]))
def test_a_reshape_merging_two_split_dims_moves_the_minor_axes_in_one_all_to_all(
    shape, k, per, n2_per, m):
  # x [n1@A, n2@B, m] pinned, reshaped to [n1*n2@(A+B), m] pinned: a merged
  # dim split A then B is not one block per device, so the pin on x cannot
  # be carried through. The op used to keep A on n1 (the pin's support) and
  # gather B; moving B onto n1 first, one all-to-all within B, sends 1/|B| of
  # that (GSPMD's plan).
  names = ("a", "b", "c")[:len(shape)]
  k = min(k, len(shape) - 1)
  A, B = names[:k], names[k:]
  n = int(np.prod(shape))
  nb = int(np.prod(shape[k:]))
  n1, n2 = n * per, nb * n2_per
  x = jax.random.normal(jax.random.PRNGKey(n1 + n2), (n1, n2, m))

  def f(x):
    return x.reshape(n1 * n2, m) * 2

  part = gshard.partition(f, mesh(shape, names), in_specs=(P(A, B),), out_specs=P(names))
  lowered = part.lower(x)
  block = x.size * 4 // n
  assert lowered.total_bytes() == (nb - 1) * block // nb, lowered.explain()
  (c,) = [c for c in lowered.collectives()]
  assert c.kind == "all_to_all"
  conflict = [c for c in lowered.propagation.conflicts if c.primitive == "reshape"]
  assert conflict and conflict[0].chosen == names, lowered.explain()
  assert conflict[0].reason == "fewer bytes for the whole op"
  np.testing.assert_array_equal(np.asarray(gshard.unpad(part(x))), np.asarray(f(x)))


def test_only_a_pin_outweighed_by_the_whole_op_is_reported_so():
  # x + y, x [6, 4@(a,b)], y [6@b, 4@a]: the axes go one owner each as always;
  # the report gave that "fewer bytes for the whole op" too (a second reader).
  x = jnp.ones((6, 4))
  low = gshard.partition(lambda x, y: x + y, mesh((2, 4), ("a", "b")),
                         in_specs=(P(None, ("a", "b")), P("b", "a"))).lower(x, x)
  assert low.propagation.conflicts
  assert all(c.reason != "fewer bytes for the whole op" for c in low.propagation.conflicts)


@settings(max_examples=15, deadline=None)
@given(shape=st.sampled_from([(2, 4), (4, 2), (2, 2)]), b=st.sampled_from([8, 16, 32]),
       d=st.sampled_from([32, 64]), f=st.sampled_from([32, 128, 256]))
def test_a_contracted_factor_that_loses_its_major_axis_takes_the_other_proposal(shape, b, d,
                                                                                f):
  # x [B, D@(b,a)] @ w [D@a, F@b]: F holds b, so D keeps neither axis of b*a
  # and the dot gathered x whole and w over a. D@a (w's proposal) moves x by
  # a permute and a gather over b and all-reduces the result over a, which
  # sends less where the result is small (GSPMD's choice here).
  na, nb = shape
  x = jax.random.normal(jax.random.PRNGKey(0), (b, d))
  w = jax.random.normal(jax.random.PRNGKey(1), (d, f))
  part = gshard.partition(lambda x, w: x @ w, mesh(shape, ("a", "b")),
                          in_specs=(P(None, ("b", "a")), P("a", "b")))
  low = part.lower(x, w)
  x_block, w_block = x.size * 4 // (na * nb), w.size * 4 // (na * nb)
  gather = (na * nb - 1) * x_block + (na - 1) * w_block
  other = x_block + (nb - 1) * x_block + 2 * (na - 1) * (b * f // nb * 4) // na
  assert low.total_bytes() <= min(gather, other), low.explain()
  # d products summed on each side in any order: each side is off the exact
  # sum by at most d ulps of the sum of their magnitudes
  got, want = np.asarray(gshard.unpad(part(x, w))), np.asarray(jax.jit(jnp.matmul)(x, w))
  bound = 2 * d * np.finfo(np.float32).eps * np.asarray(jnp.abs(x) @ jnp.abs(w))
  assert (np.abs(got - want) <= bound).all()


def test_the_other_proposal_is_reported_as_fewer_bytes_for_the_whole_op():
  x, w = jnp.ones((32, 64)), jnp.ones((64, 128))
  low = gshard.partition(lambda x, w: x @ w, mesh((2, 4), ("a", "b")),
                         in_specs=(P(None, ("b", "a")), P("a", "b"))).lower(x, w)
  [c] = [c for c in low.propagation.conflicts if c.primitive == "dot_general"]
  assert (c.chosen, c.reason) == (("a",), "fewer bytes for the whole op"), low.explain()
  assert low.total_bytes() == 1024 + 3072 + 4096      # permute, gather over b, psum over a
