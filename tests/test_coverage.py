"""``gshard.coverage``: the primitives of a program and how each is partitioned."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import gshard
from helpers_partition import mesh

S = jax.ShapeDtypeStruct

# A primitive gshard has never heard of: it must take the safe path.
unknown_p = Primitive("test_unknown_double")
unknown_p.def_impl(lambda x: 2 * x)
unknown_p.def_abstract_eval(lambda x: x)
mlir.register_lowering(unknown_p, mlir.lower_fun(lambda x: 2 * x, multiple_results=False))


def program(w, x, tokens):
  x = gshard.split(x, 0, "data")
  h = jnp.tanh(x @ w)
  h = unknown_p.bind(h)                                   # the safe path
  emb = jnp.take(w, tokens, axis=0)                       # gather
  inner = jax.jit(lambda a: jnp.sin(a) * 2.0)(h)          # a nested jaxpr

  def body(c, row):
    return c + row, jnp.cos(row)
  total, _ = jax.lax.scan(body, jnp.zeros(h.shape[1]), inner)
  return total.sum() + emb.sum()


ARGS = (jnp.ones((16, 16)), jnp.ones((8, 16)), jnp.zeros((4,), jnp.int32))


def test_counts_and_classes_without_mesh():
  cov = gshard.coverage(program, *ARGS)
  assert cov.mesh is None and cov.fallbacks is None
  assert cov["dot_general"].count == 1 and cov["dot_general"].partition == "generic"
  assert cov["sin"].count == 1          # inside the nested jit
  assert cov["cos"].count == 1          # inside the scan body
  assert cov["gather"].partition == "specific" and cov["gather"].rule == "gather_rule"
  assert cov["jit"].rule == "call_rule"
  assert cov["scan"].partition == "specific"
  unknown = cov["test_unknown_double"]
  assert (unknown.sharding_rule, unknown.partition, unknown.safe) == (False, "safe path",
                                                                      True)
  assert cov.safe_path == ["test_unknown_double"]
  assert cov.primitives[0].primitive == "test_unknown_double"   # safe path first
  assert cov.num_equations == sum(p.count for p in cov.primitives)
  assert "test_coverage.py" in unknown.sources[0]


def test_with_mesh_lists_the_fallbacks_with_source_lines():
  with warnings.catch_warnings():
    warnings.simplefilter("error", gshard.PartitionWarning)   # reported, not warned
    cov = gshard.coverage(program, *ARGS, mesh=mesh((2, 4), ("data", "model")),
                          in_specs=(P(None, "model"), P("data"), None))
  assert cov.mesh == "(data=2, model=4)"
  assert [name for name, _ in cov.fallbacks] == ["test_unknown_double"]
  (where,) = cov["test_unknown_double"].fell_back
  assert "test_coverage.py" in where and "(program)" in where


def test_table():
  text = str(gshard.coverage(program, *ARGS))
  lines = text.splitlines()
  assert lines[0].startswith("gshard coverage: ") and "1 take the safe path" in lines[0]
  assert lines[1].split() == ["primitive", "count", "sharding", "partition"]
  assert lines[2].startswith("! test_unknown_double")
  assert lines[2].split()[2:] == ["1", "NO", "safe", "path"]
  row = next(l for l in lines if l.split()[:1] == ["gather"])
  assert row.split()[1:] == ["1", "yes", "specific", "(gather_rule)"]
  assert "safe path (operands gathered, computed replicated):" in lines
  assert any(l.startswith("  test_unknown_double: ") and "test_coverage.py" in l
             for l in lines)


def test_no_safe_path_header():
  cov = gshard.coverage(lambda x: jnp.exp(x) @ x, jnp.ones((4, 4)))
  assert str(cov).splitlines()[0].endswith("none takes the safe path")
  assert cov.safe_path == []


def test_shape_dtype_structs_and_abstract_mesh():
  """Neither devices nor data are needed."""
  args = (S((16, 16), jnp.float32), S((8, 16), jnp.float32), S((4,), jnp.int32))
  cov = gshard.coverage(program, *args,
                        mesh=AbstractMesh((2, 4), ("data", "model")))
  assert [name for name, _ in cov.fallbacks] == ["test_unknown_double"]


def test_unknown_name_error():
  cov = gshard.coverage(lambda x: x * 2, jnp.ones(3))
  with pytest.raises(KeyError, match=r"'conv_general_dilated' is not a primitive of this "
                                     r"program; it has \['mul'\]"):
    cov["conv_general_dilated"]


def test_uneven_in_specs():
  """Dims split unevenly are padded inside the program, as ``partition`` pads
  them: 10 columns over model=4, and a reduction over the padded dim."""
  f = lambda x, w: jnp.sum(jnp.tanh(x @ w), axis=1)
  cov = gshard.coverage(f, jnp.ones((6, 12)), jnp.ones((12, 10)),
                        mesh=mesh((2, 4), ("data", "model")),
                        in_specs=(P("data"), P(None, "model")))
  assert sorted(r.primitive for r in cov.primitives) == ["dot_general", "reduce_sum", "tanh"]
  assert cov.fallbacks == ()
  assert cov.safe_path == []
