"""``collectives()`` and ``explain()`` describe what the compiled program sends.

* A value needed in one layout by several consumers is resharded once (one
  collective), as XLA would merge the copies anyway.
* An FSDP-style step (parameters split over ``data``, gathered for use, the
  gradients reduce-scattered back): the collectives gshard declares are the
  ones in the optimized HLO, array for array and byte for byte.
* ``explain()`` never prints one member's shape for a group of others.
* Source lines name the user's model code, not Flax's ``linear.py``; the
  library frame follows as ``via flax/linen/linear.py:LINE``.
"""

from __future__ import annotations

import collections
import inspect
import os
import re

import flax.linen as flax_linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jax.experimental.compute_on import compute_on
from jax.experimental.xla_metadata import set_xla_metadata
from jax.sharding import PartitionSpec as P

import gshard
import helpers_mlp
import helpers_partition
from benchmarks import hlo as H
from helpers_partition import assert_trees_close, mesh

pytestmark = pytest.mark.filterwarnings("error::gshard.PartitionWarning")

THIS_FILE = os.path.basename(__file__)


def line_of(obj, text: str) -> int:
  lines, start = inspect.getsourcelines(obj)
  hits = [start + i for i, line in enumerate(lines) if text in line]
  assert len(hits) == 1, (text, hits)
  return hits[0]


def rand(*shape, seed=0, scale=1.0):
  return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


# -- one reshard per (value, layout) ----------------------------------------------

def _three_uses(w, a, b, c):
  return jnp.tanh(a @ w) + jnp.tanh(b @ w) + jnp.tanh(c @ w)


def test_a_value_used_by_several_ops_in_one_layout_is_resharded_once():
  """w is split on its output dim over data, the batches on their rows over
  data: each dot needs w whole. Three consumers, one all_gather (it used to be
  one per consumer, 3 x 256 B, where XLA's HLO has one)."""
  m = mesh((2, 4), ("data", "model"))
  w = rand(16, 8)
  a, b, c = (rand(64, 16, seed=s) for s in (1, 2, 3))
  step = gshard.partition(_three_uses, m, in_specs=(P(None, "data"), P("data"), P("data"),
                                                    P("data")))
  assert_trees_close(step(w, a, b, c), jax.jit(_three_uses)(w, a, b, c))
  low = step.lower(w, a, b, c)
  cols = low.collectives()
  assert [(c.kind, c.axes, c.shape, c.bytes) for c in cols] == \
      [("all_gather", ("data",), (16, 8), 256)], low.explain()
  hlo = H.collectives(low.compile().as_text(), 8)
  assert [(h.kind, h.group_size) for h in hlo] == [("all-gather", 2)]


# -- the FSDP step: declared == compiled -------------------------------------------

FSDP_LAYERS, FSDP_D, FSDP_B = 4, 64, 32


def _fsdp_loss(params, x, y):
  h = x
  for p in params:
    h = jnp.tanh(h @ p["w"] + p["b"])
  return jnp.mean((h - y) ** 2)


def _fsdp_step(params, x, y):
  loss, g = jax.value_and_grad(_fsdp_loss)(params, x, y)
  return jax.tree.map(lambda p, d: p - 0.1 * d, params, g), loss


def _fsdp_args():
  params = [{"w": rand(FSDP_D, FSDP_D, seed=k, scale=0.125),
             "b": rand(FSDP_D, seed=10 + k, scale=0.1)} for k in range(FSDP_LAYERS)]
  return params, rand(FSDP_B, FSDP_D, seed=20), rand(FSDP_B, FSDP_D, seed=21)


def test_fsdp_step_declares_what_the_compiled_program_sends():
  """Parameters (and the batch) split over data on an 8-way mesh. The
  declared collectives are the HLO's: the same number of each kind and the
  same bytes per device (ring formulas on both sides).

  Tolerance: bytes agree to 1 byte per collective (gshard rounds each one to
  whole bytes; the HLO side is a float). XLA's collective combiners may merge
  collectives of one kind into one tuple instruction on other backends (one
  line, the bytes of the sum): there the HLO count is lower while the bytes
  still agree. On this CPU build nothing is merged, so the counts are equal.
  Before one reshard per (value, layout) this step declared 20 collectives /
  88039 B against the HLO's 18 / 79975 B. The exact counts and bytes pin
  the layout choice: 18 / 79975 B before two-phase propagation (weight
  gradients then take their update's layout), 13 / 61831 B with it, and 12 /
  60039 B since option (c), gathering the activation for the weight
  gradient, competes on memory with the cheaper of the plans from the
  tensors' own layouts (it holds no more than that one; the compiled
  program's temporaries went 24832 -> 17600 B), and 12 / 58695 B since the
  readers pass lays out regions of elementwise ops as one (the last layer's
  tanh and the loss's difference, forward and backward, stay batch split:
  two all-to-alls of the activation become a gather of its bias and a
  reduce-scatter of the bias's gradient; temporaries 17728 B)."""
  m = mesh((8,), ("data",))
  params, x, y = _fsdp_args()
  specs = [{"w": P("data", None), "b": P("data")} for _ in params]
  step = gshard.partition(_fsdp_step, m, in_specs=(specs, P("data"), P("data")))
  out = step(params, x, y)
  assert_trees_close(out, jax.jit(_fsdp_step)(params, x, y))
  low = step.lower(params, x, y)
  cols = low.collectives()
  hlo = H.collectives(low.compile().as_text(), 8)
  names = {"all_gather": "all-gather", "all_to_all": "all-to-all", "psum": "all-reduce",
           "psum_scatter": "reduce-scatter", "ppermute": "collective-permute"}
  declared = collections.Counter(names[c.kind] for c in cols)
  compiled = collections.Counter(h.kind for h in hlo)
  assert declared == compiled, low.explain()
  assert declared == {"all-gather": 5, "all-to-all": 1, "reduce-scatter": 5, "all-reduce": 1}
  hlo_bytes = sum(h.bytes_sent for h in hlo)
  assert abs(low.total_bytes() - hlo_bytes) <= len(cols), (low.total_bytes(), hlo_bytes)
  assert low.total_bytes() == 58695


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w1=helpers_partition.specs_2d(helpers_mlp.CHOICES),
       w2=helpers_partition.specs_2d(helpers_mlp.CHOICES),
       x=helpers_partition.specs_2d(helpers_mlp.CHOICES),
       step=st.sampled_from(sorted(helpers_mlp.STEPS)))
# two moves of one value begin with the same ppermute (x's gradient contraction
# reads the hidden activation as [b, a] and as [_, a]): recorded twice before,
# 28160 B declared against the HLO's 26112 (XLA emits it once)
@example(w1=P(None, ("b", "a")), w2=P("a", None), x=P("b", None), step="sgd")
@example(w1=P(None, ("b", "a")), w2=P("a", None), x=P(("b", "a"), None), step="sgd")
def test_the_record_is_what_the_compiled_program_sends(w1, w2, x, step):
  """Random layouts of an MLP train step: the collectives gshard records are
  those of the compiled program, their bytes its bytes kind by kind (to a
  byte per collective: gshard rounds each to whole bytes). Where two
  moves of one value begin with the same collective, it runs once and is
  recorded once."""
  fn, (p, xs) = helpers_mlp.STEPS[step], helpers_mlp.args()
  specs = ({"w1": w1, "w2": w2}, x)
  low = gshard.partition(fn, mesh((2, 4), ("a", "b")), in_specs=specs,
                         out_specs=specs[0]).lower(p, xs)
  cols = low.collectives()
  hlo = H.collectives(low.compile().as_text(), 8)
  names = {"all_gather": "all-gather", "all_to_all": "all-to-all", "psum": "all-reduce",
           "psum_scatter": "reduce-scatter", "ppermute": "collective-permute",
           "pmax": "all-reduce", "pmin": "all-reduce"}
  declared, compiled = collections.Counter(), collections.Counter()
  for c in cols:
    declared[names[c.kind]] += c.bytes
  for h in hlo:          # (XLA may merge collectives of one kind into one tuple)
    compiled[h.kind] += h.bytes_sent
  assert declared.keys() == compiled.keys(), low.explain()
  for kind in declared:
    assert abs(declared[kind] - compiled[kind]) <= len(cols), (kind, low.explain())


# -- explain() groups ---------------------------------------------------------------

def _same_line_two_shapes(params):
  return jax.tree.map(lambda p: jnp.sin(gshard.replicate(p)), params)


def test_explain_prints_each_shape_of_collectives_from_one_line():
  """Two gathers from the same line, primitive, role and layouts but of
  different shapes are two report lines, each with its own shape."""
  m = mesh((2, 4), ("data", "model"))
  params = {"a": rand(8, 4), "b": rand(16, 4, seed=1)}
  step = gshard.partition(_same_line_two_shapes, m, in_specs=(P("data"),))
  assert_trees_close(step(params), jax.jit(_same_line_two_shapes)(params))
  low = step.lower(params)
  gathers = [c for c in low.collectives() if c.kind == "all_gather"]
  assert sorted(c.shape for c in gathers) == [(8, 4), (16, 4)]
  assert len({c.source for c in gathers}) == 1
  report = low.explain()
  assert "f32[8@data,4] -> f32[8,4]" in report, report
  assert "f32[16@data,4] -> f32[16,4]" in report, report
  ranked = report.split("largest communication first:")[1]
  assert "]  f32" in ranked and " x2 " not in ranked, report


# -- source lines: the user's model, not the library ----------------------------------

class _MLP(flax_linen.Module):
  @flax_linen.compact
  def __call__(self, x):
    h = jnp.tanh(flax_linen.Dense(32, use_bias=False)(x))
    return flax_linen.Dense(8, use_bias=False)(h)


def _linen_forward(params, x):
  return _MLP().apply(params, gshard.split(x, 0, "data"))


def test_collectives_of_a_flax_model_cite_the_models_line():
  """Megatron's pair in two nn.Dense layers: the activation psum is bound in
  flax/linen/linear.py, and reported at this file's ``nn.Dense(8)`` line with
  the library frame after it."""
  m = mesh((2, 4), ("data", "model"))
  x = rand(8, 16)
  params = _MLP().init(jax.random.PRNGKey(0), x)
  specs = {"params": {"Dense_0": {"kernel": P(None, "model")},
                      "Dense_1": {"kernel": P("model", None)}}}
  step = gshard.partition(_linen_forward, m, in_specs=(specs, None))
  assert_trees_close(step(params, x), jax.jit(_linen_forward)(params, x), atol=1e-5)
  low = step.lower(params, x)
  (psum,) = [c for c in low.collectives() if c.axes == ("model",)]
  line = line_of(_MLP, "flax_linen.Dense(8")
  assert psum.kind == "psum" and psum.primitive == "dot_general"
  assert f"{THIS_FILE}:{line}:" in psum.source, psum.source
  assert "(_MLP.__call__) via flax/linen/linear.py:" in psum.source, psum.source
  assert f"{THIS_FILE}:{line}:" in low.explain()
  assert "flax/linen/linear.py" not in psum.source.split(" via ")[0]


def test_the_compiled_program_names_the_users_layer_and_line():
  """Profilers and HLO dumps read each op's metadata: in gshard's compiled
  program the Megatron psum, the local dots and the whole backward pass carry
  the Flax module path (``Dense_0``, ``transpose(jvp(_MLP))``) and this file's
  line, as in the program ``jax.jit`` compiles; none is left naming only the
  line that called ``lower()``."""
  m = mesh((2, 4), ("data", "model"))
  x = rand(8, 16)
  params = _MLP().init(jax.random.PRNGKey(0), x)
  specs = {"params": {"Dense_0": {"kernel": P(None, "model")},
                      "Dense_1": {"kernel": P("model", None)}}}
  loss = lambda p, x: jnp.sum(_linen_forward(p, x) ** 2)
  step = gshard.partition(jax.grad(loss), m, in_specs=(specs, None))
  hlo = step.lower(params, x).compile().as_text()
  op_names = collections.defaultdict(set)
  for op, name in re.findall(r"= \S+ ([\w-]+)\(.*op_name=\"([^\"]*)\"", hlo):
    op_names[op].add(name)
  assert any("Dense_1" in n for n in op_names["all-reduce"]), op_names["all-reduce"]
  dots = op_names["dot"] | op_names["fusion"]
  for layer in ("jvp(_MLP)/Dense_0", "jvp(_MLP)/Dense_1",
                "transpose(jvp(_MLP))/Dense_0", "transpose(jvp(_MLP))/Dense_1"):
    assert any(layer in n for n in dots), (layer, sorted(dots))
  # the stack frames name this file's nn.Dense lines
  assert f'"{os.path.abspath(__file__)}"' in hlo
  line = line_of(_MLP, "flax_linen.Dense(8")
  assert re.search(rf"line={line} ", hlo), line


@jax.jit
def _inner(x, w):
  with jax.named_scope("innerscope"):
    return jnp.tanh(x @ w)


def _outer_loss(x, w):
  with jax.named_scope("outer"):
    return jnp.sum(_inner(x, w) ** 2)


def _dot_scopes(hlo: str, prefix: str) -> set[str]:
  """The scopes (op_name less its last part, which XLA's rewrites may change)
  of the dots of a compiled program."""
  return {n[len(prefix):].rsplit("/", 1)[0]
          for n in re.findall(r" dot\(.*op_name=\"([^\"]*)\"", hlo) if n.startswith(prefix)}


def test_a_nested_jit_and_named_scopes_name_the_ops_as_under_jax_jit():
  """Every dot of the gradient program carries the scope jax.jit gives it
  (``jvp(outer)/jit(_inner)/innerscope``, ``transpose(jvp(outer))/...``),
  under gshard's ``jit(body)/shard_map`` prefix."""
  m = mesh((2, 4), ("data", "model"))
  x, w = rand(8, 16), rand(16, 8, seed=1)
  grad = jax.grad(_outer_loss, argnums=1)
  step = gshard.partition(grad, m, in_specs=(P("data"), P(None, "model")))
  ours = _dot_scopes(step.lower(x, w).compile().as_text(),
                     "jit(_outer_loss)/jit(body)/shard_map/")
  theirs = _dot_scopes(jax.jit(grad).lower(x, w).compile().as_text(), "jit(_outer_loss)/")
  assert theirs == {"jvp(outer)/jit(_inner)/innerscope",
                    "transpose(jvp(outer))/jit(_inner)/innerscope"}, theirs
  assert theirs <= ours, (theirs, ours)


def _tagged(x, w):
  with set_xla_metadata(gshard_test_tag="layer7"):
    y = jnp.tanh(x @ w)
  return jnp.sum(y)


def test_set_xla_metadata_reaches_the_partitioned_program():
  """The user's ``set_xla_metadata`` is on the per-device ops of the equations
  it covered (as ``mhlo.frontend_attributes``, as under ``jax.jit``), and on
  none of the others."""
  m = mesh((2, 4), ("data", "model"))
  x, w = rand(8, 16), rand(16, 8, seed=1)
  step = gshard.partition(_tagged, m, in_specs=(P("data"), P(None, "model")))
  n = x.shape[0] * w.shape[1]     # the sum's terms, each |tanh| <= 1, reassociated
  np.testing.assert_allclose(step(x, w), jax.jit(_tagged)(x, w), rtol=0,
                             atol=n * n * np.finfo(np.float32).eps)
  text = step.lower(x, w).as_text()
  tagged = [ln for ln in text.splitlines() if 'gshard_test_tag = "layer7"' in ln]
  assert any("stablehlo.dot_general" in ln for ln in tagged), tagged
  assert any("stablehlo.tanh" in ln for ln in tagged), tagged
  assert not any("reduce" in ln for ln in tagged), tagged


def _tagged_value(x, w):
  return jnp.sum(set_xla_metadata(x @ w, gshard_test_tag="value_form"))


def test_the_value_form_of_set_xla_metadata_tags_the_local_op():
  """``set_xla_metadata(value, ...)`` (an identity primitive) has a rule: the
  tag lands on the local dot, the pending sum passes through it, and nothing
  takes the safe path (``strict=True``)."""
  m = mesh((2, 4), ("data", "model"))
  x, w = rand(8, 16), rand(16, 8, seed=1)
  step = gshard.partition(_tagged_value, m, in_specs=(P(None, "model"), P("model")),
                          strict=True)
  # a sum of 8*8 dots of n terms each, reassociated: at most (n + 64) roundings
  # of a sum whose terms add up to at most 64 * n * max|x| * max|w|
  n, cells = x.shape[1], x.shape[0] * w.shape[1]
  bound = (n + cells) * np.finfo(np.float32).eps * cells * n * np.abs(x).max() * np.abs(w).max()
  np.testing.assert_allclose(step(x, w), jax.jit(_tagged_value)(x, w), rtol=0, atol=bound)
  low = step.lower(x, w)
  tagged = [ln for ln in low.as_text().splitlines() if 'gshard_test_tag = "value_form"' in ln]
  assert len(tagged) == 1 and "stablehlo.dot_general" in tagged[0], tagged
  assert [c.kind for c in low.collectives()] == ["psum"]


def test_compute_on_is_reported_not_carried():
  """A ``compute_on`` placement is not carried (the collectives gshard adds
  would be placed with the op): each such line is named in a warning."""
  m = mesh((2, 4), ("data", "model"))
  x, w = rand(8, 16), rand(16, 8, seed=1)

  def f(x, w):
    with compute_on("device_host"):
      y = jnp.tanh(x @ w)
    return jnp.sum(y)

  with pytest.warns(gshard.PartitionWarning, match=r"compute_on\('device_host'\) at .*"
                    + THIS_FILE + r":\d+.*runs on the device"):
    got = gshard.partition(f, m, in_specs=(P("data"), P(None, "model")))(x, w)
  n = x.shape[0] * w.shape[1]
  np.testing.assert_allclose(got, jax.jit(f)(x, w), rtol=0,
                             atol=n * n * np.finfo(np.float32).eps)


def test_plain_code_keeps_jaxs_format():
  """Code outside any library: ``file:line:column (function)``, nothing after."""
  m = mesh((2, 4), ("data", "model"))
  w = rand(16, 8)
  a = rand(64, 16, seed=1)
  step = gshard.partition(lambda w, a: _three_uses(w, a, a, a), m,
                          in_specs=(P(None, "data"), P("data")))
  (col,) = step.lower(w, a).collectives()
  line = line_of(_three_uses, "return jnp.tanh(a @ w)")
  assert col.source.startswith(os.path.abspath(__file__) + f":{line}:")
  assert col.source.endswith("(_three_uses)") and " via " not in col.source


# -- explain(): why this collective and not another ------------------------------------

def _row_parallel(x, w):
  return gshard.replicate(gshard.split(x, 1, "model") @ gshard.split(w, 0, "model"))


def test_explain_shows_each_contraction_option_with_its_bytes():
  """Megatron's row-parallel matmul, ``x[16,64@model] @ w[64@model,32]``:
  GShard's option (b) (contract locally, all-reduce the partial result:
  ``2 (n-1)/n`` of the f32[16,32] result) is chosen over (c) (gather both
  operands: ``(n-1)/n`` of each, 3x the bytes); the report prints both."""
  m = mesh((2, 4), ("data", "model"))
  x, w = rand(16, 64), rand(64, 32, seed=1)
  step = gshard.partition(_row_parallel, m)
  assert_trees_close(step(x, w), jax.jit(_row_parallel)(x, w))
  low = step.lower(x, w)
  [choice] = [c for c in low.choices() if c.primitive == "dot_general"]
  n = 4
  reduce_result = 2 * (n - 1) * (16 * 32 * 4) // n
  gather_both = (n - 1) * (16 * 64 * 4 + 64 * 32 * 4) // n
  by_label = {o.label[:3]: o for o in choice.options}
  assert by_label["(b)"].chosen and by_label["(b)"].bytes == reduce_result, choice
  assert by_label["(c)"].bytes == gather_both, choice
  sent = sum(c.bytes for c in low.collectives() if c.primitive == "dot_general")
  assert sent == choice.chosen.bytes
  report = low.explain()
  section = report.split("contractions and lookups:")[1]
  assert "chosen" in section and "(c) reshard operands first" in section, report
  assert "operand 0 all_gather[model]; operand 1 all_gather[model]" in section, report


# -- jax.debug.inspect_array_sharding -----------------------------------------------

def _inspected(seen: list | None, contract_split: bool):
  """``x @ w`` inspected; split on the contracted dim, its sum is pending (the
  row sums after it are summed instead, fewer bytes)."""
  def f(x, w):
    h = x @ w
    if seen is not None:
      jax.debug.inspect_array_sharding(h, callback=seen.append)
    return jnp.sum(h, axis=1) if contract_split else jnp.tanh(h)
  specs = (P("data", "model"), P("model")) if contract_split else (P("data"), P(None, "model"))
  return f, specs


@pytest.mark.filterwarnings("error::gshard.PartitionWarning")
@pytest.mark.parametrize("contract_split", [False, True])
def test_inspect_array_sharding_reports_gshards_layout_and_moves_nothing(contract_split):
  """The callback gets the layout gshard gave the value, as ``jax.jit`` gives
  XLA's: ``P('data', 'model')`` for a split result, and a pending sum as
  ``unreduced`` axes. Inspecting adds no collective and no warning: the
  program is the one without it."""
  m = mesh((2, 4), ("data", "model"))
  seen: list = []
  f, specs = _inspected(seen, contract_split)
  # small integers: the product is exact in any order of its sums
  x = np.random.default_rng(0).integers(-3, 4, (8, 16)).astype(np.float32)
  w = np.random.default_rng(1).integers(-3, 4, (16, 32)).astype(np.float32)
  step = gshard.partition(f, m, in_specs=specs)
  out = step(x, w)
  (got,) = seen                              # once, while gshard partitions
  np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(f)(x, w)))
  if contract_split:
    assert got.spec == P("data", None, unreduced={"model"}), got
    assert dict(zip(got.mesh.axis_names, got.mesh.axis_types))["model"] == \
        jax.sharding.AxisType.Explicit
  else:
    assert got.spec == P("data", "model") and got.mesh == m, got
    jax.jit(f, in_shardings=tuple(jax.NamedSharding(m, s) for s in specs))(x, w)
    assert seen[-1].spec == got.spec        # what jax.jit reports for XLA's layout
  plain = gshard.partition(_inspected(None, contract_split)[0], m, in_specs=specs)
  assert [(c.kind, c.bytes) for c in step.lower(x, w).collectives()] == \
      [(c.kind, c.bytes) for c in plain.lower(x, w).collectives()]


def test_inspect_array_sharding_on_an_abstract_mesh():
  """Lowered for a pod from this machine: the callback gets the sharding on
  the AbstractMesh."""
  from jax.sharding import AbstractMesh, AxisType
  m = AbstractMesh((16, 64), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  seen: list = []
  f, specs = _inspected(seen, False)
  args = (jax.ShapeDtypeStruct((64, 256), jnp.float32), jax.ShapeDtypeStruct((256, 512), jnp.float32))
  gshard.partition(f, m, in_specs=specs).lower(*args, platform="tpu")
  (got,) = seen
  assert got.spec == P("data", "model") and got.mesh == m, got


def test_values_nothing_reads_are_not_partitioned_or_reported():
  """jax.grad keeps the forward's loss, which the gradient does not read: it
  was partitioned, and its all-gather reported, though XLA drops it (found
  by a review of the reports). Dead equations are dropped before
  propagation; an effect (a print) stays."""
  m = gshard.make_mesh((2, 4), ("data", "model"))

  def f(x):
    jax.debug.print("unused {}", jnp.sum(x))
    return jax.grad(lambda x: jax.nn.log_softmax(x, axis=1)[:, 0].sum())(x)

  x = jnp.linspace(-1, 1, 8 * 64).reshape(8, 64)
  low = gshard.partition(f, m, in_specs=(P("data", "model"),)).lower(x)
  kinds = [c.kind for c in low.collectives()]
  assert "all_gather" not in kinds, low.collectives()
  assert any(e.primitive.name == "debug_print" for e in low.propagation.jaxpr.eqns)
  hlo = low.compile().as_text()
  assert len(re.findall(r" all-gather(?:-start)?\(", hlo)) == 0
  np.testing.assert_allclose(np.asarray(low.compile()(x)), np.asarray(jax.jit(f)(x)),
                             rtol=1e-6, atol=1e-7)


def test_a_convolutions_halo_is_exchanged_once():
  """The forward convolution and its weight gradient read the same halo of
  the input: it was sent and reported twice (XLA merged them: the report
  said twice the bytes; found by a review of the reports)."""
  from jax import lax
  m = gshard.make_mesh((8,), ("sp",))

  def step(w, x):
    def loss(w):
      y = lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                   dimension_numbers=("NHWC", "HWIO", "NHWC"))
      return jnp.sum(y ** 2)
    return w - 0.1 * jax.grad(loss)(w)

  w = jnp.linspace(-1, 1, 9 * 64).reshape(3, 3, 8, 8)
  x = jnp.linspace(-1, 1, 2 * 64 * 16 * 8).reshape(2, 64, 16, 8)
  low = gshard.partition(step, m, in_specs=(None, P(None, "sp"))).lower(w, x)
  shifts = [c for c in low.collectives() if c.kind == "ppermute"]
  hlo = [c for c in H.collectives(low.compile().as_text(), 8) if c.kind == "collective-permute"]
  assert len(shifts) == len(hlo) == 2, (low.collectives(), hlo)
  assert sum(c.bytes for c in shifts) == sum(c.bytes_sent for c in hlo)
  np.testing.assert_allclose(np.asarray(low.compile()(w, x)), np.asarray(jax.jit(step)(w, x)),
                             rtol=1e-5, atol=1e-5)


def test_a_collective_in_a_scan_says_how_often_it_runs():
  """A scan body's collective is counted once per iteration: its entry says
  so (``repeat``, and "(x5 in a loop)" in explain()), where the report
  showed five times the bytes of one with nothing to say why."""
  from jax import lax
  m = gshard.make_mesh((2, 4), ("data", "model"))

  def f(w, x):
    return lax.fori_loop(0, 5, lambda i, h: jnp.tanh(h @ w), x).sum()

  w, x = jnp.eye(64) / 2, jnp.linspace(-1, 1, 16 * 64).reshape(16, 64)
  low = gshard.partition(f, m, in_specs=(P("model", None), P("data", "model"))).lower(w, x)
  looped = [c for c in low.collectives() if c.repeat == 5]
  assert looped and all(c.bytes % 5 == 0 for c in looped), low.collectives()
  assert "(x5 in a loop)" in str(looped[0]) and "(x5 in a loop)" in low.explain()


def test_an_annotation_whose_result_is_unused_still_lays_out_its_operand():
  """``gshard.split(x, ...)`` written as if it acted in place: its result is
  unused, but it is kept through the dead-equation pass, and x is split as
  it says (as before the pass)."""
  m = gshard.make_mesh((2, 4), ("data", "model"))

  def f(x):
    gshard.split(x, 0, "data")
    return jnp.exp(x)

  low = gshard.partition(f, m).lower(jnp.ones((8, 4)))
  assert low.propagation.in_shardings[0].dims[0] == ("data",)


def test_the_trace_key_stays_out_of_the_program():
  """gshard keys jax's trace caches by its mesh with a set_xla_metadata key
  while it traces; a combiner jaxpr bound as it is (scatter-add, a generic
  reduce_window) carried it into the StableHLO as a frontend attribute, so a
  data-parallel program's text differed from GSPMD's by it alone. The
  user's own metadata still reaches the program."""
  from jax import lax
  from jax.experimental.xla_metadata import set_xla_metadata
  m = gshard.make_mesh((2, 4), ("data", "model"))

  def f(x, i, u):
    with set_xla_metadata(mine="yes"):
      w = lax.reduce_window(x, 1.0, lax.mul, (1, 2), (1, 2), "VALID")
    return x.at[i].add(u), w

  x = jnp.linspace(0.5, 1, 64).reshape(8, 8)
  low = gshard.partition(f, m, in_specs=(P("data", "model"), None, None)).lower(
      x, jnp.array([1, 3]), jnp.ones((2, 8)))
  text = low.as_text()
  assert "gshard_mesh" not in text and 'mine = "yes"' in text
