"""The sharding algebra (gshard/spmd/sharding.py): pure values, worked examples."""

import re

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from gshard import TensorSharding
from gshard.spmd.sharding import (is_more_specific, is_refinement, merge, mesh_sizes_of,
                                  mesh_str, open_dims_of_spec, validate)

MESH = {"data": 2, "model": 4}


def ts(*dims, partial=()):
  """``ts("data", None, ("x", "y"))``: a TensorSharding from spec-like entries."""
  return TensorSharding(tuple(() if d is None else (d,) if isinstance(d, str) else d
                              for d in dims), frozenset(partial))


# -- PartitionSpec round trip -------------------------------------------------

@pytest.mark.parametrize("spec, rank, dims, back", [
    (P(), 2, ((), ()), P(None, None)),
    (P("data"), 2, (("data",), ()), P("data", None)),
    (P(None, "model"), 2, ((), ("model",)), P(None, "model")),
    (P(("data", "model"), None), 3, (("data", "model"), (), ()), P(("data", "model"), None, None)),
    (P("model", None, "data"), 3, (("model",), (), ("data",)), P("model", None, "data")),
    (P(P.UNCONSTRAINED, "model"), 2, ((), ("model",)), P(None, "model")),
    (None, 2, ((), ()), P(None, None)),
    (P(), 0, (), P()),
])
def test_from_spec_to_spec(spec, rank, dims, back):
  s = TensorSharding.from_spec(spec, rank)
  assert s.dims == dims
  assert s.partial == frozenset()
  assert s.rank == rank
  assert s.to_spec() == back
  # to_spec -> from_spec is an exact round trip.
  assert TensorSharding.from_spec(s.to_spec(), rank) == s


def test_from_spec_too_many_entries():
  with pytest.raises(ValueError, match=re.escape(
      "PartitionSpec P('data', None, 'model') has 3 entries but the value "
      "has rank 2.")):
    TensorSharding.from_spec(P("data", None, "model"), 2)


def test_open_dims_of_spec():
  assert open_dims_of_spec(P(P.UNCONSTRAINED, "data", P.UNCONSTRAINED)) == {0, 2}
  assert open_dims_of_spec(P("data")) == frozenset()
  assert open_dims_of_spec(None) == frozenset()


def test_replicated_and_queries():
  r = TensorSharding.replicated(3)
  assert r.dims == ((), (), ())
  assert r.is_replicated
  s = ts(("data", "model"), None, partial=())
  assert s.axes == {"data", "model"}
  assert not s.is_replicated
  assert not ts(None, partial={"data"}).is_replicated
  assert ts(None, partial={"data"}).axes == frozenset()
  assert s.num_shards(0, MESH) == 8 and s.num_shards(1, MESH) == 1


def test_frozen_and_hashable():
  s = ts("data", None)
  with pytest.raises(AttributeError):
    s.dims = ((), ())
  # lists normalise to tuples; equal values hash equal.
  assert TensorSharding([["data"], []], {"model"}) == ts("data", None, partial={"model"})
  assert hash(TensorSharding([["data"], []])) == hash(ts("data", None))


# -- local and padded shapes --------------------------------------------------

@pytest.mark.parametrize("dims, shape, local, padded, even", [
    (("data", "model"), (64, 1024), (32, 256), (64, 1024), True),
    ((None, None), (3, 5), (3, 5), (3, 5), True),
    (("model", None), (30, 8), (8, 8), (32, 8), False),          # 30 -> 32, 4 ways
    ((("data", "model"), None), (30, 8), (4, 8), (32, 8), False),  # 8 ways
    ((None, "data"), (4, 7), (4, 4), (4, 8), False),
    (("model",), (3,), (1,), (4,), False),                       # fewer rows than devices
    ((("model", "data"),), (8,), (1,), (8,), True),
])
def test_local_and_padded_shape(dims, shape, local, padded, even):
  s = ts(*dims)
  assert s.local_shape(shape, MESH) == local
  assert s.padded_shape(shape, MESH) == padded
  assert s.is_even(shape, MESH) is even


def test_local_shape_ignores_partial():
  assert ts("data", None, partial={"model"}).local_shape((8, 8), MESH) == (4, 8)


def test_local_shape_rank_mismatch():
  with pytest.raises(ValueError, match=re.escape(
      "sharding [data,_] has rank 2 but the shape (8,) has rank 1.")):
    ts("data", None).local_shape((8,), MESH)


# -- refinement, specificity, merge ------------------------------------------

@pytest.mark.parametrize("old, new, refines", [
    (ts("data", None), ts(("data", "model"), None), True),
    (ts("data", None), ts("data", "model"), True),
    (ts("data", None), ts("data", None), True),           # equal refines
    (ts(None, None), ts("model", "data"), True),
    (ts("data", None), ts("model", None), False),
    (ts("data", None), ts(("model", "data"), None), False),  # must be a prefix
    (ts(("data", "model"), None), ts("data", None), False),  # fewer splits
    (ts("data", None), ts(None, "data"), False),
    (ts("data"), ts("data", None), False),                    # rank differs
    (ts("data", None, partial={"model"}), ts("data", None), True),  # partial ignored
])
def test_is_refinement(old, new, refines):
  assert is_refinement(old, new) is refines


@pytest.mark.parametrize("new, old, more", [
    (ts("data", "model"), ts("data", None), True),
    (ts(("data", "model"), None), ts("data", None), True),
    (ts("data", None), ts("data", None), False),              # equal: not strictly
    (ts("data", None), ts("data", "model"), False),
    (ts("model", None), ts("data", None), False),
    (ts("data", None, partial={"model"}), ts("data", None), False),  # only dims count
])
def test_is_more_specific(new, old, more):
  assert is_more_specific(new, old) is more


@pytest.mark.parametrize("a, b, merged", [
    (ts("data", None), ts(None, "model"), ts("data", "model")),
    (ts("data", None), ts(("data", "model"), None), ts(("data", "model"), None)),
    (ts(("data", "model"), None), ts("data", None), ts(("data", "model"), None)),
    (ts(None, None), ts("model", None), ts("model", None)),
    (ts("data", None), ts("data", None), ts("data", None)),
    (ts("data", None, partial={"model"}), ts(None, None, partial={"model"}),
     ts("data", None, partial={"model"})),
    (ts("data", None), ts("model", None), None),           # dim 0 cannot be both
    (ts("data", None), ts(("model", "data"), None), None),  # not a prefix
    (ts("data", None), ts(None, "data"), None),             # data would split two dims
    (ts("data", None), ts(None, None, partial={"data"}), None),  # partial must agree
    (ts(None, None, partial={"model"}), ts(None, None), None),
    (ts("data"), ts("data", None), None),                   # rank differs
])
def test_merge(a, b, merged):
  assert merge(a, b) == merged
  assert merge(b, a) == merged                               # symmetric
  if merged is not None:
    assert is_refinement(a, merged) and is_refinement(b, merged)


# -- transforms ---------------------------------------------------------------

def test_transforms():
  s = ts("data", None, "model", partial={"x"})
  assert s.transpose((2, 0, 1)) == ts("model", "data", None, partial={"x"})
  assert s.without_partial() == ts("data", None, "model")
  assert ts("data", None).with_partial({"model"}) == ts("data", None, partial={"model"})


# -- printing -----------------------------------------------------------------

@pytest.mark.parametrize("s, shape, dtype, text", [
    (ts("data", "model"), (64, 1024), "f32", "f32[64@data,1024@model]"),
    (ts("data", "model"), (64, 1024), np.float32, "f32[64@data,1024@model]"),
    (ts("data", None, partial={"model"}), (64, 1024), np.dtype("float32"),
     "f32[64@data,1024]+model"),
    (ts(None, partial={"model", "data"}), (8,), "bf16", "bf16[8]+data+model"),
    (ts(("data", "model"), None), (16, 3), np.int32, "i32[16@data*model,3]"),
    (TensorSharding(()), (), np.float32, "f32[]"),
    (TensorSharding((), frozenset({"data"})), (), np.float32, "f32[]+data"),
    (ts(None, "model"), (2, 8), None, "[2,8@model]"),
    (ts(None), (2,), np.bool_, "bool[2]"),
])
def test_format(s, shape, dtype, text):
  assert s.format(shape, dtype) == text


def test_str():
  assert str(ts("data", None, ("x", "y"))) == "[data,_,x*y]"
  assert str(ts(None, partial={"model", "data"})) == "[_]+data+model"
  assert str(TensorSharding(())) == "[]"


def test_format_rank_mismatch():
  with pytest.raises(ValueError, match=re.escape(
      "sharding [data] has rank 1 but the shape (4, 4) has rank 2.")):
    ts("data").format((4, 4), "f32")


# -- errors -------------------------------------------------------------------

@pytest.mark.parametrize("dims, partial, axis", [
    ((("data",), ("data",)), (), "data"),
    ((("data", "model"), ("model",)), (), "model"),
    ((("data", "data"),), (), "data"),
    ((("data",), ()), ("data",), "data"),        # partial over a splitting axis
])
def test_axis_used_twice(dims, partial, axis):
  with pytest.raises(ValueError, match=re.escape(
      f"mesh axis {axis!r} is used twice; a mesh axis can split at most one "
      "dimension (or be partial) of a value.")) as e:
    TensorSharding(dims, frozenset(partial))
  assert str(e.value).startswith(f"TensorSharding(dims={tuple(map(tuple, dims))}")


@pytest.mark.parametrize("ok, shape, neighbour, message", [
    # (a sharding that fits, the shape, the same with one thing changed, its error)
    (ts("data", "model"), (8, 8), ts("data", "expert"),
     "x: mesh axis 'expert' is not in the mesh (data=2, model=4)"),
    (ts(None, partial={"model"}), (8,), ts(None, partial={"model", "seq"}),
     "x: mesh axis 'seq' is not in the mesh (data=2, model=4)"),
    # validate checks names and rank; an uneven split is allowed (it is padded)
    (ts("model"), (3,), ts("model", None),
     "x: the sharding P('model', None) has 2 entries but the value has shape (3,)"),
])
def test_validate_accepts_what_fits_and_rejects_its_neighbour(ok, shape, neighbour, message):
  """``validate`` returns None for a fitting sharding, and is not a function
  that accepts everything: one name or one entry changed, it raises."""
  assert validate(ok, shape, MESH, what="x") is None
  with pytest.raises(ValueError, match=re.escape(message)):
    validate(neighbour, shape, MESH, what="x")


def test_validate_rank():
  with pytest.raises(ValueError, match=re.escape(
      "w1: the sharding P('data', None) has 2 entries but the value has "
      "shape (8,) (rank 1). Give one entry per dimension (None for an unsplit one).")):
    validate(ts("data", None), (8,), MESH, what="w1")


@pytest.mark.parametrize("s", [ts("expert", None), ts(None, None, partial={"expert"})])
def test_validate_unknown_axis(s):
  with pytest.raises(ValueError, match=re.escape(
      "value: mesh axis 'expert' is not in the mesh (data=2, model=4). "
      "Use one of ['data', 'model'].")):
    validate(s, (8, 8), MESH)


def test_mesh_helpers():
  import jax
  from jax.sharding import AbstractMesh
  assert mesh_str(MESH) == "(data=2, model=4)"
  assert mesh_sizes_of(MESH) == MESH
  assert mesh_sizes_of(AbstractMesh((2, 4), ("data", "model"))) == MESH
  import gshard
  mesh = gshard.make_mesh((2, 4), ("data", "model"))
  assert mesh_sizes_of(mesh) == MESH
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
