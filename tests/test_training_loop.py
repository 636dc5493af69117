"""A training loop over ``gshard.partition`` costs what ``jax.jit`` costs.

* The second call neither traces, propagates nor compiles, with a Python int
  leaf (``TrainState.step=0``) that comes back as a weak-typed int32.
* State keeps its layout: an output that is the next value of an input comes
  back laid out as that input, so it goes back in without moving.
* Laid-out arguments go to the compiled program with no Python work per leaf:
  no ``device_put``, no trace.
* Uneven state stays split: a 1003-row table over ``model=4`` comes back as a
  ``gshard.PaddedArray`` holding ceil(1003/4) = 251 rows per device, feeds
  back without a pad, and checkpoints with orbax.
"""

from __future__ import annotations

import typing

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gshard
from gshard.spmd.partition.api import pair_state
from helpers_partition import assert_named_sharding, assert_trees_close, mesh

pytestmark = pytest.mark.filterwarnings("error::gshard.PartitionWarning")

M24 = ((2, 4), ("data", "model"))
_COMPILES = [0]


def _count_compile(event, duration, **kwargs):
  del duration, kwargs
  if event == "/jax/core/compile/backend_compile_duration":
    _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


class Counters:
  """Counts, while it is active, XLA compiles, ``jax.device_put`` calls and
  jax traces of a partitioned function's program (``_run``)."""

  def __init__(self, step, monkeypatch):
    self.traces = 0
    self.puts = 0
    run = step._run

    def counting_run(*args):
      self.traces += 1
      return run(*args)
    monkeypatch.setattr(step, "_run", counting_run)
    put = jax.device_put

    def counting_put(*args, **kwargs):
      self.puts += 1
      return put(*args, **kwargs)
    monkeypatch.setattr(jax, "device_put", counting_put)
    self.compiles0 = _COMPILES[0]

  @property
  def compiles(self) -> int:
    return _COMPILES[0] - self.compiles0


def rand(*shape, seed=0, scale=1.0):
  return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


# -- a TrainState with a Python int step ----------------------------------------------

class TrainState(typing.NamedTuple):
  step: typing.Any
  params: typing.Any
  opt_state: typing.Any


OPT = optax.adam(1e-2)
USER_TRACES = [0]


def _mlp_loss(params, x, y):
  h = jnp.tanh(x @ params["w1"])
  return jnp.mean((h @ params["w2"] - y) ** 2)


def _train_step(state, x, y):
  USER_TRACES[0] += 1
  loss, g = jax.value_and_grad(_mlp_loss)(state.params, x, y)
  updates, opt_state = OPT.update(g, state.opt_state, state.params)
  return TrainState(state.step + 1, optax.apply_updates(state.params, updates),
                    opt_state), loss


def _train_state():
  params = {"w1": rand(16, 64, scale=0.25), "w2": rand(64, 8, seed=1, scale=0.25)}
  return TrainState(0, params, OPT.init(params))


SPECS = (TrainState(None, {"w1": P(None, "model"), "w2": P("model", None)}, None),
         P("data"), P("data"))


def test_second_call_neither_traces_nor_compiles(monkeypatch):
  m = mesh(*M24)
  x, y = rand(32, 16, seed=2), rand(32, 8, seed=3)
  step = gshard.partition(_train_step, m, in_specs=SPECS)
  ref = jax.jit(_train_step)
  USER_TRACES[0] = 0
  got, loss = step(_train_state(), x, y)
  assert USER_TRACES[0] == 1                # gshard traces anew (jax.jit's trace is its own)
  want, ref_loss = ref(_train_state(), x, y)
  traced = USER_TRACES[0]
  a, b = jax.typeof(got.step), jax.typeof(0)             # ~int32: weak, as jax.jit gives
  assert (a.shape, a.dtype, a.weak_type) == (b.shape, b.dtype, b.weak_type) == \
      ((), jnp.int32, True)
  x_dev = jax.device_put(x, NamedSharding(m, P("data")))
  y_dev = jax.device_put(y, NamedSharding(m, P("data")))
  got, _ = step(got, x_dev, y_dev)                        # the batch now on device too
  want, _ = ref(want, x, y)
  count = Counters(step, monkeypatch)
  for _ in range(3):
    got, loss = step(got, x_dev, y_dev)
    want, ref_loss = ref(want, x, y)
  assert (count.traces, count.compiles, count.puts) == (0, 0, 0)
  assert USER_TRACES[0] == traced                         # traced and propagated once
  assert int(got.step) == 5
  assert_trees_close((got, loss), (want, ref_loss), rtol=2e-5, atol=2e-5)
  assert len(step._cache) == 1


def test_numpy_batches_each_step_compile_once(monkeypatch):
  """Host batches every step (the usual input pipeline): the state goes back
  on device as it came out, the batch is placed by jax's dispatch."""
  m = mesh(*M24)
  x, y = rand(32, 16, seed=2), rand(32, 8, seed=3)
  step = gshard.partition(_train_step, m, in_specs=SPECS)
  # the state from host arrays, as a checkpoint restores it: optax's init and
  # jax's slicing of device arrays onto the mesh compile small programs of
  # their own, once per process, which are not the step's
  state = _train_state()
  state = state._replace(opt_state=jax.tree.map(np.asarray, state.opt_state))
  count = Counters(step, monkeypatch)
  state, _ = step(state, x, y)
  assert count.compiles == 1                  # the first call: one XLA compile
  for i in range(3):
    state, _ = step(state, rand(32, 16, seed=10 + i), rand(32, 8, seed=20 + i))
  assert count.compiles == 1 and count.traces == 2      # the first call's two traces only
  assert int(state.step) == 4


# -- state keeps its layout ----------------------------------------------------------------

def _push(buf, x):
  """A rolling buffer: drop the oldest row, append x."""
  return jnp.concatenate([buf[1:], x[None]], axis=0), buf.sum()


def test_state_comes_back_in_the_layout_it_went_in(monkeypatch):
  """The concatenate works on rows gathered over model, so propagation leaves
  the new buffer replicated; it is the next value of buf (same position, shape
  and dtype), so it comes back split over model as buf went in (a local slice
  inside the program), and goes back in without moving."""
  m = mesh(*M24)
  buf = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
  step = gshard.partition(_push, m, in_specs=(P("model"), None))
  low = step.lower(buf, np.zeros(8, np.float32))
  assert str(low.propagation.out_shardings[0]) == "[_,_]"    # what propagation chose
  assert low.out_shardings[0] == low.in_shardings[0]        # what the program returns
  out, _ = step(buf, np.zeros(8, np.float32))
  assert_named_sharding(out, m, P("model", None), "buffer")
  want = np.concatenate([buf[1:], np.zeros((1, 8), np.float32)])
  count = Counters(step, monkeypatch)
  for i in range(3):
    xi = np.full((8,), float(i), np.float32)
    out, total = step(out, xi)
    want, want_total = np.concatenate([want[1:], xi[None]]), want.sum()
    assert_named_sharding(out, m, P("model", None), "buffer")
  np.testing.assert_array_equal(np.asarray(out), want)
  np.testing.assert_allclose(float(total), float(want_total))
  assert count.compiles == 0 and count.puts == 0


def test_every_adam_leaf_keeps_its_layout():
  m = mesh(*M24)
  x, y = rand(32, 16, seed=2), rand(32, 8, seed=3)
  step = gshard.partition(_train_step, m, in_specs=SPECS)
  state = _train_state()
  out, _ = step(state, x, y)
  low = step.lower(state, x, y)
  n = len(jax.tree.leaves(state))
  assert low.out_shardings[:n] == low.in_shardings[:n]
  for k, (leaf, s) in enumerate(zip(jax.tree.leaves(out), low.in_shardings)):
    assert_named_sharding(leaf, m, s.to_spec(), f"state leaf {k}")


def test_an_annotated_return_value_keeps_its_annotation():
  m = mesh(*M24)
  fn = lambda w: gshard.split(w * 2.0, 1, "model")    # noqa: E731
  out = gshard.partition(fn, m, in_specs=(P("data"),))(rand(8, 16))
  assert_named_sharding(out, m, P(None, "model"))


def test_out_specs_override_the_state_layout():
  m = mesh(*M24)
  out, _ = gshard.partition(_push, m, in_specs=(P("model"), None),
                            out_specs=(P(None, "model"), P()))(rand(16, 8), rand(8))
  assert_named_sharding(out, m, P(None, "model"))


def test_pairing_rules():
  s = jax.ShapeDtypeStruct
  a, b = s((4, 2), jnp.float32), s((3,), jnp.int32)
  # same position first, then the first unused argument of the same structure
  assert pair_state((a, a), (a, a, b)) == {0: 0, 1: 1}
  assert pair_state((b, a), (a, b)) == {0: 1, 1: 0}
  # a pytree element pairs leaf by leaf
  assert pair_state(({"w": a, "c": b}, a), ({"w": a, "c": b}, s((), jnp.float32))) == \
      {0: 0, 1: 1}
  # a single (non-tuple) output; a NamedTuple output is one state
  assert pair_state((a,), a) == {0: 0}
  st = TrainState(b, a, a)
  assert pair_state((st, a), st) == {0: 0, 1: 1, 2: 2}
  # dtype and shape must match
  assert pair_state((a,), s((4, 2), jnp.bfloat16)) == {}
  assert pair_state((a,), (s((2, 4), jnp.float32),)) == {}


def test_inputs_committed_to_one_device_are_moved_onto_the_mesh():
  m = mesh(*M24)
  x = jax.device_put(rand(8, 16), jax.devices()[3])
  out = gshard.partition(lambda a: a * 2, m, in_specs=(P("data", "model"),))(x)
  np.testing.assert_array_equal(np.asarray(out), 2 * np.asarray(x))
  assert_named_sharding(out, m, P("data", "model"))


@pytest.mark.parametrize("order", ["same", "reversed"])
@pytest.mark.parametrize("placement", ["state on a sub-mesh", "data on a sub-mesh",
                                       "both on a sub-mesh", "the mesh's devices reversed"])
def test_state_and_data_committed_elsewhere_are_moved(placement, order):
  """A train step whose state and data arrive committed elsewhere, in any mix:
  a state input and a data input on a sub-mesh together (the state was laid
  out, the data left for jax to refuse), or on a mesh of the same devices in
  another order (a device set equal to the mesh's was taken as on it)."""
  devs = np.array(jax.devices())
  m = jax.sharding.Mesh((devs if order == "same" else devs[::-1]).reshape(2, 4),
                        ("data", "model"))
  sub = jax.sharding.Mesh(devs[4:], ("s",))
  rev = jax.sharding.Mesh(np.asarray(m.devices)[::-1, ::-1], ("data", "model"))
  w, x = rand(16, 8), rand(8, 16)
  on = {"state on a sub-mesh": (sub, None),
        "data on a sub-mesh": (None, sub), "both on a sub-mesh": (sub, sub),
        "the mesh's devices reversed": (rev, rev)}[placement]
  w_in, x_in = [a if where is None else jax.device_put(a, NamedSharding(where, P()))
                for a, where in zip((w, x), on)]
  step = gshard.partition(lambda w, x: (w - 0.1 * x.T @ (x @ w), jnp.sum(x @ w)), m,
                          in_specs=(P(None, "model"), P("data")))
  w2, loss = step(w_in, x_in)
  w3, _ = step(w2, x_in)
  want = jax.jit(lambda w, x: (w - 0.1 * x.T @ (x @ w), jnp.sum(x @ w)))(w, x)
  np.testing.assert_allclose(np.asarray(w2), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(float(loss), float(want[1]), rtol=1e-5)
  assert w3.shape == w.shape


@pytest.mark.parametrize("as_state", [False, True])
def test_inputs_committed_to_the_same_devices_in_another_mesh_shape(as_state):
  """Train on 2x4, evaluate on 4x2 over the same devices in the same order: a
  table split over (data, model) on the 2x4 mesh went straight into the 4x2
  program, and jax failed inside (IndivisibleError) mapping the outputs'
  layouts onto the input's mesh."""
  m24, m42 = mesh((2, 4), ("data", "model")), mesh((4, 2), ("data", "model"))
  table = jax.device_put(np.arange(1008 * 4, dtype=np.float32).reshape(1008, 4),
                         NamedSharding(m24, P(("data", "model"))))
  ids = (np.arange(8, dtype=np.int32) * 100).reshape(8, 1)

  def lookup(t, i):
    return (t * 2, t[i]) if as_state else t[i]
  step = gshard.partition(lookup, m42, in_specs=(P(("data", "model")), P("data")))
  for _ in range(2):
    got = step(table, ids)
    want = jax.jit(lookup)(table, ids)
    jax.tree.map(lambda g, w: np.testing.assert_array_equal(np.asarray(g), np.asarray(w)),
                 got, want)


@pytest.mark.parametrize("where", ["one device", "another mesh", "its devices reversed"])
def test_uneven_inputs_committed_elsewhere_are_padded_and_moved(where):
  """6 rows over 4 devices: padded where the input is, then moved onto the mesh
  (on the mesh's own devices in another order, jax refused the padding jit)."""
  m = mesh((4,), ("x",))
  x = rand(6, 3)
  devs = {"another mesh": jax.devices()[4:],
          "its devices reversed": list(np.asarray(m.devices).flat)[::-1]}
  x = (jax.device_put(x, jax.devices()[5]) if where == "one device" else
       jax.device_put(x, NamedSharding(jax.sharding.Mesh(np.array(devs[where]), ("y",)), P())))
  out = gshard.partition(lambda a: a * 2, m, in_specs=(P("x"),))(x)
  assert isinstance(out, gshard.PaddedArray)
  np.testing.assert_array_equal(np.asarray(gshard.unpad(out)), 2 * np.asarray(x))


# -- uneven state: the 1003-row table -------------------------------------------------------

VOCAB, DIM = 1003, 16
TABLE_OPT = optax.adam(0.05)


def _lookup_loss(table, tokens):
  return jnp.mean(jnp.tanh(table[tokens]) ** 2)


def _table_step(table, opt_state, tokens):
  loss, g = jax.value_and_grad(_lookup_loss)(table, tokens)
  updates, opt_state = TABLE_OPT.update(g, opt_state)
  return optax.apply_updates(table, updates), opt_state, loss


def _table_args():
  table = rand(VOCAB, DIM)
  tokens = np.random.default_rng(5).integers(0, VOCAB, (8, 12)).astype(np.int32)
  tokens[0, :4] = [0, 250, 251, VOCAB - 1]          # block edges and the last row
  return table, TABLE_OPT.init(table), tokens


def test_uneven_table_stays_split_between_steps(monkeypatch):
  m = mesh(*M24)
  table, opt_state, tokens = _table_args()
  step = gshard.partition(_table_step, m, in_specs=(P("model"), None, P("data")),
                          out_specs=(P("model"), None, P()))
  ref = jax.jit(_table_step)
  count = Counters(step, monkeypatch)
  got = step(table, opt_state, tokens)
  # the first call pads the plain table and Adam's moments (one small program
  # of their own, shared) and compiles the step once: the one later calls run
  assert count.compiles == 2, count.compiles
  want = ref(table, opt_state, tokens)
  for i in range(3):
    count = Counters(step, monkeypatch)
    got = step(got[0], got[1], tokens)
    want = ref(want[0], want[1], tokens)
    assert (count.traces, count.compiles, count.puts) == (0, 0, 0), i
  new_table = got[0]
  assert isinstance(new_table, gshard.PaddedArray)
  assert new_table.shape == (VOCAB, DIM) and new_table.dtype == np.float32
  assert new_table.data.shape == (1004, DIM)
  assert_named_sharding(new_table.data, m, P("model", None), "table data")
  rows = -(-VOCAB // 4)
  per_device = {s.device.id: s.data.nbytes for s in new_table.data.addressable_shards}
  assert set(per_device.values()) == {rows * DIM * 4}        # 251 rows on every device
  mu = got[1][0].mu                                           # Adam's moments too
  assert isinstance(mu, gshard.PaddedArray) and mu.data.shape == (1004, DIM)
  # the logical values: np.asarray, .logical(), gshard.unpad
  np.testing.assert_allclose(np.asarray(new_table), np.asarray(want[0]), rtol=2e-5,
                             atol=2e-6)
  assert new_table.logical().shape == (VOCAB, DIM)
  assert_trees_close(got, want, rtol=2e-5, atol=2e-6)
  assert gshard.unpad(got)[0].shape == (VOCAB, DIM)


def test_uneven_state_lowers_as_the_steady_state_runs():
  """lower() of the plain table lowers the program that takes it padded: the
  per-device program's table is 251 rows and no pad runs at the boundary."""
  m = mesh(*M24)
  table, opt_state, tokens = _table_args()
  step = gshard.partition(_table_step, m, in_specs=(P("model"), None, P("data")),
                          out_specs=(P("model"), None, P()))
  low = step.lower(table, opt_state, tokens)
  assert low.per_device_jaxpr().invars[0].aval.shape == (251, DIM)
  hlo = low.as_text()
  assert "tensor<1004x16xf32>" in hlo.split("func.func public @main")[1].split("{")[0]
  out = step(table, opt_state, tokens)
  low2 = step.lower(*out[:2], tokens)
  assert low2.as_text() == hlo


def test_padded_state_checkpoints_with_orbax(tmp_path):
  """orbax saves the padded data leaf; restoring into the abstract state
  (which holds the PaddedArray nodes) gives PaddedArrays laid out as saved."""
  m = mesh(*M24)
  table, opt_state, tokens = _table_args()
  step = gshard.partition(_table_step, m, in_specs=(P("model"), None, P("data")),
                          out_specs=(P("model"), None, P()))
  state = step(table, opt_state, tokens)[:2]
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "state", state)
  ckpt.wait_until_finished()
  restored = ckpt.restore(tmp_path / "state",
                          jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
  assert isinstance(restored[0], gshard.PaddedArray) and restored[0].shape == (VOCAB, DIM)
  assert restored[0].data.sharding == state[0].data.sharding
  assert_trees_close(restored, gshard.unpad(state), rtol=0, atol=0)
  a = step(*restored, tokens)
  b = step(*state, tokens)
  assert_trees_close(a, gshard.unpad(b), rtol=0, atol=0)


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_OUTER = {
    "jit": lambda ps, w, x: jax.jit(ps)(w, x),
    "scan": lambda ps, w, x: jax.lax.scan(lambda c, _: (ps(c, x)[0], None), w, None,
                                          length=2)[0],
    "grad": lambda ps, w, x: jax.grad(lambda w: ps(w, x)[1])(w),
    "eval_shape": lambda ps, w, x: jax.eval_shape(ps, w, x),
    # an ensemble: state with a batch dim in front
    "vmap": lambda ps, w, x: jax.vmap(ps, in_axes=(0, None))(jnp.stack([w, -w]), x),
}


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(sorted(_OUTER)), st.sampled_from([8, 10]),
       st.sampled_from([P(None, "model"), P("model"), P("data", "model"), P()]))
def test_a_step_with_state_composes_with_jax_transformations(outer, rows, spec):
  """A partitioned step whose output is the next value of an input, called
  under jax.jit / scan / grad / eval_shape: as the plain step is. Placing the
  state (even or padded) read a tracer's ``committed``: jax's
  ConcretizationTypeError."""
  _compose(outer, rows, spec)


@pytest.mark.parametrize("outer,rows,spec", [("scan", 10, P("model")),
                                             ("vmap", 8, P(None, "model")),
                                             ("vmap", 8, P("model"))])
def test_a_step_in_a_scan_or_vmap(outer, rows, spec):
  """Found by a review of client code: in a scan, a step whose uneven state
  entered as a plain array returned a PaddedArray (jax: the carry changed
  type); under vmap, state not yet on the mesh was placed with the unbatched
  spec on the batched value (jax's IndivisibleError, one dim off)."""
  _compose(outer, rows, spec)


def _compose(outer, rows, spec):
  rng = np.random.default_rng(rows)
  w = rng.standard_normal((rows, 8)).astype(np.float32)
  x = rng.standard_normal((16, rows)).astype(np.float32)

  def step(w, x):
    return w - 0.1 * jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w), jnp.sum(w * w)

  ps = gshard.partition(step, mesh(*M24), in_specs=(spec, P("data")))
  got = jax.tree.map(lambda a: gshard.unpad(a) if isinstance(a, gshard.PaddedArray) else a,
                     _OUTER[outer](ps, w, x), is_leaf=lambda a: isinstance(a, gshard.PaddedArray))
  want = _OUTER[outer](step, w, x)
  if outer == "eval_shape":
    assert jax.tree.map(lambda a: (a.shape, a.dtype), got) == jax.tree.map(
        lambda a: (a.shape, a.dtype), want)
  else:
    assert_trees_close(got, want)
