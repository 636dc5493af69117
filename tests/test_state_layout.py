"""A state output (the next value of an input: a gradient of the same shape,
an updated parameter) leaves the program in its input's layout. Where
propagation leaves its layout open (a tie no constraint decides: the weight
gradient of a contraction whose two free dims want one mesh axis), it is
computed in that layout, so leaving ``out_specs`` to gshard sends no more than
giving that very layout as ``out_specs``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gshard
from helpers_partition import mesh


@settings(max_examples=12, deadline=None)
@given(shape=st.sampled_from([(8,), (2, 4), (2, 2, 2)]), rev=st.booleans(),
       eq=st.sampled_from(["bsm,ebm->bse", "bm,em->be"]))
def test_a_gradient_left_to_propagation_sends_no_more_than_its_inputs_layout_pinned(
    shape, rev, eq):
  names = ("a", "b", "c")[:len(shape)]
  n = int(np.prod(shape))
  ins = eq.split("->")[0].split(",")
  size = {"b": n, "s": 4, "m": 3, "e": n}
  x = jax.random.normal(jax.random.PRNGKey(0), tuple(size[c] for c in ins[0]))
  w = jax.random.normal(jax.random.PRNGKey(1), tuple(size[c] for c in ins[1]))

  def loss(x, w):
    return jnp.sum(jnp.sin(jnp.einsum(eq, x, w)))
  f = jax.grad(loss, argnums=(0, 1))
  specs = (P(names), P(names[::-1] if rev else names))
  m = mesh(shape, names)
  free = gshard.partition(f, m, in_specs=specs)
  pinned = gshard.partition(f, m, in_specs=specs, out_specs=specs)
  lo_free, lo_pinned = free.lower(x, w), pinned.lower(x, w)
  assert lo_free.total_bytes() <= lo_pinned.total_bytes(), lo_free.explain()
  got, want = free(x, w), jax.jit(f)(x, w)
  # Both sides sum the same terms in another order. y = einsum(x, w) sums m
  # products: off by <= 2 m eps Y, Y = einsum(|x|, |w|); a gradient sums K <=
  # max(sizes) terms cos(y) * (the other operand): off by <= (2 K eps + that
  # of y, as |cos'| <= 1) times the sum of the other operand's magnitudes,
  # the gradient of sum(einsum) with it taken in |.|.
  eps, K = np.finfo(np.float32).eps, max(size.values())
  y_err = 2 * size["m"] * eps * float(jnp.max(jnp.einsum(eq, jnp.abs(x), jnp.abs(w))))
  lin = jax.grad(lambda a, b: jnp.sum(jnp.einsum(eq, a, b)), argnums=(0, 1))
  mags = (lin(x, jnp.abs(w))[0], lin(jnp.abs(x), w)[1])
  for g, r, mag, s in zip(got, want, mags, specs):
    # returned in the input's layout
    assert g.sharding.is_equivalent_to(NamedSharding(m, s), g.ndim), (g.sharding, s)
    bound = (2 * K * eps + y_err) * np.asarray(mag)
    assert (np.abs(np.asarray(g) - np.asarray(r)) <= bound).all()
