"""A ``jax.shard_map`` in user code, whose body holds custom derivatives.

gshard runs a shard_map over its mesh as written (its program is itself per
device), binding each equation of the body again. A ``custom_jvp`` (``jax.nn.relu``)
or ``custom_vjp`` equation keeps its rules as functions only when bound as
jax's own interpreter binds it (``get_bind_params``): they crashed before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import gshard
from helpers_partition import assert_trees_close

pytestmark = pytest.mark.filterwarnings("error::gshard.PartitionWarning")


@jax.custom_vjp
def clip_grad(x):
  return jnp.tanh(x)


clip_grad.defvjp(lambda x: (jnp.tanh(x), x),
                 lambda x, g: (jnp.clip(g * (1 - jnp.tanh(x) ** 2), -0.1, 0.1),))


@jax.custom_jvp
def softplus(x):
  return jnp.logaddexp(x, 0.0)


softplus.defjvp(lambda p, t: (softplus(p[0]), t[0] * jax.nn.sigmoid(p[0])))

BODIES = {
    "relu": jax.nn.relu,
    "custom_vjp": clip_grad,
    "custom_jvp": softplus,
    "relu then psum": lambda a: jax.lax.psum(jax.nn.relu(a), "b"),
}


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.sampled_from(sorted(BODIES)), grad=st.booleans(),
       spec=st.sampled_from([P("a", "b"), P("b", None), P(None, "a"), P(("a", "b"))]))
def test_custom_derivatives_in_a_shard_map_body_equal_one_device(body, grad, spec):
  m = gshard.make_mesh((2, 4), ("a", "b"))
  f = BODIES[body]
  out_spec = spec if body != "relu then psum" else P(*[None if d == "b" else d for d in spec])

  def fn(x):
    y = jax.shard_map(f, mesh=m, in_specs=spec, out_specs=out_spec, check_vma=False)(x)
    return jnp.sum(y * jnp.arange(y.size, dtype=y.dtype).reshape(y.shape))

  fn = jax.grad(fn) if grad else fn
  x = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
  want = jax.jit(fn)(x)
  got = gshard.partition(fn, m, in_specs=(P("a"),))(x)
  assert_trees_close(got, want, rtol=1e-5, atol=1e-5, what=body)
