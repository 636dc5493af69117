"""Golden tables for the sharding rules (gshard/spmd/rules), one per family.

Each row traces a tiny jax function, takes the equation of one primitive and
checks its printed factor rule (Shardy style: ``ba,ac->bc sum={a}``). The
second half checks, per rule, the sharding propagation gives that equation's
result for given input specs on a (data=2, model=4) mesh.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import gshard
from gshard.spmd import partials, registry
from gshard.spmd.registry import sharding_rule
from gshard.spmd.rules import IN, OUT, SUB_IN, SUB_OUT, FactorRule, OpRule, factor_rule

S = jax.ShapeDtypeStruct
f32, i32, b1 = jnp.float32, jnp.int32, jnp.bool_
MESH = AbstractMesh((2, 4), ("data", "model"))


def eqns_of(fn, args, prim):
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  found = [e for e in jaxpr.eqns if e.primitive.name == prim]
  assert found, f"{prim} not in {[e.primitive.name for e in jaxpr.eqns]}"
  return found


def rule_of(fn, args, prim, index=-1):
  e = eqns_of(fn, args, prim)[index]
  return sharding_rule(prim)([v.aval for v in e.invars], [v.aval for v in e.outvars],
                              **e.params)


# -- factor rules: (name, fn, args, primitive, printed rule, factor sizes) -----

def _scatter_add(e, t, u):
  return e.at[t].add(u)


GOLDEN = [
    # elementwise
    ("add", lambda x, y: x + y, [S((8, 16), f32)] * 2, "add", "ab,ab->ab linear=sum",
     {"a": 8, "b": 16}),
    ("sub", lambda x, y: x - y, [S((8, 16), f32)] * 2, "sub", "ab,ab->ab linear=sum", None),
    ("mul", lambda x, y: x * y, [S((8, 16), f32)] * 2, "mul", "ab,ab->ab linear=product",
     None),
    ("mul int", lambda x, y: x * y, [S((8, 16), jnp.int32)] * 2, "mul",
     "ab,ab->ab linear=product", None),
    ("div", lambda x, y: x / y, [S((8, 16), f32)] * 2, "div", "ab,ab->ab linear=first",
     None),
    ("div int", lambda x, y: lax.div(x, y), [S((8, 16), jnp.int32)] * 2, "div", "ab,ab->ab",
     None),
    ("mul literal scalar", lambda x: x * 2.0, [S((8, 16), f32)], "mul",
     "ab,->ab linear=product", None),
    ("mul scalar operand", lambda x, s: x * s, [S((8, 16), f32), S((), f32)], "mul",
     "ab,->ab linear=product", None),
    ("mul size-1 broadcast", lambda x, y: lax.mul(x, y), [S((8, 1), f32), S((8, 16), f32)],
     "mul", "ac,ab->ab linear=product", {"a": 8, "b": 16, "c": 1}),
    ("mul size-1 broadcast both", lambda x, y: lax.mul(x, y),
     [S((1, 16), f32), S((8, 1), f32)], "mul", "cb,ad->ab linear=product",
     {"a": 8, "b": 16, "c": 1, "d": 1}),
    ("neg", lambda x: -x, [S((8, 16), f32)], "neg", "ab->ab linear=unary", None),
    ("exp", jnp.exp, [S((8, 16), f32)], "exp", "ab->ab", None),
    ("tanh", jnp.tanh, [S((4,), f32)], "tanh", "a->a", None),
    ("integer_pow", lambda x: x ** 2, [S((8, 16), f32)], "integer_pow", "ab->ab", None),
    ("max", jnp.maximum, [S((8, 16), f32)] * 2, "max", "ab,ab->ab", None),
    ("eq", lambda x, y: x == y, [S((8, 16), f32)] * 2, "eq", "ab,ab->ab", None),
    ("select_n", lax.select, [S((8, 16), b1), S((8, 16), f32), S((8, 16), f32)],
     "select_n", "ab,ab,ab->ab linear=select", None),
    ("select_n scalar predicate", lax.select_n, [S((), b1), S((8, 16), f32), S((8, 16), f32)],
     "select_n", ",ab,ab->ab linear=select", None),
    ("clamp scalar bounds", lambda x: lax.clamp(0.0, x, 1.0), [S((8, 16), f32)], "clamp",
     ",ab,->ab", None),
    ("convert f32->bf16", lambda x: x.astype(jnp.bfloat16), [S((8, 16), f32)],
     "convert_element_type", "ab->ab", None),   # narrowing: rounds each partial sum
    ("convert bf16->f32", lambda x: x.astype(f32), [S((8, 16), jnp.bfloat16)],
     "convert_element_type", "ab->ab linear=unary", None),
    ("convert f32->i32", lambda x: x.astype(i32), [S((8, 16), f32)],
     "convert_element_type", "ab->ab", None),
    ("stop_gradient", lax.stop_gradient, [S((8, 16), f32)], "stop_gradient", "ab->ab", None),
    ("add_any", lambda x: jax.grad(lambda x: jnp.sum(x * x))(x), [S((8, 16), f32)],
     "add_any", "ab,ab->ab linear=sum", None),
    ("rank-0 add", lambda x, y: x + y, [S((), f32)] * 2, "add", ",-> linear=sum", None),
    # dot_general: batch factors, then contracting, then lhs free, then rhs free
    ("matmul", jnp.matmul, [S((8, 16), f32), S((16, 32), f32)], "dot_general",
     "ba,ac->bc sum={a}", {"a": 16, "b": 8, "c": 32}),
    ("batched matmul", lambda x, y: jnp.einsum("bik,bkj->bij", x, y),
     [S((2, 8, 16), f32), S((2, 16, 32), f32)], "dot_general", "acb,abd->acd sum={b}",
     {"a": 2, "b": 16, "c": 8, "d": 32}),
    ("two contracting dims", lambda x, w: jnp.einsum("bqhk,hkd->bqd", x, w),
     [S((2, 8, 4, 16), f32), S((4, 16, 32), f32)], "dot_general", "cdab,abe->cde sum={ab}",
     None),
    ("attention scores", lambda q, k: jnp.einsum("bqhk,bthk->bhqt", q, k),
     [S((2, 8, 4, 16), f32)] * 2, "dot_general", "adbc,aebc->abde sum={c}", None),
    ("batch not leading", lambda x, y: lax.dot_general(x, y, (((1,), (2,)), ((0,), (1,)))),
     [S((2, 8, 16), f32), S((4, 2, 8, 16), f32)], "dot_general", "abc,dabe->acde sum={b}",
     None),
    ("inner product", jnp.dot, [S((16,), f32)] * 2, "dot_general", "a,a-> sum={a}", None),
    ("outer product", lambda x, y: lax.dot_general(x, y, (((), ()), ((), ()))),
     [S((4,), f32), S((8,), f32)], "dot_general", "a,b->ab", None),
    # broadcast_in_dim
    ("broadcast kept dims", lambda x: lax.broadcast_in_dim(x, (8, 4, 16), (0, 2)),
     [S((8, 16), f32)], "broadcast_in_dim", "ac->abc", None),
    ("broadcast size-1 dim", lambda x: lax.broadcast_in_dim(x, (8, 4, 16), (0, 2)),
     [S((1, 16), f32)], "broadcast_in_dim", "dc->abc", {"a": 8, "b": 4, "c": 16, "d": 1}),
    ("broadcast scalar", lambda x: lax.broadcast_in_dim(x, (8, 4), ()), [S((), f32)],
     "broadcast_in_dim", "->ab", None),
    ("expand_dims", lambda x: x[:, None], [S((8, 16), f32)], "broadcast_in_dim", "ac->abc",
     {"a": 8, "b": 1, "c": 16}),
    # reshape: compound factors
    ("reshape split", lambda x: x.reshape(2, 3, 4), [S((6, 4), f32)], "reshape",
     "(ab)c->abc linear=unary", {"a": 2, "b": 3, "c": 4}),
    ("reshape merge", lambda x: x.reshape(6, 4), [S((2, 3, 4), f32)], "reshape",
     "abc->(ab)c linear=unary", {"a": 2, "b": 3, "c": 4}),
    ("reshape flatten", lambda x: x.reshape(-1), [S((8, 4, 2), f32)], "reshape",
     "abc->(abc) linear=unary", None),
    ("reshape unflatten", lambda x: x.reshape(2, 3, 4), [S((24,), f32)], "reshape",
     "(abc)->abc linear=unary", {"a": 2, "b": 3, "c": 4}),
    ("reshape heads", lambda x: x.reshape(8, 16, 4, 16), [S((8, 16, 64), f32)], "reshape",
     "ab(cd)->abcd linear=unary", {"a": 8, "b": 16, "c": 4, "d": 16}),
    ("reshape regroup", lambda x: x.reshape(2, 12), [S((4, 6), f32)], "reshape",
     "(ab)c->a(bc) linear=unary", {"a": 2, "b": 2, "c": 6}),
    # (6,4)->(4,6): the common factor 2 aligns, the rest is blocked
    ("reshape partial alignment", lambda x: x.reshape(4, 6), [S((6, 4), f32)], "reshape",
     "(ab)c->(ad)e blocked={bcde} linear=unary", {"a": 2, "b": 3, "c": 4, "d": 2, "e": 6}),
    ("reshape add unit dim", lambda x: x.reshape(8, 1, 16), [S((8, 16), f32)], "reshape",
     "bc->bac linear=unary", {"a": 1, "b": 8, "c": 16}),
    ("reshape drop unit dim", lambda x: x.reshape(8, 16), [S((1, 8, 16), f32)], "reshape",
     "abc->bc linear=unary", {"a": 1, "b": 8, "c": 16}),
    ("reshape to scalar", lambda x: x.reshape(()), [S((1, 1), f32)], "reshape",
     "ab-> linear=unary", None),
    # transpose, squeeze
    ("transpose", lambda x: x.transpose(2, 0, 1), [S((2, 3, 4), f32)], "transpose",
     "abc->cab linear=unary", None),
    ("squeeze", lambda x: lax.squeeze(x, (1,)), [S((4, 1, 8), f32)], "squeeze",
     "abc->ac linear=unary", None),
    # windows: a dim only partly kept gets blocked factors of its own
    ("slice", lambda x: x[:, 2:6], [S((8, 16), f32)], "slice", "ab->ac blocked={bc} linear=unary",
     {"a": 8, "b": 16, "c": 4}),
    ("strided slice", lambda x: x[::2], [S((8, 16), f32)], "slice",
     "ac->bc blocked={ab} linear=unary", {"a": 8, "b": 4, "c": 16}),
    ("pad", lambda x: lax.pad(x, 0.0, ((0, 0, 0), (1, 2, 0))), [S((8, 16), f32)], "pad",
     "ab,->ac blocked={bc}", {"a": 8, "b": 16, "c": 19}),
    ("pad interior", lambda x: lax.pad(x, 0.0, ((0, 0, 0), (0, 0, 1))), [S((8, 16), f32)],
     "pad", "ab,->ac blocked={bc}", {"a": 8, "b": 16, "c": 31}),
    ("rev", lambda x: lax.rev(x, (1,)), [S((8, 16), f32)], "rev",
     "ab->ac blocked={bc} linear=unary", None),
    ("concatenate", lambda x, y: lax.concatenate([x, y], 1), [S((8, 16), f32), S((8, 4), f32)],
     "concatenate", "ac,ad->ae blocked={cde} linear=sum", {"a": 8, "b": 20, "c": 16,
                                                           "d": 4, "e": 20}),
    ("split", lambda x: jnp.split(x, 2, axis=1), [S((8, 16), f32)], "split",
     "ac->ad,ae blocked={cde} linear=unary", None),
    ("dynamic_slice", lambda x, i: lax.dynamic_slice(x, (0, i), (8, 4)),
     [S((8, 16), f32), S((), i32)], "dynamic_slice", "ab,,->ac blocked={bc} linear=unary",
     None),
    ("dynamic_slice rows", lambda x, i: lax.dynamic_slice_in_dim(x, i, 2, 0),
     [S((8, 16), f32), S((), i32)], "dynamic_slice", "ac,,->bc blocked={ab} linear=unary",
     None),
    ("dynamic_update_slice", lambda x, u, i: lax.dynamic_update_slice(x, u, (0, i)),
     [S((8, 16), f32), S((8, 4), f32), S((), i32)], "dynamic_update_slice", "ab,ac,,->ab",
     {"a": 8, "b": 16, "c": 4}),
    ("iota", lambda: lax.broadcasted_iota(i32, (4, 8), 1), [], "iota", "->ab", None),
    # reductions, scans along a dim, sorts
    ("reduce_sum", lambda x: x.sum(1), [S((8, 16), f32)], "reduce_sum",
     "ab->a sum={b} linear=unary", None),
    ("reduce_sum two axes", lambda x: x.sum((0, 2)), [S((2, 8, 16), f32)], "reduce_sum",
     "abc->b sum={ac} linear=unary", None),
    ("reduce_sum all", jnp.sum, [S((8, 16), f32)], "reduce_sum", "ab-> sum={ab} linear=unary",
     None),
    ("reduce_max", lambda x: lax.reduce_max(x, (1,)), [S((8, 16), f32)], "reduce_max",
     "ab->a reduce={b}", None),
    ("reduce_min", lambda x: lax.reduce_min(x, (0,)), [S((8, 16), f32)], "reduce_min",
     "ab->b reduce={a}", None),
    ("argmax", lambda x: jnp.argmax(x, 1), [S((8, 16), f32)], "argmax", "ab->a reduce={b}",
     None),
    ("argmin", lambda x: jnp.argmin(x, 0), [S((8, 16), f32)], "argmin", "ab->b reduce={a}",
     None),
    ("cumsum", lambda x: lax.cumsum(x, 1), [S((4, 8), f32)], "cumsum",
     "ab->ab linear=unary", None),
    ("cumprod", lambda x: lax.cumprod(x, 0), [S((8, 16), f32)], "cumprod", "ab->ab", None),
    ("cummax", lambda x: lax.cummax(x, 1), [S((8, 16), f32)], "cummax", "ab->ab", None),
    ("cumlogsumexp", lambda x: lax.cumlogsumexp(x, 1), [S((8, 16), f32)], "cumlogsumexp",
     "ab->ab blocked={b}", None),
    ("sort", lambda x: lax.sort(x, dimension=0), [S((4, 8), f32)], "sort",
     "ab->ab blocked={a}", None),
    ("sort two operands", lambda x, y: lax.sort((x, y), dimension=1, num_keys=1),
     [S((8, 16), f32), S((8, 16), i32)], "sort", "ab,ab->ab,ab blocked={b}", None),
    ("top_k", lambda x: lax.top_k(x, 2), [S((4, 50), f32)], "top_k",
     "ab->ac,ac reduce={b} blocked={c}", {"a": 4, "b": 50, "c": 2}),
    ("top_k along axis 0", lambda x: lax.top_k(x, 2, axis=0), [S((4, 50), f32)], "top_k",
     "ab->cb,cb reduce={a} blocked={c}", {"a": 4, "b": 50, "c": 2}),
    # batched linear algebra and FFTs: the batch shared, the cores blocked
    ("cholesky", lax.linalg.cholesky, [S((8, 4, 4), f32)], "cholesky",
     "abc->ade blocked={bcde}", {"a": 8, "b": 4, "c": 4, "d": 4, "e": 4}),
    ("eigh", lambda x: lax.linalg.eigh(x), [S((2, 8, 4, 4), f32)], "eigh",
     "abcd->abef,abg blocked={cdefg}", None),
    ("triangular_solve", lambda a, b: lax.linalg.triangular_solve(a, b, left_side=True),
     [S((8, 4, 4), f32), S((8, 4, 3), f32)], "triangular_solve",
     "abc,ade->afg blocked={bcdefg}", None),
    ("lu", lax.linalg.lu, [S((8, 4, 3), f32)], "lu", "abc->ade,af,ag blocked={bcdefg}",
     {"a": 8, "b": 4, "c": 3, "d": 4, "e": 3, "f": 3, "g": 4}),
    ("fft", lambda x: lax.fft_p.bind(x, fft_type=lax.FftType.FFT, fft_lengths=(32,)),
     [S((8, 16, 32), jnp.complex64)],
     "fft", "abc->abd blocked={cd}", None),
    ("rfft2", lambda x: lax.fft_p.bind(x, fft_type=lax.FftType.RFFT, fft_lengths=(16, 32)),
     [S((8, 16, 32), f32)], "fft",
     "abc->ade blocked={bcde}", {"a": 8, "b": 16, "c": 32, "d": 16, "e": 17}),
    ("le_to", lambda x: lax.le_to_p.bind(x, x), [S((8, 16), f32)], "le_to", "ab,ab->ab", None),
    ("tile", lambda x: jnp.tile(x, (2, 1)), [S((4, 8), f32)], "tile", "ab->(ca)b linear=unary",
     {"a": 4, "b": 8, "c": 2}),
    # gather / scatter
    ("embedding lookup", lambda e, t: e[t], [S((128, 64), f32), S((8, 16), i32)], "gather",
     "ed,abc->abd sum={e} blocked={c}", {"a": 8, "b": 16, "c": 1, "d": 64, "e": 128}),
    ("gather rows", lambda x, i: x[i], [S((10, 4), f32), S((3,), i32)], "gather",
     "dc,ab->ac sum={d} blocked={b}", {"a": 3, "b": 1, "c": 4, "d": 10}),
    ("gather columns", lambda x, i: x[:, i], [S((10, 4), f32), S((3,), i32)], "gather",
     "cd,ab->ca sum={d} blocked={b}", None),
    ("embedding gradient", _scatter_add,
     [S((128, 64), f32), S((8, 16), i32), S((8, 16, 64), f32)], "scatter-add",
     "ab,cde,cdb->ab sum={cd} blocked={e}", {"a": 128, "b": 64, "c": 8, "d": 16, "e": 1}),
]


@pytest.mark.parametrize("name, fn, args, prim, expected, sizes", GOLDEN,
                         ids=[g[0] for g in GOLDEN])
def test_factor_rule(name, fn, args, prim, expected, sizes):
  rule = rule_of(fn, args, prim)
  assert isinstance(rule, FactorRule)
  assert str(rule) == expected
  if sizes is not None:
    assert rule.size_of == sizes


def test_take_along_axis_rules():
  """take_along_axis (cross-entropy's gold logit) is a gather with batching dims."""
  fn = lambda x, i: jnp.take_along_axis(x, i, axis=-1)
  args = [S((8, 16, 128), f32), S((8, 16, 1), i32)]
  (jit,) = eqns_of(fn, args, "jit")
  inner = jit.params["jaxpr"].jaxpr
  (g,) = [e for e in inner.eqns if e.primitive.name == "gather"]
  rule = sharding_rule("gather")([v.aval for v in g.invars], [v.aval for v in g.outvars],
                                  **g.params)
  # operand f32[8,16,128] indexed on its last dim by i32[8,16,1,1] (batch dims 0, 1
  # shared with the indices): the vocabulary dim is a sum factor, the index vector
  # blocked, batch dims shared by operand, indices and result.
  assert [tuple(v.aval.shape) for v in g.invars] == [(8, 16, 128), (8, 16, 1, 1)]
  assert str(rule) == "abe,abcd->abc sum={e} blocked={d}"
  assert rule.size_of == {"a": 8, "b": 16, "c": 1, "d": 1, "e": 128}


def test_elementwise_operand_rank_mismatch_is_an_error():
  with pytest.raises(ValueError, match="elementwise operand of rank 1 with result rank 2"):
    sharding_rule("add")([S((16,), f32), S((8, 16), f32)], [S((8, 16), f32)])


def test_factor_rule_builder():
  r = factor_rule("bik,bkj->bij", [(2, 8, 4), (2, 4, 16)], [(2, 8, 16)], reduction="k")
  assert str(r) == "bik,bkj->bij sum={k}"
  assert r.size_of == {"b": 2, "i": 8, "j": 16, "k": 4}
  assert r.factors == ("b", "i", "k", "j")
  r = factor_rule("(ab)c->abc", [(6, 4)], [(2, 3, 4)])
  assert r.operands == ((("a", "b"), ("c",)),)
  # one unknown factor of a compound dim is inferred
  r = factor_rule("(ab)->b", [(12,)], [(3,)])
  assert r.size_of == {"a": 4, "b": 3}
  with pytest.raises(ValueError, match="factor a has sizes 4 and 5"):
    factor_rule("a,a->a", [(4,), (5,)], [(4,)])
  with pytest.raises(ValueError, match="give sizes for compound dim"):
    factor_rule("(ab)->", [(12,)], [()])
  with pytest.raises(ValueError, match="does not match shape"):
    factor_rule("ab->a", [(4,)], [(4,)])
  with pytest.raises(ValueError, match="linear='bogus'"):
    FactorRule(operands=(), results=(), sizes=(), linear="bogus")


# -- OpRules: calls and control flow ------------------------------------------

def summary(rule):
  assert isinstance(rule, OpRule)
  return [(str(c.rule), c.operands, c.results) for c in rule.constraints]


@jax.custom_vjp
def _custom_vjp_mul(x, y):
  return x * y


_custom_vjp_mul.defvjp(lambda x, y: (x * y, (x, y)), lambda r, g: (g * r[1], g * r[0]))


def test_jit_rule():
  rule = rule_of(jax.jit(lambda x, y: x + y), [S((8, 16), f32)] * 2, "jit")
  J = ("jaxpr",)
  assert summary(rule) == [
      ("ab->ab linear=unary", (IN(0),), (SUB_IN(J, 0),)),
      ("ab->ab linear=unary", (IN(1),), (SUB_IN(J, 1),)),
      ("ab->ab linear=unary", (SUB_OUT(J, 0),), (OUT(0),)),
  ]
  assert rule.pins == ()


def test_custom_jvp_call_rule():
  rule = rule_of(jax.nn.relu, [S((8, 16), f32)], "custom_jvp_call")
  J = ("call_jaxpr",)
  assert summary(rule) == [
      ("ab->ab linear=unary", (IN(0),), (SUB_IN(J, 0),)),
      ("ab->ab linear=unary", (SUB_OUT(J, 0),), (OUT(0),)),
  ]


def test_custom_vjp_call_rule():
  rule = rule_of(_custom_vjp_mul, [S((8, 16), f32)] * 2, "custom_vjp_call")
  J = ("call_jaxpr",)
  assert summary(rule) == [
      ("ab->ab linear=unary", (IN(0),), (SUB_IN(J, 0),)),
      ("ab->ab linear=unary", (IN(1),), (SUB_IN(J, 1),)),
      ("ab->ab linear=unary", (SUB_OUT(J, 0),), (OUT(0),)),
  ]


def test_checkpoint_rule():
  eqns = jax.make_jaxpr(jax.checkpoint(jnp.sin))(S((8, 16), f32)).jaxpr.eqns
  (e,) = eqns
  rule = sharding_rule(e.primitive.name)([v.aval for v in e.invars],
                                          [v.aval for v in e.outvars], **e.params)
  assert summary(rule) == [
      ("ab->ab linear=unary", (IN(0),), (SUB_IN(("jaxpr",), 0),)),
      ("ab->ab linear=unary", (SUB_OUT(("jaxpr",), 0),), (OUT(0),)),
  ]


def test_scan_rule():
  def f(w, c, xs):
    return lax.scan(lambda c, x: (c + x * w, c * 2), c, xs)
  rule = rule_of(f, [S((16,), f32), S((16,), f32), S((5, 16), f32)], "scan")
  J = ("jaxpr",)
  assert summary(rule) == [
      ("a->a linear=unary", (IN(0),), (SUB_IN(J, 0),)),          # const
      ("a->a", (IN(1),), (SUB_IN(J, 1),)),                        # carry in
      ("a->a", (SUB_OUT(J, 0),), (SUB_IN(J, 1),)),                # carry loops back
      ("a->a", (SUB_OUT(J, 0),), (OUT(0),)),                      # carry out
      ("za->a blocked={z}", (IN(2),), (SUB_IN(J, 2),)),           # xs: scanned dim blocked
      ("a->za blocked={z} linear=unary", (SUB_OUT(J, 1),), (OUT(1),)),   # ys: stacking
  ]


def test_scan_rule_of_an_accumulator():
  """A carry that only accumulates (``c + x * w``, c read by nothing else) may
  stay pending round the loop: its init is a seed, its back edge and out link
  linear."""
  def f(w, c, xs):
    return lax.scan(lambda c, x: (c + x * w, None), c, xs)
  rule = rule_of(f, [S((16,), f32), S((16,), f32), S((5, 16), f32)], "scan")
  J = ("jaxpr",)
  assert summary(rule)[1:4] == [
      ("a->a linear=seed", (IN(1),), (SUB_IN(J, 1),)),            # carry in: seeded
      ("a->a linear=unary", (SUB_OUT(J, 0),), (SUB_IN(J, 1),)),   # loops back pending
      ("a->a linear=unary", (SUB_OUT(J, 0),), (OUT(0),)),         # leaves pending
  ]


def test_while_rule():
  def f(c, k):
    return lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] * k), (0, c))
  rule = rule_of(f, [S((16,), f32), S((16,), f32)], "while")
  C, B = ("cond_jaxpr",), ("body_jaxpr",)
  got = summary(rule)
  assert got[0] == ("a->a linear=unary", (IN(0),), (SUB_IN(B, 0),))   # body const k
  # each of the 2 carries: into body and cond, body out back to both, and out
  assert len(got) == 1 + 2 * 5
  assert got[6:] == [
      ("a->a", (IN(2),), (SUB_IN(B, 2),)),
      ("a->a", (IN(2),), (SUB_IN(C, 1),)),
      ("a->a", (SUB_OUT(B, 1),), (SUB_IN(B, 2),)),
      ("a->a", (SUB_OUT(B, 1),), (SUB_IN(C, 1),)),
      ("a->a", (SUB_OUT(B, 1),), (OUT(1),)),
  ]


def test_cond_rule():
  def f(p, x, y):
    return lax.cond(p, lambda a, b: a + b, lambda a, b: a - b, x, y)
  rule = rule_of(f, [S((), b1), S((8, 16), f32), S((8, 16), f32)], "cond")
  got = summary(rule)
  assert len(got) == 2 * 2 + 1
  for k in range(2):
    br = ("branches", k)
    assert got[2 * k:2 * k + 2] == [
        ("ab->ab", (IN(1),), (SUB_IN(br, 0),)),
        ("ab->ab", (IN(2),), (SUB_IN(br, 1),)),
    ]
  # every branch's result to the cond's: pending over what all leave pending
  assert got[4] == ("ab,ab->ab linear=branch",
                    (SUB_OUT(("branches", 0), 0), SUB_OUT(("branches", 1), 0)), (OUT(0),))


def test_annotation_rule_pins_its_result():
  e = eqns_of(lambda x: gshard.shard(x, P("data", P.UNCONSTRAINED)), [S((8, 16), f32)],
              "sharding_annotation")[0]
  rule = sharding_rule("sharding_annotation")([v.aval for v in e.invars],
                                               [v.aval for v in e.outvars], **e.params)
  assert summary(rule) == [("ab->ab", (IN(0),), (OUT(0),))]
  (pin,) = rule.pins
  assert pin.ref == OUT(0)
  assert str(pin.sharding) == "[data,_]"
  assert pin.open_dims == frozenset({1})


def test_every_registered_rule_is_callable():
  # The table is keyed by primitive name and holds plain callables.
  assert {"add", "dot_general", "reshape", "gather", "scatter-add", "jit", "scan",
          "custom_jvp_call", "custom_vjp_call", "sharding_annotation"} <= set(registry.table)
  assert all(callable(e.sharding) for e in registry.table.values())


# -- propagation through one rule: input specs -> result sharding -------------

def propagated(fn, specs, args, prim, index=0):
  """The sharding propagation gives the result of the ``index``-th ``prim``, as
  the op makes it: ``+axis`` for the axes its split sum factors leave pending
  (where that sum is then resolved is tested below, test_pending_sums)."""
  res = gshard.infer_shardings(fn, MESH, in_specs=specs)(*args)
  e = [e for e in res.jaxpr.jaxpr.eqns if e.primitive.name == prim][index]
  bound = next(b for b in res.graph.bounds if b.eqn is e)
  made = partials.produced(bound, dict(MESH.shape))

  def fmt(v):
    s = res.sharding(v)
    s = dataclasses.replace(s, partial=s.partial | (made - s.axes))
    return s.format(v.aval.shape, v.aval.dtype)
  return " ".join(fmt(v) for v in e.outvars)


PROPAGATED = [
    ("add merges", lambda x, y: x + y, (P("data"), P(None, "model")),
     [S((8, 16), f32)] * 2, "add", "f32[8@data,16@model]"),
    ("add conflict: cheaper wins", lambda x, y: x + y, (P("data"), P("model")),
     [S((8, 16), f32)] * 2, "add", "f32[8@data,16]"),
    ("add open operand", lambda x, y: x + y, (P("data", "model"), None),
     [S((8, 16), f32)] * 2, "add", "f32[8@data,16@model]"),
    ("mul by scalar", lambda x, s: x * s, (P("data", "model"), P()),
     [S((8, 16), f32), S((), f32)], "mul", "f32[8@data,16@model]"),
    # (a [None]: the product is no state of y, which would lay it out as y)
    ("size-1 dim is never split", lambda x, y: lax.mul(x, y)[None],
     (P("data", None), P(None, "model")),
     [S((8, 1), f32), S((8, 16), f32)], "mul", "f32[8@data,16@model]"),
    ("exp", jnp.exp, (P(("data", "model")),), [S((8, 16), f32)], "exp",
     "f32[8@data*model,16]"),
    ("matmul split contraction", lambda x, y: -(x @ y), (P("data", "model"), P("model")),
     [S((8, 16), f32), S((16, 32), f32)], "dot_general", "f32[8@data,32]+model"),
    ("matmul column split", jnp.matmul, (P("data"), P(None, "model")),
     [S((8, 16), f32), S((16, 32), f32)], "dot_general", "f32[8@data,32@model]"),
    ("matmul nothing to go on", jnp.matmul, (None, None),
     [S((8, 16), f32), S((16, 32), f32)], "dot_general", "f32[8,32]"),
    ("batched matmul", lambda x, y: -jnp.einsum("bik,bkj->bij", x, y),
     (P("data", None, "model"), P("data", "model")),
     [S((2, 8, 16), f32), S((2, 16, 32), f32)], "dot_general", "f32[2@data,8,32]+model"),
    ("both contraction dims split", lambda x, w: -jnp.einsum("bqhk,hkd->bqd", x, w),
     (P(None, None, "model", "data"), P("model", "data")),
     [S((2, 8, 4, 16), f32), S((4, 16, 32), f32)], "dot_general", "f32[2,8,32]+data+model"),
    ("broadcast", lambda x: lax.broadcast_in_dim(x, (8, 4, 16), (0, 2)), (P("data", "model"),),
     [S((8, 16), f32)], "broadcast_in_dim", "f32[8@data,4,16@model]"),
    ("reshape split", lambda x: x.reshape(2, 3, 4), (P("data", "model"),), [S((6, 4), f32)],
     "reshape", "f32[2@data,3,4@model]"),
    ("reshape split over two axes", lambda x: x.reshape(2, 4, 4), (P(("data", "model")),),
     [S((8, 4), f32)], "reshape", "f32[2@data,4@model,4]"),
    ("reshape merge", lambda x: x.reshape(8, 4), (P("data", "model"),), [S((2, 4, 4), f32)],
     "reshape", "f32[8@data*model,4]"),
    ("reshape partial alignment", lambda x: x.reshape(4, 6), (P("data", "model"),),
     [S((6, 4), f32)], "reshape", "f32[4@data,6]"),
    ("reshape blocked dim", lambda x: x.reshape(4, 6), (P(None, "model"),), [S((6, 4), f32)],
     "reshape", "f32[4,6]"),
    ("reshape unit dim", lambda x: x.reshape(8, 1, 16), (P("data", "model"),),
     [S((8, 16), f32)], "reshape", "f32[8@data,1,16@model]"),
    ("reshape heads", lambda x: x.reshape(8, 16, 4, 16), (P("data", None, "model"),),
     [S((8, 16, 64), f32)], "reshape", "f32[8@data,16,4@model,16]"),
    ("transpose", lambda x: x.transpose(2, 0, 1), (P("data", None, "model"),),
     [S((2, 3, 4), f32)], "transpose", "f32[4@model,2@data,3]"),
    ("squeeze", lambda x: lax.squeeze(x, (1,)), (P("data", None, "model"),),
     [S((4, 1, 8), f32)], "squeeze", "f32[4@data,8@model]"),
    ("slice", lambda x: x[:, 2:6], (P("data", "model"),), [S((8, 16), f32)], "slice",
     "f32[8@data,4]"),
    ("pad", lambda x: lax.pad(x, 0.0, ((0, 0, 0), (1, 2, 0))), (P("data", "model"),),
     [S((8, 16), f32)], "pad", "f32[8@data,19]"),
    ("rev", lambda x: lax.rev(x, (1,)), (P("data", "model"),), [S((8, 16), f32)], "rev",
     "f32[8@data,16]"),
    ("concatenate", lambda x, y: lax.concatenate([x, y], 1), (P("data", "model"), P()),
     [S((8, 16), f32), S((8, 4), f32)], "concatenate", "f32[8@data,20]"),
    ("dynamic_slice", lambda x, i: lax.dynamic_slice(x, (0, i), (8, 4)),
     (P("data", "model"), P()), [S((8, 16), f32), S((), i32)], "dynamic_slice",
     "f32[8@data,4]"),
    ("dynamic_update_slice", lambda x, u, i: lax.dynamic_update_slice(x, u, (0, i)),
     (P("data", "model"), P(), P()), [S((8, 16), f32), S((8, 4), f32), S((), i32)],
     "dynamic_update_slice", "f32[8@data,16@model]"),
    ("reduce_sum over split dim", lambda x: -x.sum(1), (P("data", "model"),),
     [S((8, 16), f32)], "reduce_sum", "f32[8@data]+model"),
    ("reduce_sum over all", lambda x: -jnp.sum(x), (P("data", "model"),), [S((8, 16), f32)],
     "reduce_sum", "f32[]+data+model"),
    ("reduce_max is not a pending sum", lambda x: -lax.reduce_max(x, (1,)),
     (P("data", "model"),), [S((8, 16), f32)], "reduce_max", "f32[8@data]"),
    ("argmax", lambda x: jnp.argmax(x, 1), (P("data", "model"),), [S((8, 16), f32)],
     "argmax", "i32[8@data]"),
    ("cumsum keeps its dim split", lambda x: lax.cumsum(x, 1), (P("data", "model"),),
     [S((8, 16), f32)], "cumsum", "f32[8@data,16@model]"),
    ("cumlogsumexp blocks its dim", lambda x: lax.cumlogsumexp(x, 1), (P("data", "model"),),
     [S((8, 16), f32)], "cumlogsumexp", "f32[8@data,16]"),
    ("sort blocks its dim", lambda x: lax.sort(x, dimension=0), (P("data", "model"),),
     [S((8, 16), f32)], "sort", "f32[8,16@model]"),
    ("embedding lookup", lambda e, t: -e[t], (P("model"), P("data")),
     [S((128, 64), f32), S((8, 16), i32)], "gather", "f32[8@data,16,64]+model"),
    ("embedding lookup, d_model split", lambda e, t: -e[t], (P(None, "model"), P("data")),
     [S((128, 64), f32), S((8, 16), i32)], "gather", "f32[8@data,16,64@model]"),
    ("take_along_axis", lambda x, i: jnp.take_along_axis(x, i, axis=-1),
     (P("data", None, "model"), P("data")), [S((8, 16, 128), f32), S((8, 16, 1), i32)],
     "jit", "f32[8@data,16,1]"),
    ("embedding gradient", lambda e, t, u: -_scatter_add(e, t, u),
     (P(), P("data"), P("data")), [S((128, 64), f32), S((8, 16), i32), S((8, 16, 64), f32)],
     "scatter-add", "f32[128,64]+data"),
    ("embedding gradient, vocab split", lambda e, t, u: -_scatter_add(e, t, u),
     (P("model"), P("data"), P("data")),
     [S((128, 64), f32), S((8, 16), i32), S((8, 16, 64), f32)],
     "scatter-add", "f32[128@model,64]+data"),
    # calls and control flow carry shardings in and out
    ("jit", jax.jit(lambda x: jnp.sin(x) * 2), (P("data", "model"),), [S((8, 16), f32)],
     "jit", "f32[8@data,16@model]"),
    ("custom_jvp (relu)", jax.nn.relu, (P("data", "model"),), [S((8, 16), f32)],
     "custom_jvp_call", "f32[8@data,16@model]"),
    ("custom_vjp", _custom_vjp_mul, (P("data"), P(None, "model")), [S((8, 16), f32)] * 2,
     "custom_vjp_call", "f32[8@data,16@model]"),
    ("scan carry", lambda c, xs: lax.scan(lambda c, x: (c + x, c), c, xs),
     (P("model"), None), [S((16,), f32), S((5, 16), f32)], "scan",
     "f32[16@model] f32[5,16@model]"),
    ("scan never splits the scanned dim", lambda c, xs: lax.scan(lambda c, x: (c + x, c), c, xs),
     (None, P("data", "model")), [S((16,), f32), S((4, 16), f32)], "scan",
     "f32[16@model] f32[4,16@model]"),
    ("cond", lambda p, x, y: lax.cond(p, jnp.add, jnp.subtract, x, y),
     (P(), P("data"), P(None, "model")), [S((), b1), S((8, 16), f32), S((8, 16), f32)],
     "cond", "f32[8@data,16@model]"),
]


@pytest.mark.parametrize("name, fn, specs, args, prim, expected", PROPAGATED,
                         ids=[p[0] for p in PROPAGATED])
def test_propagated_sharding(name, fn, specs, args, prim, expected):
  assert propagated(fn, specs, args, prim) == expected


# -- where a pending sum may stay pending -------------------------------------

def _pending(fn, specs, args):
  res = gshard.infer_shardings(fn, MESH, in_specs=specs)(*args)
  return [(e.primitive.name, str(res.sharding(e.outvars[0]))) for e in res.jaxpr.jaxpr.eqns]


XW = [S((8, 16), f32), S((16, 4), f32)]
K_SPLIT = (P(None, "model"), P("model"))


@pytest.mark.parametrize("name, fn, expected", [
    # to a consumer whose psum is smaller (the sum over an unsplit dim)
    ("through neg", lambda x, w: jnp.sum(-(-(x @ w)), 0),
     [("dot_general", "[_,_]+model"), ("neg", "[_,_]+model"), ("neg", "[_,_]+model"),
      ("reduce_sum", "[_]")]),
    ("through a scale", lambda x, w: jnp.sum((x @ w) * 3.0, 0),
     [("dot_general", "[_,_]+model"), ("mul", "[_,_]+model"), ("reduce_sum", "[_]")]),
    ("through a division", lambda x, w: jnp.sum((x @ w) / 3.0, 0),
     [("dot_general", "[_,_]+model"), ("div", "[_,_]+model"), ("reduce_sum", "[_]")]),
    # a select of it and a zero (each device picks its term or 0), or of two
    # pending sums, with a complete mask; not of a non-zero (counted per device)
    ("through a select of a zero", lambda x, w: jnp.sum(jnp.where(jnp.arange(4) > 1,
                                                                  x @ w, 0.0), 0),
     [("iota", "[_]"), ("gt", "[_]"), ("dot_general", "[_,_]+model"),
      ("jit", "[_,_]+model"), ("reduce_sum", "[_]")]),
    ("not through a select of a non-zero", lambda x, w: jnp.sum(jnp.where(
        jnp.arange(4) > 1, x @ w, 1.0), 0),
     [("iota", "[_]"), ("gt", "[_]"), ("dot_general", "[_,_]"), ("jit", "[_,_]"),
      ("reduce_sum", "[_]")]),
    # where resolving later costs no fewer bytes, the sum is resolved where it
    # is made, as the one-device program sums before it scales
    ("same bytes later: summed where made", lambda x, w: -((x @ w) * 3.0),
     [("dot_general", "[_,_]"), ("mul", "[_,_]"), ("neg", "[_,_]")]),
    # passed on to the first value where the psum costs least, and summed there
    ("through reduce_sum", lambda x, w: -jnp.sum(x @ w, 0),
     [("dot_general", "[_,_]+model"), ("reduce_sum", "[_]"), ("neg", "[_]")]),
    ("two pending sums add", lambda x, w: -((x @ w) + (x @ w * 2.0)),
     [("dot_general", "[_,_]+model"), ("dot_general", "[_,_]+model"),
      ("mul", "[_,_]+model"), ("add", "[_,_]"), ("neg", "[_,_]")]),
    # not linear: resolved where produced
    ("not through exp", lambda x, w: jnp.exp(x @ w),
     [("dot_general", "[_,_]"), ("exp", "[_,_]")]),
    ("not through adding a constant", lambda x, w: -((x @ w) + 1.0),
     [("dot_general", "[_,_]"), ("add", "[_,_]"), ("neg", "[_,_]")]),
    ("not through subtracting from a constant", lambda x, w: -(1.0 - (x @ w)),
     [("dot_general", "[_,_]"), ("sub", "[_,_]"), ("neg", "[_,_]")]),
    ("not into an int", lambda x, w: -(x @ w).astype(i32),
     [("dot_general", "[_,_]"), ("convert_element_type", "[_,_]"), ("neg", "[_,_]")]),
    ("not through a square", lambda x, w: (x @ w) * (x @ w),
     [("dot_general", "[_,_]"), ("dot_general", "[_,_]"), ("mul", "[_,_]")]),
    # one consumer that needs the full value resolves it once, for every consumer
    ("one non-linear consumer", lambda x, w: (lambda y: (-y, jnp.exp(y)))(x @ w),
     [("dot_general", "[_,_]"), ("neg", "[_,_]"), ("exp", "[_,_]")]),
    ("all consumers linear", lambda x, w: (lambda y: jnp.sum(-(-y) * 2.0, 0))(x @ w),
     [("dot_general", "[_,_]+model"), ("neg", "[_,_]+model"), ("neg", "[_,_]+model"),
      ("mul", "[_,_]+model"), ("reduce_sum", "[_]")]),
    # linear consumers that would each need a psum: one psum of the shared value
    # (192 B) is cheaper than psums of both outputs (192 B + 6 B)
    ("fan-out into two psums", lambda x, w: (lambda y: (-(-y), jnp.sum(y)))(x @ w),
     [("dot_general", "[_,_]"), ("neg", "[_,_]"), ("neg", "[_,_]"),
      ("reduce_sum", "[]")]),
])
def test_pending_sums(name, fn, expected):
  assert _pending(fn, K_SPLIT, XW) == expected


def test_pending_sum_resolved_at_program_output():
  assert _pending(lambda x, w: x @ w, K_SPLIT, XW) == [("dot_general", "[_,_]")]


_F4, _B4 = jnp.zeros(4), jnp.zeros(4, bool)


@pytest.mark.parametrize("body, init, expected", [
    (lambda c, x: (c + x, None), _F4, {0}),                            # c + u
    (lambda c, x: (x + c, None), _F4, {0}),                            # u + c
    (lambda c, x: (c + x * c, None), _F4, set()),                      # c read twice
    (lambda c, x: ((c + x), (c + x).sum()), _F4, set()),               # the sum read again
    (lambda c, x: (c - x, None), _F4, {0}),                            # c - u
    (lambda c, x: (x - c, None), _F4, {0}),                            # u - c
    (lambda c, x: (c * x, None), _F4, set()),                          # not a sum
    (lambda c, x: ((c[0] + x, c[1] * x), None), (_F4, _F4), {0}),      # one of two
    (lambda c, x: ((c[0] + (x > 0), c[1] + x), None), (_B4, _F4), {1}),  # bool: no
])
def test_scan_accumulators(body, init, expected):
  """Which carries of a scan only accumulate (rules.control.accumulators):
  their sum may stay pending round the loop."""
  from gshard.spmd.rules.control import accumulators
  closed = jax.make_jaxpr(lambda c, xs: lax.scan(body, c, xs))(init, jnp.ones((3, 4)))
  (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
  p = eqn.params
  assert accumulators(p["jaxpr"].jaxpr, p["num_consts"], p["num_carry"]) == expected
