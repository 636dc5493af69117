"""State updates made in their state's layout (``spmd/updates.py``).

A weight gradient propagation lays out from its dot's operands, unlike its
weight's, was moved at the update; the chain the update is made of is now
laid out as the weight where the factor solver prices that cheaper. The
property: over random layouts of an MLP train step (plain SGD, gradients
clipped by their global norm, weight decay; weights pinned by ``in_specs``,
``out_specs`` or both), never more bytes than the same program with the
gradient left as propagated, and the values of ``jax.jit``.
"""

from __future__ import annotations

import jax
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import gshard
import helpers_mlp
import helpers_partition
from helpers_partition import assert_within_ulps, mesh

CHOICES = helpers_mlp.CHOICES
_step, _args = helpers_mlp.sgd, helpers_mlp.args
STEPS = {k: helpers_mlp.STEPS[k] for k in ("sgd", "clipped", "decayed")}


def specs_2d():
  return helpers_partition.specs_2d(CHOICES)


def _close(got, want):
  # the same SGD step; sums of at most 128 products reordered across devices:
  # within 128 ulps of the largest magnitude of each weight's update
  assert_within_ulps(got, want, 128)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w1=specs_2d(), w2=specs_2d(), x=specs_2d(), step=st.sampled_from(sorted(STEPS)),
       pin=st.sampled_from(["in", "in and out", "out only"]))
def test_an_update_in_its_weights_layout_never_sends_more(w1, w2, x, step, pin):
  helpers_mlp.check_never_sends_more("lay_out_updates", STEPS[step], w1, w2, x, pin, _close)


def test_a_weight_gradient_is_made_in_its_weights_layout():
  # w1 [64, 128@(b,a)], x [32@b, 64]: dW1 came out [128@a, 64]+b, psum[b]
  # 24 KiB, then moved at the update (16 KiB); the step sent 62 KiB
  p, xs = _args()
  specs = ({"w1": P(None, ("b", "a")), "w2": P("a", None)}, P("b", None))
  part = gshard.partition(_step, mesh((2, 4), ("a", "b")), in_specs=specs, out_specs=specs[0])
  lowered = part.lower(p, xs)
  assert not [c for c in lowered.collectives() if c.primitive in ("sub", "mul", "transpose")], \
      lowered.explain()
  assert lowered.total_bytes() <= 31 * 1024, lowered.explain()
  _close(part(p, xs), jax.jit(_step)(p, xs))
