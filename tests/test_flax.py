"""A Flax NNX train step (examples/flax_nnx.py) partitioned by gshard.

The Transformer LM with AdamW and dropout, annotated in three lines, runs on a
2x4 mesh and equals its 1-device run (``jax.jit``) step after step: the
dropout masks bit for bit, the step counters exactly, the losses and the whole
state (parameters, Adam moments) to f32 rounding, within bounds derived from a
float64 run of each step (``helpers_numerics``: Adam's division by
``sqrt(v) + eps`` makes a fixed tolerance flaky). Nothing takes the safe path.

The MoE variant (``num_experts``: every other feed-forward block a GShard
``MoEBlock``, experts split over ``data`` on a 4x2 mesh) equals its 1-device
run too, with random second-expert routing keyed by the step, and moves
tokens to the experts and back by all-to-all, never gathering the experts.
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

pytest.importorskip("flax")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gshard  # noqa: E402
from examples import flax_nnx, models  # noqa: E402
from gshard.moe import expert_capacity  # noqa: E402
from helpers_numerics import AdamSpec, assert_close_to_f64, f64_run, to_host  # noqa: E402
from helpers_partition import mesh  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::gshard.PartitionWarning")

MODEL = dict(vocab=64, d_model=32, n_heads=4, n_layers=2, d_ff=64, dropout=0.1)
BATCH, SEQ = 8, 16


@pytest.fixture(scope="module")
def setup():
  graphdef, state = flax_nnx.create(seed=0, **MODEL)
  step = flax_nnx.partitioned_step(graphdef, mesh((2, 4), ("data", "model")))
  reference = jax.jit(functools.partial(flax_nnx.train_step, graphdef))
  return graphdef, state, step, reference


def _batch(i):
  return models.synthetic_batch(jax.random.PRNGKey(i), BATCH, SEQ, MODEL["vocab"])


# Where AdamW keeps its moments in ``(state, loss)``, and its hyperparameters:
# ``flax_nnx.create``'s learning rate and optax.adamw's defaults (the bound
# checks this model of the update against the float64 run first).
ADAMW = AdamSpec(params="[0][0]", mu="[0][1]['opt_state'][0]['mu']",
                 nu="[0][1]['opt_state'][0]['nu']",
                 count="[0][1]['opt_state'][0]['count'].value", lr=3e-3, wd=1e-4)


def assert_steps_match_one_device(step, graphdef, state, steps):
  """Run ``steps`` partitioned steps; from each step's input state, run it on
  one device in f32 and in f64 too, and check the partitioned state and loss
  against the f64 run within the bound the 1-device f32 run's error gives
  (``helpers_numerics``: K = sqrt(BATCH * SEQ), the tokens every weight
  gradient sums over; Adam's parameters through its update formula). Each step
  starts all three runs from the partitioned run's state, so the bound is one
  step's rounding, not a trajectory's. Returns the final state and the losses."""
  reference = jax.jit(functools.partial(flax_nnx.train_step, graphdef))
  exact = jax.jit(functools.partial(flax_nnx.train_step, graphdef))   # traced in f64
  got, losses = state, []
  for i in range(steps):
    tokens, targets = _batch(i)
    out = step(got, tokens, targets, i)
    want = reference(to_host(got), tokens, targets, i)
    assert_close_to_f64(out, want, f64_run(exact, got, tokens, targets, i),
                        n=BATCH * SEQ, old=(got,), adam=ADAMW, what=f"step {i}: ")
    got = out[0]
    losses.append(float(out[1]))
  return got, losses


def test_train_steps_equal_one_device(setup):
  graphdef, state, step, _ = setup
  _, losses = assert_steps_match_one_device(step, graphdef, state, steps=4)
  assert losses[-1] < losses[0]


def test_parameter_layout_is_inferred_megatron(setup):
  """No parameter spec is given: the annotations alone split heads and d_ff."""
  _, state, step, _ = setup
  tokens, targets = _batch(0)
  lowered = step.lower(state, tokens, targets, 0)
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path((state, tokens, targets, 0))[0]]
  specs = dict(zip(paths, (s.to_spec() for s in lowered.in_shardings)))

  def spec(path):
    return specs[f"[0]{path}.value"]
  for i in range(MODEL["n_layers"]):
    block = f"['blocks'][{i}]"
    assert spec(f"[0]{block}['attn']['query']['kernel']") == P(None, "model", None)
    assert spec(f"[0]{block}['attn']['out']['kernel']") == P("model", None, None)
    assert spec(f"[0]{block}['mlp']['up']['kernel']") == P(None, "model")
    assert spec(f"[0]{block}['mlp']['down']['kernel']") == P("model", None)
    # Adam's moments follow their parameters.
    assert spec(f"[1]['opt_state'][0]['mu']{block}['mlp']['up']['kernel']") == \
        P(None, "model")
  assert lowered.fallbacks == []


def test_dropout_masks_bit_exact(setup):
  """nnx.Dropout on an activation split over data and model: the same mask."""
  graphdef, state, _, _ = setup
  from flax import nnx

  def dropped(state, seed):
    model, _ = nnx.merge(graphdef, state)
    h = jax.numpy.ones((BATCH, SEQ, MODEL["d_model"]))
    h = gshard.shard(h, P("data", None, "model"))
    return model.blocks[0].mlp.dropout(h, rngs=nnx.Rngs(dropout=jax.random.key(seed)))

  step = gshard.partition(dropped, mesh((2, 4), ("data", "model")), strict=True)
  got, want = step(state, 3), jax.jit(dropped)(state, 3)
  assert np.array_equal(np.asarray(got), np.asarray(want))


def test_coverage_no_safe_path_with_mesh_committed_state(setup):
  """Arguments already on the mesh make jax insert ``reshard`` around
  dropout's sampler (``out_sharding=``): it has a rule too."""
  _, state, step, _ = setup
  tokens, targets = _batch(0)
  state, _ = step(state, tokens, targets, 0)          # now NamedSharding arrays
  cov = gshard.coverage(step.fn, state, tokens, targets, 0, mesh=step.mesh,
                        in_specs=step.in_specs)
  assert cov.safe_path == [], str(cov)
  assert cov.fallbacks == ()
  assert cov["reshard"].partition == "specific"
  assert cov["random_bits"].rule == "random_bits_rule"


# -- the MoE variant: every other feed-forward block a GShard MoEBlock ----------

MOE_MESH = ((4, 2), ("data", "model"))        # data doubles as the expert axis
NUM_EXPERTS = 8


def _spec_by_path(lowered, args):
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(args)[0]]
  return dict(zip(paths, (s.to_spec() for s in lowered.in_shardings)))


def test_moe_train_steps_equal_one_device_all_to_all_no_gather():
  """Three steps, a new dropout mask and second-expert routing each, equal the
  1-device run within the derived bound. (With atol=1e-6, one of the 16384
  expert weights ``wo``, [7, 21, 30], was 6.3e-6 off the 1-device run after
  the first AdamW step, 5.4e-6 off the f64 run: its gradient, 6.6e-9, is below
  the f32 noise of that leaf's gradients (the bound on it is 7.7e-8), so
  ``g / (|g| + eps)`` may take any value in about [-1, 1] and the derived bound
  there is 3.8e-3 ~ lr. The leaf's median bound is 2.5e-7.)"""
  graphdef, state = flax_nnx.create(seed=0, num_experts=NUM_EXPERTS, **MODEL)
  step = flax_nnx.partitioned_step(graphdef, mesh(*MOE_MESH))
  got, _ = assert_steps_match_one_device(step, graphdef, state, steps=3)
  # the sown aux losses are captured in the loss, not kept in the state
  assert jax.tree.structure(got) == jax.tree.structure(state)

  tokens, targets = _batch(0)
  lowered = step.lower(state, tokens, targets, 0)
  assert lowered.fallbacks == []
  # the experts stay split over data (E) and model (H), and so do Adam's moments
  specs = _spec_by_path(lowered, (state, tokens, targets, 0))
  moe = "['blocks'][1]['mlp']"
  for prefix in ("[0][0]", "[0][1]['opt_state'][0]['mu']"):
    assert specs[f"{prefix}{moe}['wi'].value"] == P("data", None, "model")
    assert specs[f"{prefix}{moe}['wo'].value"] == P("data", "model", None)
    assert specs[f"{prefix}{moe}['wg'].value"] == P(None, None)
  assert specs["[0][0]['blocks'][0]['mlp']['up']['kernel'].value"] == P(None, "model")

  cols = lowered.collectives()
  # dispatch and combine, forward and backward: the [E, G, C, M] tensor moves
  # between G split and E split over data, (n-1)/n of its local block each
  a2a = [c for c in cols if c.kind == "all_to_all"]
  n = MOE_MESH[0][0]
  capacity = expert_capacity(SEQ, NUM_EXPERTS, capacity_factor=2.0)
  shape = (NUM_EXPERTS, BATCH, capacity, MODEL["d_model"])
  local = NUM_EXPERTS * (BATCH // n) * capacity * MODEL["d_model"] * 4
  assert len(a2a) == 4, lowered.explain()
  assert all(c.axes == ("data",) and c.shape == shape and c.bytes == (n - 1) * local // n
             for c in a2a), lowered.explain()
  g_split, e_split = ((), ("data",), (), ()), (("data",), (), (), ())
  assert sorted((c.src.dims, c.dst.dims) for c in a2a) == sorted(
      [(g_split, e_split)] * 2 + [(e_split, g_split)] * 2)
  # nothing is gathered: not the expert weights, not tokens, not dispatch masks
  gathered = [c for c in cols if c.kind == "all_gather"]
  assert not gathered, lowered.explain()


def test_an_nnx_model_evaluates_on_uneven_state():
  """After a partitioned step whose vocabulary (50) splits unevenly, the
  state holds PaddedArrays; NNX's eval flow (nnx.merge, then the model,
  eagerly or under jax.jit) raised "'PaddedArray' object is not
  subscriptable" (found by a review of client code). A PaddedArray reads as
  its logical value under indexing and jax functions: the same logits as on
  the unpadded state."""
  from flax import nnx
  import jax.numpy as jnp
  import optax

  class LM(nnx.Module):
    def __init__(self, rngs):
      self.emb = nnx.Embed(50, 16, rngs=rngs)
      self.out = nnx.Linear(16, 50, rngs=rngs)

    def __call__(self, tok):
      return self.out(self.emb(tok))

  model = LM(nnx.Rngs(0))
  graphdef, state = nnx.split((model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)))

  def step(state, tok):
    model, opt = nnx.merge(graphdef, state)
    loss, g = nnx.value_and_grad(lambda m: optax.softmax_cross_entropy_with_integer_labels(
        m(tok), tok).mean())(model)
    opt.update(model, g)
    return nnx.state((model, opt)), loss

  def spec(v):
    return {(50, 16): P("model", None), (16, 50): P(None, "model"),
            (50,): P("model")}.get(tuple(v.shape))
  specs = nnx.State.from_flat_path({k: spec(v) for k, v in nnx.to_flat_state(state)})
  tok = jnp.arange(16).reshape(8, 2) % 50
  new, _ = gshard.partition(step, mesh((2, 4), ("data", "model")), in_specs=(specs, P("data")))(
      state, tok)
  assert any(isinstance(x, gshard.PaddedArray)
             for x in jax.tree.leaves(new, is_leaf=lambda x: isinstance(x, gshard.PaddedArray)))
  evaluate = lambda s, t: nnx.merge(graphdef, s)[0](t)
  want = np.asarray(evaluate(gshard.unpad(new), tok))
  for got in (evaluate(new, tok), jax.jit(evaluate)(new, tok)):
    # the same values; eager and jitted programs may order the 16-term dots
    # differently: 16 roundings of f32
    np.testing.assert_allclose(np.asarray(got), want, rtol=16 * 2**-23, atol=16 * 2**-23)
