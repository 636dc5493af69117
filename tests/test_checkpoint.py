"""Checkpoints of partitioned train state (gshard.checkpoint over orbax-checkpoint).

In this process (8 devices): a GPT train state with an uneven vocabulary
(50 over model=4) saves and restores bit for bit, laid out as the step wants
it (``abstract_args``), also onto other mesh shapes; padded values (a pytree
node whose child ``.data`` is the padded array, as ``gshard.PaddedArray``)
restore re-padded for the target mesh; mismatches fail with errors that name
the leaf. Across processes: examples/checkpoint_resume.py trains on 2 processes,
has process 1 killed while a checkpoint is being written, resumes from the
latest finished one and must match training straight through bit for bit; its
2-process checkpoint restores in this 1-process run.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gshard
from gshard.spmd.partition.padded import pad_to
from helpers_launch import ROOT, cache_dir, env_with_cache

sys.path.insert(0, ROOT)
from examples import checkpoint_resume, models  # noqa: E402

VOCAB = 50


def _cfg(**kw):
  cfg = checkpoint_resume.parse(["--steps", "8", "--save-every", "3", "--kill-at", "6",
                                 "--layers", "1", "--vocab", str(VOCAB)])
  for k, v in kw.items():
    setattr(cfg, k, v)
  return cfg


def _train(cfg, mesh, step, state, steps):
  """``steps`` steps from ``state`` (batches 0..steps-1)."""
  params, opt_state = state
  for i in range(steps):
    tokens, targets = checkpoint_resume.global_batch(cfg, i)
    params, opt_state, _ = step(params, opt_state, tokens, targets)
  return params, opt_state


def _logical(tree) -> list[np.ndarray]:
  """The leaves' logical values on the host (a padded value: its logical rows)."""
  padded = gshard.checkpoint.is_padded
  return [np.asarray(x.data)[tuple(slice(0, n) for n in x.shape)] if padded(x)
          else np.asarray(x) for x in jax.tree.leaves(tree, is_leaf=padded)]


def _assert_bitwise(got, want, what=""):
  g, w = _logical(got), _logical(want)
  assert len(g) == len(w) > 0, what
  for i, (a, b) in enumerate(zip(g, w)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{what} leaf {i}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A (2, 4) GPT train state after 2 steps, saved to a directory."""
  cfg = _cfg()
  mesh, step, params, opt_state = checkpoint_resume.build(cfg)
  state = _train(cfg, mesh, step, (params, opt_state), 2)
  path = tmp_path_factory.mktemp("ckpt") / "state"
  gshard.checkpoint.save(path, state)
  return cfg, step, (params, opt_state), state, path


def test_restore_lays_state_out_as_the_step_wants(trained):
  cfg, step, init, state, path = trained
  batch = checkpoint_resume.global_batch(cfg, 0)
  target = gshard.checkpoint.abstract_args(step, *init, *batch)
  assert len(target) == 4 and target[0]["embed"].shape == (VOCAB, 32)
  restored = gshard.checkpoint.restore(path, target[:2])
  _assert_bitwise(restored, state, "restored")
  # every restored leaf has its target's layout; a plain target is the layout
  # the step places that argument with (a padded one, the layout inside)
  padded = gshard.checkpoint.is_padded
  prog = step.program(*init, *batch)
  flat_target = jax.tree.leaves(target, is_leaf=padded)
  flat = jax.tree.leaves(restored, is_leaf=padded)
  assert len(flat) == len(jax.tree.leaves(state, is_leaf=padded))
  for i, (x, t) in enumerate(zip(flat, flat_target)):
    assert padded(x) == padded(t), i
    got, want = (x.data.sharding, t.data.sharding) if padded(t) else (x.sharding, t.sharding)
    assert got == want, (i, got, want)
  for i, t in enumerate(flat_target):
    if not padded(t):
      want = NamedSharding(step.mesh, prog.in_place[i].to_spec())
      assert t.sharding.is_equivalent_to(want, len(t.shape)), (i, t.sharding, want)
  # the wq heads are split over model=4 as in_specs say
  wq = restored[0]["layers"][0]["wq"]
  assert wq.sharding.spec == P(None, "model", None)
  # training on from the restored state is training on from the saved state
  tokens, targets = checkpoint_resume.global_batch(cfg, 2)
  _assert_bitwise(step(*restored, tokens, targets), step(*state, tokens, targets), "step 3")


@pytest.mark.parametrize("mesh_shape", [(4, 2), (1, 8), (8, 1)])
def test_restore_onto_another_mesh_shape(trained, mesh_shape):
  cfg, _, init, state, path = trained
  mesh, step, _, _ = checkpoint_resume.build(cfg, mesh_shape)
  target = gshard.checkpoint.abstract_args(step, *init, *checkpoint_resume.global_batch(cfg, 0))
  restored = gshard.checkpoint.restore(path, target[:2])
  _assert_bitwise(restored, state, f"restored onto {mesh_shape}")
  for x, t in zip(jax.tree.leaves(restored), jax.tree.leaves(target[:2])):
    assert x.sharding == t.sharding
    assert x.sharding.mesh.shape == dict(zip(("data", "model"), mesh_shape))
  if mesh_shape == (4, 2):     # (one compilation is enough to show the step takes it)
    tokens, targets = checkpoint_resume.global_batch(cfg, 2)
    padded = gshard.checkpoint.is_padded
    placed = jax.tree.unflatten(
        jax.tree.structure(state, is_leaf=padded),
        [jax.device_put(x, NamedSharding(mesh, P())) for x in _logical(state)])
    _assert_bitwise(step(*restored, tokens, targets), step(*placed, tokens, targets),
                    f"a step on {mesh_shape}")


# -- padded values ------------------------------------------------------------------------

@jax.tree_util.register_pytree_node_class
class Padded:
  """The protocol of gshard.PaddedArray: child ``.data`` (the padded array), static
  ``.shape`` (the logical shape)."""

  def __init__(self, data, shape):
    self.data, self.shape = data, tuple(shape)

  @property
  def dtype(self):
    return self.data.dtype

  def tree_flatten(self):
    return (self.data,), self.shape

  @classmethod
  def tree_unflatten(cls, shape, children):
    return cls(children[0], shape)


def _padded(table, mesh, rows):
  data = np.zeros((rows, table.shape[1]), table.dtype)
  data[:table.shape[0]] = table
  return Padded(jax.device_put(data, NamedSharding(mesh, P("model"))), table.shape)


def _table_step(mesh):
  """SGD on an embedding table split on its (uneven) vocabulary."""
  def loss(table, tokens):
    return jnp.mean(jnp.tanh(table[gshard.split(tokens, 0, "data")]) ** 2)

  def sgd(table, tokens):
    return table - 0.1 * jax.grad(loss)(table, tokens)
  return gshard.partition(sgd, mesh, in_specs=(P("model"), P("data")))


def test_padded_values_restore_padded_for_the_target_mesh(tmp_path):
  rng = np.random.default_rng(0)
  table = rng.standard_normal((VOCAB, 16)).astype(np.float32)
  bias = rng.standard_normal((16,)).astype(np.float32)
  m24 = gshard.make_mesh((2, 4), ("data", "model"))
  state = {"table": _padded(table, m24, 52), "bias": jax.device_put(bias)}
  assert gshard.checkpoint.is_padded(state["table"])
  assert not gshard.checkpoint.is_padded(state["bias"])
  gshard.checkpoint.save(tmp_path / "c", state)
  tokens = rng.integers(0, VOCAB, (8, 4)).astype(np.int32)

  # model=8 pads 50 to 56: the target from abstract_args is padded
  m18 = gshard.make_mesh((1, 8), ("data", "model"))
  target = gshard.checkpoint.abstract_args(_table_step(m18), state["table"], tokens)[0]
  assert isinstance(target, Padded) and target.shape == (VOCAB, 16)
  assert target.data.shape == (56, 16) and target.data.sharding.spec == P("model", None)
  bias_target = jax.ShapeDtypeStruct((16,), jnp.float32, sharding=NamedSharding(m18, P()))
  got = gshard.checkpoint.restore(tmp_path / "c", {"table": target, "bias": bias_target})
  assert isinstance(got["table"], Padded) and got["table"].shape == (VOCAB, 16)
  data = np.asarray(got["table"].data)
  assert data.shape == (56, 16)
  np.testing.assert_array_equal(data[:VOCAB], table)
  np.testing.assert_array_equal(data[VOCAB:], 0)
  assert got["table"].data.sharding.spec == P("model", None)
  np.testing.assert_array_equal(np.asarray(got["bias"]), bias)

  # model=2 splits 50 evenly: a plain target gets exactly the logical rows
  m42 = gshard.make_mesh((4, 2), ("data", "model"))
  plain = gshard.checkpoint.abstract_args(_table_step(m42), state["table"], tokens)[0]
  assert isinstance(plain, jax.ShapeDtypeStruct) and plain.shape == (VOCAB, 16)
  got = gshard.checkpoint.restore(tmp_path / "c", {"table": plain, "bias": bias_target})
  np.testing.assert_array_equal(np.asarray(got["table"]), table)
  assert got["table"].sharding.spec == P("model", None)

  # and the logical table saved plainly restores padded
  gshard.checkpoint.save(tmp_path / "plain", {"table": jax.device_put(table),
                                              "bias": jax.device_put(bias)})
  got = gshard.checkpoint.restore(tmp_path / "plain", {"table": target, "bias": bias_target})
  np.testing.assert_array_equal(np.asarray(got["table"].data)[:VOCAB], table)


# -- errors ---------------------------------------------------------------------------------

def test_restore_errors_name_the_leaf_and_the_fix(trained, tmp_path):
  cfg, step, init, state, path = trained
  target = list(gshard.checkpoint.abstract_args(
      step, *init, *checkpoint_resume.global_batch(cfg, 0))[:2])

  wrong = jax.tree.map(lambda x: x, target)
  e = wrong[0]["embed"]
  wrong[0]["embed"] = jax.ShapeDtypeStruct((52, 32), e.dtype, sharding=e.sharding)
  with pytest.raises(ValueError, match=r"leaf 0\.embed: .* holds shape \[50, 32\], the "
                                       r"target wants \[52, 32\]"):
    gshard.checkpoint.restore(path, tuple(wrong))

  wrong = jax.tree.map(lambda x: x, target)
  wrong[0]["extra"] = wrong[0]["ln_f"]
  with pytest.raises(ValueError, match=r"in the target, not in the checkpoint: 0\.extra"):
    gshard.checkpoint.restore(path, tuple(wrong))
  with pytest.raises(ValueError, match=r"in the checkpoint, not in the target: 1\."):
    gshard.checkpoint.restore(path, (target[0],))

  wrong = jax.tree.map(lambda x: x, target)
  ln = wrong[0]["ln_f"]
  wrong[0]["ln_f"] = jax.ShapeDtypeStruct(ln.shape, jnp.bfloat16, sharding=ln.sharding)
  with pytest.raises(ValueError, match=r"leaf 0\.ln_f: the checkpoint holds float32, the "
                                       r"target wants bfloat16"):
    gshard.checkpoint.restore(path, tuple(wrong))

  wrong = jax.tree.map(lambda x: x, target)
  wrong[0]["embed"] = jax.ShapeDtypeStruct(e.shape, e.dtype,
                                           sharding=NamedSharding(step.mesh, P("model")))
  with pytest.raises(ValueError, match=r"leaf 0\.embed: the mesh .* cannot hold shape "
                                       r"\[50, 32\] as .*dim 0 of 50 does not split 4 ways"):
    gshard.checkpoint.restore(path, tuple(wrong))

  with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
    gshard.checkpoint.restore(tmp_path / "missing", tuple(target))
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(tmp_path / "orbax", {"a": np.zeros(3, np.float32)})
  with pytest.raises(ValueError, match="not written by gshard.checkpoint.save"):
    gshard.checkpoint.restore(tmp_path / "orbax", {"a": jax.ShapeDtypeStruct((3,), jnp.float32)})
  with ocp.CheckpointManager(tmp_path / "mngr") as mngr:
    with pytest.raises(FileNotFoundError, match="no finished checkpoint"):
      gshard.checkpoint.restore(mngr, tuple(target))
    with pytest.raises(ValueError, match="pass step="):
      gshard.checkpoint.save(mngr, state)



@pytest.mark.parametrize("scalar_target", [False, True])
def test_state_with_python_scalars_restores(tmp_path, scalar_target):
  """A state as first passed to a step, ``(w, 0, 0.1)``: saved, it restores
  onto ``abstract_args``'s int32/float32 targets (the record said int64 and
  float64, NumPy's, and restore refused), or onto Python scalars as target
  leaves (an AttributeError)."""
  mesh = gshard.make_mesh((8,), ("d",))

  def train(w, count, lr, x):
    return w - lr * (x @ w).sum(0), count + 1, lr

  step = gshard.partition(train, mesh, in_specs=(P(None, "d"), None, None, P("d")))
  w, x = jnp.arange(32.0).reshape(4, 8), jnp.ones((8, 4))
  state = (w, 0, 0.1)
  gshard.checkpoint.save(tmp_path / "c", state)
  target = (gshard.checkpoint.abstract_args(step, *state, x)[:3] if not scalar_target
            else (jax.ShapeDtypeStruct((4, 8), jnp.float32,
                                       sharding=NamedSharding(mesh, P(None, "d"))), 7, 1.5))
  got = gshard.checkpoint.restore(tmp_path / "c", target)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(w))
  assert [np.asarray(v).dtype for v in got[1:]] == [np.int32, np.float32]
  assert int(got[1]) == 0 and float(got[2]) == np.float32(0.1)
  step(*got, x)          # it runs


def test_a_restored_python_counter_is_weakly_typed_and_needs_no_new_trace(tmp_path):
  """``TrainState.step`` starts as a Python ``0``: a weak int32 in the trace.
  orbax restores it strong, and the resumed step traced anew (a second compile
  of the whole program)."""
  mesh = gshard.make_mesh((8,), ("d",))
  traces = []

  def train(w, count, lr, x):
    traces.append(1)
    return w - lr * (x @ w).sum(0), count + 1, lr

  step = gshard.partition(train, mesh, in_specs=(P(None, "d"), None, None, P("d")))
  w, x = jnp.arange(32.0).reshape(4, 8), jnp.ones((8, 4))
  state = step(w, 0, 0.1, x)
  assert [jax.typeof(v).weak_type for v in state[1:]] == [True, True]
  gshard.checkpoint.save(tmp_path / "c", state)
  target = gshard.checkpoint.abstract_args(step, w, 0, 0.1, x)[:3]
  assert [t.weak_type for t in target] == [False, True, True]
  got = gshard.checkpoint.restore(tmp_path / "c", target)
  assert [jax.typeof(v).weak_type for v in got] == [False, True, True]
  assert [v.sharding for v in got[1:]] == [t.sharding for t in target[1:]]
  n = len(traces)
  again = step(*got, x)
  assert len(traces) == n
  np.testing.assert_array_equal(np.asarray(again[0]), np.asarray(step(*state, x)[0]))


def test_leaves_whose_dotted_names_collide_are_an_error(tmp_path):
  """``{'a.b': x, 'a': {'b': y}}``: both leaves are 'a.b' in the checkpoint's
  names; one came back as the other, silently."""
  x = jnp.ones(4)
  with pytest.raises(ValueError, match=r"\['a'\]\['b'\] and \['a\.b'\] are both named 'a\.b'"):
    gshard.checkpoint.save(tmp_path / "c", {"a.b": x, "a": {"b": 2 * x}})

def test_manager_save_and_restore_steps(trained, tmp_path):
  cfg, step, init, state, _ = trained
  target = gshard.checkpoint.abstract_args(
      step, *init, *checkpoint_resume.global_batch(cfg, 0))[:2]
  zeros = jax.tree.map(jnp.zeros_like, state)
  with ocp.CheckpointManager(tmp_path / "m") as mngr:
    assert gshard.checkpoint.save(mngr, zeros, step=1)
    assert gshard.checkpoint.save(mngr, state, step=2, wait=True)
    assert list(mngr.all_steps()) == [1, 2]
    _assert_bitwise(gshard.checkpoint.restore(mngr, target), state, "latest")
    _assert_bitwise(gshard.checkpoint.restore(mngr, target, step=1), zeros, "step 1")


# -- kill, resume, and restore in another process count ----------------------------------------

@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
  cfg = _cfg(dir=str(tmp_path_factory.mktemp("resume")), heartbeat=5)
  env = env_with_cache(cache_dir(tmp_path_factory))
  saved = dict(os.environ)
  os.environ.update(env)              # the launches' children read it; jax here is set up
  try:
    res = checkpoint_resume.run(cfg, quiet=True)
  finally:
    os.environ.clear()
    os.environ.update(saved)
  return cfg, res


def test_kill_and_resume_equals_straight_through(resumed):
  cfg, res = resumed
  assert res["killed_rc"] == 128 + 9, res          # process 1's SIGKILL
  assert res["start"] in (3, 6), res               # a finished checkpoint
  assert sorted(res["straight"]) == list(range(cfg.steps))
  assert sorted(res["killed"]) == list(range(cfg.kill_at)), res["killed"]
  assert sorted(res["resumed"]) == list(range(res["start"], cfg.steps))
  for name in ("killed", "resumed"):
    for i, loss in res[name].items():
      assert loss == res["straight"][i], (name, i, loss, res["straight"][i])
  assert res["straight"][cfg.steps - 1] < res["straight"][0]
  assert res["same_state"] and res["n_leaves"] > 10


def test_two_process_checkpoint_restores_in_one_process(resumed):
  cfg, _ = resumed
  final = np.load(os.path.join(cfg.dir, "final.npz"))
  mesh, step, params, opt_state = checkpoint_resume.build(cfg, (4, 2))
  target = gshard.checkpoint.abstract_args(step, params, opt_state,
                                           *checkpoint_resume.global_batch(cfg, 0))[:2]
  with ocp.CheckpointManager(os.path.join(cfg.dir, "ckpt")) as mngr:
    assert mngr.latest_step() == cfg.steps
    restored = gshard.checkpoint.restore(mngr, target)
  leaves = jax.tree.leaves(restored)
  assert len(leaves) == sum(k.startswith("resumed_") for k in final.files)
  for i, x in enumerate(leaves):
    assert x.sharding.mesh.shape == {"data": 4, "model": 2}
    np.testing.assert_array_equal(np.asarray(x), final[f"resumed_{i}"], err_msg=f"leaf {i}")


def test_example_refuses_a_kill_step_that_does_not_save():
  with pytest.raises(SystemExit):
    checkpoint_resume.parse(["--kill-at", "5", "--save-every", "4"])
  assert isinstance(checkpoint_resume.parse([]), argparse.Namespace)


def test_typed_keys_and_64_bit_leaves_keep_their_dtypes(tmp_path):
  """A typed PRNG key saves and restores; an int64 leaf saved under x64 is
  refused by an int32 target (restoring it would cut 2**40 to 0), not cast."""
  key = jax.random.key(3)
  gshard.checkpoint.save(tmp_path / "k", {"key": key})
  got = gshard.checkpoint.restore(tmp_path / "k", {"key": jax.ShapeDtypeStruct((), key.dtype)})
  assert np.array_equal(jax.random.key_data(got["key"]), jax.random.key_data(key))
  with jax.enable_x64(True):
    gshard.checkpoint.save(tmp_path / "w", {"w": jnp.full(2, 2**40, jnp.int64)})
  with pytest.raises(ValueError, match="holds int64, the target wants int32"):
    gshard.checkpoint.restore(tmp_path / "w", {"w": jax.ShapeDtypeStruct((2,), jnp.int32)})


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_split_keys_restore_re_padded_for_the_target_mesh(tmp_path, impl):
  """Six keys split over model: held as 8 (padded) for model=4, as 6 for
  model=2. Saved padded (a checkpoint of padded keys) or plain, they restore
  onto either target with the keys saved, bit for bit (orbax pads and
  truncates arrays, not typed keys: a padded save came back with its 2
  padding keys, a plain one failed inside orbax; found by a review of
  checkpoints). A step keeps no keys padded between steps (jax.random reads
  only key arrays), so both targets are key arrays."""
  def step(keys):
    return jax.vmap(lambda k: jax.random.split(k)[0])(keys)

  keys = jax.random.split(jax.random.key(1, impl=impl), 6)
  meshes = {shape: gshard.make_mesh(shape, ("data", "model")) for shape in ((2, 4), (4, 2))}
  steps = {shape: gshard.partition(step, m, in_specs=(P("model"),))
           for shape, m in meshes.items()}
  padded = pad_to(keys, (8,), NamedSharding(meshes[(2, 4)], P("model")))
  saved = {"padded": padded, "plain": keys}
  for name, state in saved.items():
    want = np.asarray(jax.random.key_data(gshard.unpad(state)))
    gshard.checkpoint.save(tmp_path / name, {"k": state})
    for shape, s in steps.items():
      target = gshard.checkpoint.abstract_args(s, keys)[0]
      got = gshard.checkpoint.restore(tmp_path / name, {"k": target})["k"]
      assert got.shape == (6,) and got.dtype == keys.dtype
      assert not gshard.checkpoint.is_padded(got)
      np.testing.assert_array_equal(np.asarray(jax.random.key_data(gshard.unpad(got))), want)
      np.testing.assert_array_equal(
          np.asarray(jax.random.key_data(gshard.unpad(s(got)))),
          np.asarray(jax.random.key_data(jax.jit(step)(gshard.unpad(state)))))


def test_a_non_array_leaf_is_named(tmp_path):
  """A string in the saved state: gshard's error names its path (it was
  jax's "not a valid JAX type" from inside save, naming no leaf)."""
  state = {"params": {"w": jnp.ones(4)}, "config": {"name": "gpt-small"}}
  with pytest.raises(TypeError, match=r"leaf config\.name is a str \('gpt-small'\)"):
    gshard.checkpoint.save(tmp_path / "c", state)
  assert not (tmp_path / "c").exists()
