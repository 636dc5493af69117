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
