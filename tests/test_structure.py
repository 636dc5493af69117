"""Structural tests on the compiled program: which collectives XLA actually runs.

Parsed from the optimized HLO of ``lower(...).compile().as_text()``. XLA may
merge collectives into one tuple-shaped instruction, so the checks count the
arrays and bytes each mesh axis reduces, by operand shape, not instructions.
Replica groups are read in both text formats and mapped back to mesh axes
(see helpers_partition.hlo_collectives). The same facts are then checked on
gshard's own account, ``lowered.collectives()``.
"""

from __future__ import annotations

import collections
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import gshard
from examples import models as M
from helpers_numerics import assert_close_to_f64, f64_run, to_host
from helpers_partition import (groups_to_axes, hlo_collectives, mesh,
                               parse_replica_groups)

BATCH, D_MODEL, D_HIDDEN = 16, 64, 256
DATA, MODEL = 2, 4


def _line(fn, text):
  lines, start = inspect.getsourcelines(fn)
  (n,) = [start + i for i, line in enumerate(lines) if text in line]
  return n


@pytest.fixture(scope="module")
def mlp():
  """The Megatron MLP SGD step on data=2 x model=4, lowered and compiled once."""
  m = mesh((DATA, MODEL), ("data", "model"))
  params = M.mlp_init(jax.random.PRNGKey(0), D_MODEL, D_HIDDEN)
  x = jnp.ones((BATCH, D_MODEL))
  step = gshard.partition(M.sgd_step(M.mlp_loss), m,
                          in_specs=(M.MLP_SPECS, P("data"), None))
  low = step.lower(params, x, x)
  return m, low, hlo_collectives(low.compile().as_text(), m)


def _arrays_by_axes(cols):
  out = collections.defaultdict(list)
  for c in cols:
    for dtype, shape in c.shapes:
      out[c.axes].append((dtype, shape))
  return out


def test_mlp_hlo_has_only_all_reduces(mlp):
  _, _, cols = mlp
  assert cols, "no collective found: the parser or the program is wrong"
  kinds = collections.Counter(c.kind for c in cols)
  assert set(kinds) == {"all-reduce"}, kinds       # in particular: no all-gather


def test_mlp_hlo_one_activation_all_reduce_over_model(mlp):
  """Forward: the row-parallel ``h @ w2`` leaves a partial [batch, d_model]
  activation, summed once over ``model``. Backward: x is not a parameter, so
  no input gradient is needed and nothing else is reduced over ``model``."""
  _, _, cols = mlp
  arrays = _arrays_by_axes(cols)
  local_act = (BATCH // DATA, D_MODEL)
  assert arrays[("model",)] == [("f32", local_act)], arrays
  model_bytes = sum(c.nbytes for c in cols if c.axes == ("model",))
  assert model_bytes == math.prod(local_act) * 4


def test_mlp_hlo_gradient_reductions_over_data(mlp):
  """The data-parallel sums: each device's block of both weight gradients (and
  the scalar loss), over ``data`` only; nothing over both axes."""
  _, _, cols = mlp
  arrays = _arrays_by_axes(cols)
  w1_block = (D_MODEL, D_HIDDEN // MODEL)
  w2_block = (D_HIDDEN // MODEL, D_MODEL)
  got = sorted(shape for _, shape in arrays[("data",)])
  assert got == sorted([w1_block, w2_block, ()]), arrays
  assert set(arrays) == {("model",), ("data",)}, set(arrays)
  data_bytes = sum(c.nbytes for c in cols if c.axes == ("data",))
  assert data_bytes == 4 * (math.prod(w1_block) + math.prod(w2_block) + 1)


def test_mlp_collectives_account_matches_the_hlo(mlp):
  """``lowered.collectives()`` says the same: one psum over model of the
  activation, caused by ``h @ w2`` in mlp_loss; gradient psums over data; no
  gather; and its ring bytes are those of the arrays XLA reduces."""
  m, low, hlo = mlp
  cols = low.collectives()
  assert not [c for c in cols if c.kind not in ("psum",)], [str(c) for c in cols]
  over_model = [c for c in cols if c.axes == ("model",)]
  assert len(over_model) == 1
  (act,) = over_model
  assert act.shape == (BATCH, D_MODEL) and act.primitive == "dot_general"
  assert f"models.py:{_line(M.mlp_loss, 'out = h @ params')}:" in act.source
  assert act.src.dims == (("data",), ()) and act.src.partial == {"model"}
  over_data = [c for c in cols if c.axes == ("data",)]
  assert sorted(c.shape for c in over_data) == sorted([(D_MODEL, D_HIDDEN),
                                                       (D_HIDDEN, D_MODEL), ()])
  assert len(cols) == len(over_model) + len(over_data)
  sizes = dict(zip(m.axis_names, m.devices.shape))
  for axes in (("model",), ("data",)):
    n = math.prod(sizes[a] for a in axes)
    ring = sum(c.bytes for c in cols if c.axes == axes)
    hlo_bytes = sum(c.nbytes for c in hlo if c.axes == axes)
    assert ring == pytest.approx(2 * (n - 1) / n * hlo_bytes, abs=2), axes


def test_gpt_hlo_activation_reductions_are_the_analytic_minimum():
  """GPT on data=2 x model=4, L layers: 4L+2 all-reduces of a [batch, seq,
  d_model] activation over ``model`` (per layer: attention and MLP outputs
  forward, their input gradients backward with the q/k/v partial gradients
  added before one reduction; plus the logits' input gradient), none over
  ``data``. The tied embedding's lookup moves its [V/mp, D] table block to a
  feature split (one all-to-all over ``model``), looks up each device's
  features and all-gathers the [batch, seq, d_model] activation: fewer bytes
  than all-reducing a vocab-split masked lookup (twice the all-gather's)."""
  n_layers, batch, seq = 2, 8, 16
  m = mesh((DATA, MODEL), ("data", "model"))
  params = M.gpt_init(jax.random.PRNGKey(0), n_layers=n_layers)
  tokens = jnp.zeros((batch, seq), jnp.int32)
  step = gshard.partition(M.sgd_step(M.gpt_loss), m,
                          in_specs=(M.gpt_specs(params), P("data"), P("data")))
  cols = hlo_collectives(step.lower(params, tokens, tokens).compile().as_text(), m)
  vocab, d_model = params["embed"].shape
  moves = [c for c in cols if c.kind != "all-reduce"]
  assert sorted((c.kind, c.axes) for c in moves) == [("all-gather", ("model",)),
                                                     ("all-to-all", ("model",))], moves
  assert sum(c.nbytes for c in moves if c.kind == "all-to-all") == vocab // MODEL * d_model * 4
  # its output: [batch, seq, d_model], gathered on a leading dim of the
  # feature blocks (gshard's form on CPU devices) and moved into place after
  assert [c.shapes for c in moves if c.kind == "all-gather"] == [
      (("f32", (MODEL, batch // DATA, seq, d_model // MODEL)),)]
  cols = [c for c in cols if c.kind == "all-reduce"]
  arrays = _arrays_by_axes(cols)
  act = ("f32", (batch // DATA, seq, 64))
  assert arrays[("model",)].count(act) == 4 * n_layers + 1, arrays[("model",)]
  # the rest over model are [batch, seq] softmax statistics of the vocab split
  # (the max travels as order-preserving int32 keys, so NaN cannot be dropped)
  assert all(a == act or a in (("f32", (batch // DATA, seq)), ("s32", (batch // DATA, seq)))
             for a in arrays[("model",)]), arrays[("model",)]
  assert ("s32", (batch // DATA, seq)) in arrays[("model",)]
  # data-parallel gradient sums: each device's block of every parameter,
  # reduced once, over data (a replicated layer-norm scale may be reduced over
  # both axes at once when its cotangent is still a pending sum over model);
  # and one scalar, the loss.
  specs = jax.tree.leaves(M.gpt_specs(params), is_leaf=lambda x: isinstance(x, P))
  blocks = []
  for leaf, spec in zip(jax.tree.leaves(params), specs):
    dims = list(spec) + [None] * (leaf.ndim - len(spec))
    blocks.append(("f32", tuple(n // MODEL if d == "model" else n
                                for n, d in zip(leaf.shape, dims))))
  scalars = [a for axes in arrays for a in arrays[axes] if a == ("f32", ())]
  assert len(scalars) == 1, arrays
  # (a weight gradient is summed before jax's transpose of it: its dims in any order)
  grads = [(d, tuple(sorted(s))) for axes in (("data",), ("data", "model"))
           for d, s in arrays[axes] if s]
  assert sorted(grads) == sorted((d, tuple(sorted(s))) for d, s in blocks), arrays
  assert set(arrays) <= {("model",), ("data",), ("data", "model")}, set(arrays)


def test_gpt_sequence_parallel_sums_partials_before_one_reduce_scatter():
  """The residual stream split on d_model (sequence-parallel style: the
  embedding split on d_model, Megatron layers): each matmul's input is
  all-gathered and its row-parallel output reduce-scattered, and in the
  backward the q, k and v input gradients (partial sums over ``model``) are
  added first and reduce-scattered once, not three times. Per layer 4
  all-gathers and 4 reduce-scatters of one [batch, seq, d_model] activation
  each, the bytes of Megatron's 4 all-reduces; equal to one device."""
  n_layers, batch, seq = 1, 8, 16
  m = mesh((DATA, MODEL), ("data", "model"))
  params = M.gpt_init(jax.random.PRNGKey(0), n_layers=n_layers)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, seq), 0, params["embed"].shape[0])
  specs = M.gpt_specs(params)
  specs["embed"] = P(None, "model")
  step_fn = M.sgd_step(lambda p, a, b: M.gpt_loss(p, a, b, annotate=False))
  step = gshard.partition(step_fn, m, in_specs=(specs, P("data"), P("data")))
  low = step.lower(params, tokens, tokens)
  act = (batch, seq, 64)
  kinds = collections.Counter(c.kind for c in low.collectives() if c.shape == act)
  assert kinds["all_gather"] == kinds["psum_scatter"] == 4 * n_layers, kinds
  got = step(params, tokens, tokens)
  want = jax.jit(step_fn)(params, tokens, tokens)
  exact = f64_run(jax.jit(step_fn), params, tokens, tokens)
  assert_close_to_f64(to_host(got), to_host(want), exact, n=batch * seq, what="sequence parallel")


# -- the parser itself -----------------------------------------------------------

def test_replica_group_formats():
  m = mesh((DATA, MODEL), ("data", "model"))
  listed = parse_replica_groups("x, replica_groups={{0,4},{1,5},{2,6},{3,7}}, y", 8)
  assert listed == [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert groups_to_axes(listed, m) == ("data",)
  iota = parse_replica_groups("replica_groups=[2,4]<=[8], use_global_device_ids", 8)
  assert iota == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert groups_to_axes(iota, m) == ("model",)
  transposed = parse_replica_groups("replica_groups=[4,2]<=[2,4]T(1,0)", 8)
  assert transposed == [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert groups_to_axes(transposed, m) == ("data",)
  assert groups_to_axes(parse_replica_groups("replica_groups={}", 8), m) == \
      ("data", "model")
  with pytest.raises(AssertionError):
    groups_to_axes([[0, 1], [2, 3], [4, 5], [6, 7]], m)   # half a model row


def test_parser_reads_tuples_and_ignores_other_instructions():
  m = mesh((DATA, MODEL), ("data", "model"))
  text = "\n".join([
      "  %a = f32[8,64]{1,0} all-reduce(%x), channel_id=1, "
      "replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add",
      "  %b = (f32[64,64]{1,0}, f32[]) all-reduce(%y, %z), channel_id=2, "
      "replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add",
      "  %c = f32[64,64]{1,0} get-tuple-element(%b), index=0",
      "  ROOT %d = f32[16,64]{1,0} all-gather(%a), channel_id=3, "
      "replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}",
  ])
  cols = hlo_collectives(text, m)
  assert [(c.kind, c.axes, c.nbytes) for c in cols] == [
      ("all-reduce", ("model",), 8 * 64 * 4),
      ("all-reduce", ("data",), 64 * 64 * 4 + 4),
      ("all-gather", ("data",), 16 * 64 * 4)]


def test_structure_checks_see_an_all_gather_when_there_is_one():
  """A layout that needs a gather shows up as one: the checks above can fail."""
  m = mesh((DATA, MODEL), ("data", "model"))

  def f(x, w):
    return gshard.replicate(x @ w)           # w split on its output dim

  x, w = np.ones((8, 16), np.float32), np.ones((16, 32), np.float32)
  low = gshard.partition(f, m, in_specs=(None, P(None, "model"))).lower(x, w)
  cols = hlo_collectives(low.compile().as_text(), m)
  assert [c.kind for c in cols] == ["all-gather"]
  assert cols[0].axes == ("model",)
  assert [c.kind for c in low.collectives()] == ["all_gather"]
