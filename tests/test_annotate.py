"""Annotations (gshard/annotate): identities outside gshard, kept by every jax
transformation, and validated at call time with messages that say how to fix."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import gshard
from gshard import TensorSharding
from gshard.annotate import Annotation, annotate_p
from gshard.spmd.graph import sub_jaxprs

MESH = AbstractMesh((2, 4), ("data", "model"))
X = jnp.arange(32.0).reshape(4, 8)


def annotations(jaxpr):
  """Every annotation equation's params, nested jaxprs included, in order."""
  found = []

  def walk(j):
    for e in j.eqns:
      if e.primitive is annotate_p:
        found.append(e.params["annotation"])
      for sub in _subs(e):
        walk(sub)

  walk(jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr)
  return found


def _subs(eqn):
  return [j for _, j in sub_jaxprs(eqn.params)]


def shardings(jaxpr):
  return [str(a.sharding) for a in annotations(jaxpr)]


# -- identities outside gshard ------------------------------------------------

ANNOTATE = [
    lambda x: gshard.split(x, 0, "data"),
    lambda x: gshard.split(x, -1, ("data", "model")),
    lambda x: gshard.replicate(x),
    lambda x: gshard.shard(x, P("data", "model")),
    lambda x: gshard.shard(x, P(None, P.UNCONSTRAINED)),
    lambda x: gshard.shard(x, P()),
    lambda x: gshard.shard(x, None),
]


@pytest.mark.parametrize("annotate", ANNOTATE)
def test_identity_eager_and_jit(annotate):
  for x in (X, X.astype(jnp.int32), X.astype(jnp.bfloat16)):
    y = annotate(x)
    assert y.dtype == x.dtype and y.shape == x.shape
    np.testing.assert_array_equal(y, x)
    z = jax.jit(annotate)(x)
    assert z.dtype == x.dtype
    np.testing.assert_array_equal(z, x)


def test_identity_numpy_and_scalars():
  y = gshard.split(np.ones((4, 2), np.float32), 0, "data")
  assert isinstance(y, (jax.Array, np.ndarray)) and y.dtype == np.float32
  np.testing.assert_array_equal(y, np.ones((4, 2)))
  assert float(gshard.replicate(3.0)) == 3.0
  assert gshard.replicate(jnp.float32(2)).shape == ()


def test_model_runs_unchanged_on_one_device():
  from examples import models
  params = models.mlp_init(jax.random.key(0), d_model=8, d_hidden=16)
  x, y = jnp.ones((4, 8)), jnp.zeros((4, 8))

  def plain(params, x, y):
    h = jax.nn.gelu(x @ params["w1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)

  np.testing.assert_allclose(models.mlp_loss(params, x, y), plain(params, x, y))
  g1 = jax.grad(models.mlp_loss)(params, x, y)
  g2 = jax.grad(plain)(params, x, y)
  jax.tree.map(np.testing.assert_allclose, g1, g2)


def test_lowering_is_identity():
  text = jax.jit(lambda x: gshard.shard(x, P("data"))).lower(X).as_text()
  assert "return %arg0" in text
  assert "sharding" not in text.split("func.func")[1]


def test_annotation_params():
  (a,) = annotations(jax.make_jaxpr(lambda x: gshard.split(x, -1, ("data", "model")))(X))
  assert a == Annotation(TensorSharding(((), ("data", "model"))))
  assert str(a) == "[_,data*model]"
  (a,) = annotations(jax.make_jaxpr(lambda x: gshard.replicate(x))(X))
  assert a.sharding == TensorSharding.replicated(2) and a.open_dims == frozenset()
  (a,) = annotations(jax.make_jaxpr(lambda x: gshard.shard(x, P("model")))(X))
  assert str(a) == "[model,_]"   # missing trailing entries are unsplit


# -- transformations keep the annotation --------------------------------------

def _loss(x):
  return jnp.sum(jnp.sin(gshard.split(x, 1, "model")) * 2)


def test_value_and_grad_annotates_backward_pass():
  jaxpr = jax.make_jaxpr(jax.value_and_grad(_loss))(X)
  # once on the forward value, once on its cotangent
  assert shardings(jaxpr) == ["[_,model]", "[_,model]"]
  eqns = jaxpr.jaxpr.eqns
  fwd = [i for i, e in enumerate(eqns) if e.primitive is annotate_p]
  assert fwd[0] == 0                                   # first op of the forward pass
  assert eqns[-1].primitive is annotate_p              # last op of the backward pass
  assert eqns[-1].outvars[0] is jaxpr.jaxpr.outvars[1]  # ... producing the gradient
  v, g = jax.value_and_grad(_loss)(X)
  np.testing.assert_allclose(g, 2 * jnp.cos(X), rtol=1e-6)


def test_jvp_annotates_tangent():
  jaxpr = jax.make_jaxpr(
      lambda x, t: jax.jvp(lambda x: gshard.split(x, 0, "data") * 2, (x,), (t,)))(X, X)
  assert shardings(jaxpr) == ["[data,_]", "[data,_]"]


def test_linear_transpose():
  jaxpr = jax.make_jaxpr(jax.linear_transpose(lambda x: gshard.split(x, 0, "data"), X))(X)
  assert shardings(jaxpr) == ["[data,_]"]


def test_grad_with_unused_annotated_value():
  # The annotated value reaches only the aux output: its cotangent is zero.
  def f(x):
    y = gshard.split(x, 0, "data")
    return jnp.sum(x), gshard.replicate(y)
  g, aux = jax.grad(f, has_aux=True)(X)
  np.testing.assert_array_equal(g, jnp.ones_like(X))
  np.testing.assert_array_equal(aux, X)


@pytest.mark.parametrize("in_axes, spec, expected", [
    (0, P("data", None), "[_,data,_]"),
    (1, P("data", None), "[data,_,_]"),
    (2, P("data", None), "[data,_,_]"),
    (-1, P(None, "model"), "[_,model,_]"),
    (0, P(("data", "model")), "[_,data*model,_]"),
])
def test_vmap_inserts_unsplit_dim(in_axes, spec, expected):
  x = jnp.ones((4, 8, 2))
  jaxpr = jax.make_jaxpr(jax.vmap(lambda v: gshard.shard(v, spec), in_axes=in_axes))(x)
  (a,) = annotations(jaxpr)
  assert str(a.sharding) == expected
  assert a.sharding.rank == 3
  np.testing.assert_array_equal(
      jax.vmap(lambda v: gshard.shard(v, spec), in_axes=in_axes, out_axes=in_axes)(x), x)


def test_vmap_shifts_open_dims():
  x = jnp.ones((3, 4, 8))
  jaxpr = jax.make_jaxpr(jax.vmap(lambda v: gshard.shard(v, P("data", P.UNCONSTRAINED))))(x)
  (a,) = annotations(jaxpr)
  assert a.sharding.dims == ((), ("data",), ())
  assert a.open_dims == frozenset({2})
  assert str(a) == "[_,data,?]"


def test_nested_vmap_and_grad_of_vmap():
  x = jnp.ones((2, 3, 8))
  jaxpr = jax.make_jaxpr(jax.vmap(jax.vmap(lambda v: gshard.split(v, 0, "model"))))(x)
  assert shardings(jaxpr) == ["[_,_,model]"]
  f = lambda x: jnp.sum(jax.vmap(lambda v: gshard.split(v, 0, "model"))(x) ** 2)
  jaxpr = jax.make_jaxpr(jax.grad(f))(x[0])
  assert shardings(jaxpr) == ["[_,model]", "[_,model]"]


def test_vmap_of_grad():
  jaxpr = jax.make_jaxpr(jax.vmap(jax.grad(_loss)))(jnp.ones((3, 4, 8)))
  assert shardings(jaxpr) == ["[_,_,model]", "[_,_,model]"]


def test_hessian():
  jaxpr = jax.make_jaxpr(jax.hessian(lambda x: jnp.sum(gshard.split(x, 0, "data") ** 3)))(
      jnp.ones(4))
  got = shardings(jaxpr)
  assert got[0] == "[data]" and len(got) >= 3
  assert all(s.count("data") == 1 for s in got)


def test_scan_keeps_annotation_in_body():
  def body(c, x):
    return c + gshard.split(x, 0, "model"), c

  f = lambda c, xs: lax.scan(body, c, xs)
  c, xs = jnp.ones(8), jnp.ones((3, 8))
  jaxpr = jax.make_jaxpr(f)(c, xs)
  (scan,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
  assert [e.primitive for e in scan.params["jaxpr"].jaxpr.eqns].count(annotate_p) == 1
  assert shardings(jaxpr) == ["[model]"]
  # grad of a scan: forward and backward scans both annotated.
  jaxpr = jax.make_jaxpr(jax.grad(lambda c, xs: jnp.sum(f(c, xs)[0]), argnums=1))(c, xs)
  assert shardings(jaxpr).count("[model]") >= 2
  np.testing.assert_array_equal(f(c, xs)[0], c + 3)


def test_checkpoint_keeps_annotation():
  f = jax.checkpoint(_loss)
  jaxpr = jax.make_jaxpr(jax.value_and_grad(f))(X)
  got = shardings(jaxpr)
  assert got.count("[_,model]") >= 2          # forward (and recomputed) + cotangent
  assert set(got) == {"[_,model]"}
  remat = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("checkpoint", "remat2")]
  assert remat, "jax.checkpoint should leave a remat equation"
  assert annotate_p in [e.primitive for e in _subs(remat[0])[0].eqns]
  np.testing.assert_allclose(jax.grad(f)(X), 2 * jnp.cos(X), rtol=1e-6)


def test_jit_inside_keeps_annotation():
  jaxpr = jax.make_jaxpr(jax.jit(lambda x: gshard.split(x, 0, "data") + 1))(X)
  assert shardings(jaxpr) == ["[data,_]"]


# -- open dims (P.UNCONSTRAINED) ----------------------------------------------

def test_unconstrained_dims_are_open():
  (a,) = annotations(jax.make_jaxpr(
      lambda x: gshard.shard(x, P("data", P.UNCONSTRAINED)))(X))
  assert a.sharding.dims == (("data",), ())
  assert a.open_dims == frozenset({1})
  assert str(a) == "[data,?]"


@pytest.mark.parametrize("spec, expected", [
    (P("data", P.UNCONSTRAINED), "f32[8@data,32@model]"),   # open: propagation splits it
    (P("data", None), "f32[8@data,32]"),                     # closed: the user says unsplit
    (P(P.UNCONSTRAINED, P.UNCONSTRAINED), "f32[8,32@model]"),
])
def test_unconstrained_dims_under_propagation(spec, expected):
  def f(x, w):
    return gshard.shard(x @ w, spec)
  res = gshard.infer_shardings(f, MESH, in_specs=(None, P(None, "model")))(
      jnp.ones((8, 16)), jnp.ones((16, 32)))
  (out,) = res.jaxpr.jaxpr.outvars
  assert res.sharding(out).format((8, 32), "f32") == expected


# -- errors: every message has a test -----------------------------------------

@pytest.mark.parametrize("call, error, message", [
    (lambda: gshard.shard(X, P("data", None, "model")), ValueError,
     "shard(x, P('data', None, 'model')): x is f32[4,8] (rank 2) but the spec has 3 "
     "entries. Give at most one entry per dimension, e.g. P('data', None)."),
    (lambda: gshard.shard(jnp.ones(3), P("data", "model")), ValueError,
     "shard(x, P('data', 'model')): x is f32[3] (rank 1) but the spec has 2 entries. "
     "Give at most one entry per dimension, e.g. P('data',)."),
    (lambda: gshard.shard(X, P("data", "data")), ValueError,
     "shard(x, P('data', 'data')): x is f32[4,8]; mesh axis 'data' is used for dim 0 "
     "and again for dim 1. A mesh axis can split only one dimension; use a different "
     "axis for one of them."),
    (lambda: gshard.shard(X, P(("data", "model"), "model")), ValueError,
     "shard(x, P(('data', 'model'), 'model')): x is f32[4,8]; mesh axis 'model' is used "
     "for dim 0 and again for dim 1."),
    (lambda: gshard.split(X, 0, ("data", "data")), ValueError,
     "split(x, dim=0, axis=('data', 'data')): x is f32[4,8]; mesh axis 'data' is used "
     "for dim 0 and again for dim 0."),
    (lambda: gshard.split(X, 2, "data"), ValueError,
     "split(x, dim=2, axis='data'): x is f32[4,8] (rank 2); dim must be in [-2, 1]."),
    (lambda: gshard.split(X, -3, "data"), ValueError,
     "split(x, dim=-3, axis='data'): x is f32[4,8] (rank 2); dim must be in [-2, 1]."),
    (lambda: gshard.split(jnp.float32(1), 0, "data"), ValueError,
     "split(x, dim=0, axis='data'): x is a scalar (f32[]): it has no dim to split. "
         "Use gshard.replicate(x), or drop the annotation."),
    (lambda: gshard.split(X, 1.0, "data"), TypeError,
     "split(x, dim=1.0, axis='data'): dim must be an int, got float."),
    (lambda: gshard.split(X, True, "data"), TypeError,
     "split(x, dim=True, axis='data'): dim must be an int, got bool."),
    (lambda: gshard.split(X, "0", "data"), TypeError,
     "split(x, dim='0', axis='data'): dim must be an int, got str."),
    (lambda: gshard.split(X, 0, ""), ValueError,
     "split(x, dim=0, axis=''): give a mesh axis name (or a tuple of names); to "
     "replicate use gshard.replicate(x)."),
    (lambda: gshard.split(X, 0, ()), ValueError,
     "split(x, dim=0, axis=()): give a mesh axis name"),
    (lambda: gshard.split(X, 0, 5), TypeError,
     "split(x, dim=0, axis=5): mesh axis names must be strings, got 5."),
    (lambda: gshard.split(X, 0, ("data", 3)), TypeError,
     "split(x, dim=0, axis=('data', 3)): mesh axis names must be strings, got 3."),
    (lambda: gshard.shard(X, ("data", None)), TypeError,
     "shard(x, spec=('data', None)): spec must be a jax.sharding.PartitionSpec, e.g. "
     "P('data', None) for x of rank 2."),
    (lambda: gshard.shard(X, "data"), TypeError,
     "shard(x, spec='data'): spec must be a jax.sharding.PartitionSpec"),
    (lambda: gshard.shard(X, P(1, None)), TypeError,
     "shard(x, P(1, None)): mesh axis names must be strings, got 1."),
])
def test_call_time_errors(call, error, message):
  with pytest.raises(error, match=re.escape(message)):
    call()


def test_errors_are_raised_under_jit_too():
  with pytest.raises(ValueError, match=re.escape("dim must be in [-2, 1]")):
    jax.jit(lambda x: gshard.split(x, 5, "data"))(X)


def test_no_mesh_check_outside_gshard():
  # Without a mesh, any axis name is accepted (the annotated code runs unchanged).
  np.testing.assert_array_equal(gshard.split(X, 0, "whatever"), X)


@pytest.mark.parametrize("annotate, call, name", [
    (lambda x: gshard.split(x, 0, "dat"), "split(x, dim=0, axis='dat')", "dat"),
    (lambda x: gshard.shard(x, P(None, "modl")), "shard(x, P(None, 'modl'))", "modl"),
    (lambda x: gshard.shard(x, P(("data", "modl"))), "shard(x, P(('data', 'modl'),))",
     "modl"),
])
def test_unknown_axis_in_annotation_under_infer_shardings(annotate, call, name):
  with pytest.raises(ValueError, match=re.escape(
      f"{call}: x is f32[4,8]; mesh axis '{name}' is not in the mesh (data=2, model=4). "
      "Use one of ['data', 'model'].")):
    gshard.infer_shardings(annotate, MESH)(X)


def test_unknown_axis_in_nested_annotation_under_infer_shardings():
  def f(x):
    return lax.scan(lambda c, v: (c + gshard.split(v, 0, "expert"), c), x[0], x)[0]
  with pytest.raises(ValueError, match=re.escape(
      "split(x, dim=0, axis='expert'): x is f32[8]; mesh axis 'expert' is not in the "
      "mesh (data=2, model=4).")):
    gshard.infer_shardings(f, MESH)(X)


def test_unknown_axis_in_cached_jit_trace():
  # A jit traced outside gshard (no mesh known) is traced again for gshard's
  # mesh (jax's trace cache is keyed by it), so the annotation checks its axis
  # as it is called, as it does outside a jit.
  f = jax.jit(lambda x: gshard.split(x, 0, "dat"))
  f(X)
  with pytest.raises(ValueError, match=r"split\(x, dim=0, axis='dat'\): x is f32\[4,8\]; "
                     r"mesh axis 'dat' is not in the mesh \(data=2, model=4\)\. Use one of "
                     r"\['data', 'model'\]\."):
    gshard.infer_shardings(f, MESH)(X)


def test_mesh_is_forgotten_after_infer_shardings():
  gshard.infer_shardings(lambda x: gshard.split(x, 0, "data"), MESH)(X)
  np.testing.assert_array_equal(gshard.split(X, 0, "other"), X)


@pytest.mark.parametrize("specs, message", [
    ((P("dat"),),
     "in_specs[0]: spec P('dat',) for shape (4, 8) names mesh axis 'dat', which is not "
     "in the mesh (data=2, model=4). Use one of ['data', 'model']."),
    ((P(None, ("model", "expert")),),
     "in_specs[0]: spec P(None, ('model', 'expert')) for shape (4, 8) names mesh axis "
     "'expert', which is not in the mesh (data=2, model=4)."),
])
def test_unknown_axis_in_in_specs(specs, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    gshard.infer_shardings(lambda x: x, MESH, in_specs=specs)(X)


def test_unknown_axis_in_nested_in_specs():
  with pytest.raises(ValueError, match=re.escape(
      "in_specs[1]['w'][0]: spec P('expert',) for shape (4, 8) names mesh axis 'expert'")):
    gshard.infer_shardings(lambda a, p: a, MESH, in_specs=(None, {"w": [P("expert")]}))(
        X, {"w": [X]})


@pytest.mark.parametrize("args, specs, message", [
    (({"w": X},), ({"w": P("data", None, None)},),
     "in_specs[0]['w']: the argument has shape (4, 8) (rank 2) but its spec "
     "P('data', None, None) has 3 entries, on mesh (data=2, model=4). Give at most one "
     "entry per dimension, e.g. P('data', None)."),
    ((X, X), (P("data"), P("data", "model", None)),
     "in_specs[1]: the argument has shape (4, 8) (rank 2) but its spec "
     "P('data', 'model', None) has 3 entries"),
    ((X, {"layers": [X, jnp.ones(3)]}), (None, {"layers": [P(), P(None, "model")]}),
     "in_specs[1]['layers'][1]: the argument has shape (3,) (rank 1) but its spec "
     "P(None, 'model') has 2 entries, on mesh (data=2, model=4). Give at most one entry "
     "per dimension, e.g. P(None,)."),
])
def test_in_specs_rank_names_the_argument_path(args, specs, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    gshard.infer_shardings(lambda *a: a[0], MESH, in_specs=specs)(*args)


def test_in_specs_axis_used_twice_names_the_argument_path():
  with pytest.raises(ValueError, match=re.escape(
      "in_specs[0]: spec P('data', 'data') for shape (4, 8) uses mesh axis 'data' "
      "twice, on mesh (data=2, model=4). A mesh axis can split only one dimension.")):
    gshard.infer_shardings(lambda x: x, MESH, in_specs=(P("data", "data"),))(X)


@pytest.mark.parametrize("specs", [(P("data"), P()), ({"a": P()},)])
def test_in_specs_not_a_prefix(specs):
  with pytest.raises(ValueError, match=re.escape(
      "in_specs must be a pytree prefix of the arguments (a tuple with one entry per "
      "positional argument, PartitionSpecs or None at the leaves)")):
    gshard.infer_shardings(lambda x: x, MESH, in_specs=specs)(X)


def test_annotations_apply_to_every_leaf_of_a_pytree():
  """As ``with_sharding_constraint``: a pytree is annotated leaf by leaf;
  ``shard`` takes one spec for every leaf or a pytree of specs that is a
  prefix of the value's (found by review: a tuple was stacked into one array,
  a dict raised numpy's error)."""
  m = gshard.make_mesh((2, 4), ("data", "model"))
  x = jnp.arange(128.0).reshape(8, 16)
  tree = {"a": x, "b": (x + 1, x + 2)}

  cases = [(lambda t: gshard.shard(t, {"a": P("data"), "b": P(None, "model")}),
            ["[data,_]", "[_,model]", "[_,model]"]),
           (lambda t: gshard.shard(t, P("data")), ["[data,_]"] * 3),
           (lambda t: gshard.split(t, 1, "model"), ["[_,model]"] * 3),
           (gshard.replicate, ["[_,_]"] * 3)]
  for annotate, want in cases:
    def f(t, annotate=annotate):
      return jax.tree.map(lambda v: v * 2, annotate(t))
    step = gshard.partition(f, m)
    assert [str(s) for s in step.lower(tree).out_shardings] == want
    got = step(tree)
    assert jax.tree.structure(got) == jax.tree.structure(tree)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(jax.jit(f)(tree))):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  with pytest.raises(ValueError, match="prefix of x's"):
    gshard.shard(tree, {"a": P()})
  with pytest.raises(TypeError, match="must be a jax.sharding.PartitionSpec"):
    gshard.shard(x, "data")
