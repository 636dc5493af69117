"""gshard.gspmd_jit: the GSPMD baseline that benchmarks/ measures gshard against,
and the HLO collective parser the benchmark counts bytes with."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gshard
from benchmarks import hlo
from examples import models as M


@pytest.fixture(scope="module")
def mesh():
  return gshard.make_mesh((2, 4), ("data", "model"))


def _max_diff(a, b):
  return max(jax.tree.leaves(jax.tree.map(
      lambda u, v: float(jnp.max(jnp.abs(u - v))), a, b)))


def test_mlp_step_same_numbers_as_plain_function(mesh):
  params = M.mlp_init(jax.random.PRNGKey(0), 16, 64)
  x = jax.random.normal(jax.random.PRNGKey(1), (8, 16))
  y = jax.random.normal(jax.random.PRNGKey(2), (8, 16))
  step = M.sgd_step(M.mlp_loss)
  base = gshard.gspmd_jit(step, mesh, in_specs=(M.MLP_SPECS, P("data"), P("data")))
  out = base(params, x, y)
  ref = step(params, x, y)   # annotations are identities outside gshard
  assert _max_diff(out, ref) < 1e-5
  new_params, _ = out
  assert new_params["w1"].sharding.spec == P(None, "model")
  assert out[0]["w1"].sharding.mesh.shape == mesh.shape


def test_gpt_loss_same_numbers_and_constraints_in_stablehlo(mesh):
  params = M.gpt_init(jax.random.PRNGKey(0))
  tok = jax.random.randint(jax.random.PRNGKey(1), (8, 16), 0, 128)
  tgt = jax.random.randint(jax.random.PRNGKey(2), (8, 16), 0, 128)
  base = gshard.gspmd_jit(jax.value_and_grad(M.gpt_loss), mesh,
                          in_specs=(M.gpt_specs(params), P("data"), P("data")))
  out = base(params, tok, tgt)
  ref = jax.jit(jax.value_and_grad(M.gpt_loss))(params, tok, tgt)
  assert _max_diff(out, ref) < 1e-4
  text = base.lower(params, tok, tgt).as_text()
  n = text.count("sdy.sharding_constraint") + text.count("@Sharding")
  # one split of the tokens plus per layer: q (attention) and h (MLP hidden)
  assert n >= 1 + 2 * len(params["layers"]), text[:2000]
  assert "sharding_annotation" not in text


def test_annotations_become_constraints_and_gshard_is_untouched(mesh):
  def f(x):
    x = gshard.split(x, 0, "data")
    y = gshard.shard(x * 2, P(None, "model"))
    z = gshard.shard(y + 1, P("data", P.UNCONSTRAINED))
    return gshard.replicate(z.sum(0))

  x = jnp.arange(32.0).reshape(8, 4)
  base = gshard.gspmd_jit(f, mesh)
  np.testing.assert_allclose(base(x), f(x))
  jaxpr = str(jax.make_jaxpr(base)(x))
  assert jaxpr.count("sharding_constraint") == 4, jaxpr
  assert "sharding_annotation" not in jaxpr
  # outside gspmd_jit the annotation primitive is bound again
  assert "sharding_annotation" in str(jax.make_jaxpr(f)(x))
  # gshard.partition is unaffected and agrees
  np.testing.assert_allclose(gshard.partition(f, mesh)(x), f(x))


def test_validation_kept(mesh):
  base = gshard.gspmd_jit(lambda x: gshard.split(x, 0, "nope"), mesh)
  with pytest.raises(ValueError, match="not in the mesh"):
    base(jnp.ones((8, 4)))


def test_in_and_out_specs(mesh):
  base = gshard.gspmd_jit(lambda a, b: (a + b, a * b), mesh,
                          in_specs=(P("data"), None), out_specs=(P(None, "model"), None))
  a = jnp.ones((8, 8))
  b = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("model")))
  s, p = base(a, b)
  assert s.sharding.spec == P(None, "model")
  np.testing.assert_allclose(p, a * b)


# -- the HLO parser of benchmarks/hlo.py --------------------------------------------

_HLO = """
HloModule m
ENTRY %main (p0: f32[8,128], p1: f32[4,4]) -> f32[8,128] {
  %p0 = f32[8,128]{1,0} parameter(0)
  %p1 = f32[4,4]{1,0} parameter(1)
  %ar = f32[8,128]{1,0} all-reduce(%p0), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add
  %art = (f32[8,128]{1,0}, f32[4,4]{1,0}) all-reduce(%ar, %p1), channel_id=2, replica_groups=[2,4]<=[8], to_apply=%add
  %am = f32[4,4]{1,0} all-reduce(%p1), channel_id=3, replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_2'}, to_apply=%max
  %ags = (f32[4,4]{1,0}, f32[16,4]{1,0}) all-gather-start(%p1), channel_id=4, replica_groups=[2,4]<=[8], dimensions={0}
  %agd = f32[16,4]{1,0} all-gather-done(%ags)
  %rs = f32[1,4]{1,0} reduce-scatter(%p1), channel_id=5, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, to_apply=%add
  %a2a = f32[4,4]{1,0} all-to-all(%p1), channel_id=6, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %cp = f32[4,4]{1,0} collective-permute(%p1), channel_id=7, source_target_pairs={{0,1},{1,0}}
  ROOT %ars = f32[8,128]{1,0} all-reduce-start(%p0), channel_id=8, replica_groups={}, to_apply=%add
}
"""


def test_hlo_parser_kinds_groups_and_bytes():
  cols = hlo.collectives(_HLO, 8)
  got = [(c.kind, c.group_size, c.operand_bytes, c.bytes_sent) for c in cols]
  s, w = 8 * 128 * 4, 4 * 4 * 4
  assert got == [
      ("all-reduce", 2, s, 2 * 1 / 2 * s),
      ("all-reduce", 4, s + w, 2 * 3 / 4 * (s + w)),        # tuple-merged
      ("all-reduce", 4, w, 2 * 3 / 4 * w),                  # named mesh axes
      ("all-gather", 4, w, 3 / 4 * 4 * w),                  # async start, S_out = 4 S_in
      ("reduce-scatter", 4, w, 3 / 4 * w),                  # transposed iota
      ("all-to-all", 8, w, 7 / 8 * w),
      ("collective-permute", 8, w, w),
      ("all-reduce", 8, s, 2 * 7 / 8 * s),                  # replica_groups={}
  ]



def test_hlo_replica_groups_in_every_spelling():
  """Explicit, iota (transposed or not) and named-mesh groups read as the same
  device sets; ``same_program`` compares modules modulo names, channel ids and
  how XLA spelled the groups."""
  lines = {k.split(" = ")[0].strip().removeprefix("ROOT "): k for k in _HLO.splitlines()
           if "replica_groups" in k}
  g = lambda name: hlo.replica_groups(lines[name], 8)     # noqa: E731
  assert g("%ar") == ((0, 4), (1, 5), (2, 6), (3, 7))
  assert g("%art") == ((0, 1, 2, 3), (4, 5, 6, 7))
  assert g("%am") == ((0, 1, 2, 3), (4, 5, 6, 7))
  assert g("%rs") == ((0, 2, 4, 6), (1, 3, 5, 7))
  assert g("%ars") == (tuple(range(8)),)
  sub = "x = f32[4] all-reduce(%p), replica_groups=mesh['a'=2,'b'=4] {'b':(1)2}, to_apply=%add"
  # 'b':(1)2: the major half of b (b = 2 x 2, the first factor)
  assert hlo.replica_groups(sub, 8) == ((0, 2), (1, 3), (4, 6), (5, 7))
  # the mesh's devices reordered (a tuple of axes not in mesh order, P(("b", "a"))):
  # devices [0,1,4,5,2,3,6,7] at the mesh's positions; read as one group of 1, 0 B
  perm = ("x = f32[8,16] all-gather(%p), replica_groups=mesh['axis_0'=4,'axis_1'=1,"
          "'axis_2'=2], device_ids=([2,2,2]T(1,0,2)) {'axis_0'}, dimensions={0}")
  assert hlo.replica_groups(perm, 8) == ((0, 2, 4, 6), (1, 3, 5, 7))
  assert hlo.group_size(perm, 8) == 4
  listed = perm.replace("([2,2,2]T(1,0,2))", "(0,1,4,5,2,3,6,7)")
  assert hlo.replica_groups(listed, 8) == ((0, 2, 4, 6), (1, 3, 5, 7))
  explicit = _HLO.replace("replica_groups=[2,4]<=[8]", "replica_groups={{0,1,2,3},{4,5,6,7}}")
  assert hlo.same_program(_HLO, explicit.replace("channel_id=2", "channel_id=9"), 8)
  assert not hlo.same_program(_HLO, _HLO.replace("replica_groups=[2,4]<=[8], to",
                                                 "replica_groups=[4,2]<=[8], to"), 8)

def test_hlo_parser_on_a_compiled_program(mesh):
  f = jax.jit(lambda x: x.sum(0), in_shardings=NamedSharding(mesh, P(("data", "model"))))
  text = f.lower(jnp.ones((8, 256))).compile().as_text()
  cols = hlo.collectives(text, 8)
  assert sum(c.bytes_sent for c in cols) == pytest.approx(2 * 7 / 8 * 256 * 4)


def test_hlo_parser_counts_a_loop_body_once_per_trip(mesh):
  """A collective inside a loop runs once per iteration: ``executions`` is
  the trip count (nested loops multiplied), ``bytes_sent`` of the module sums
  ``total``; one outside any loop runs once."""
  def body(x):
    def outer(c, _):
      def inner(c, _):
        return jax.lax.psum(c, "data") * 0.5, None
      c, _ = jax.lax.scan(inner, c, None, length=3)
      return c, None
    y, _ = jax.lax.scan(outer, x, None, length=5)
    return jax.lax.psum(y, "model")
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
  text = f.lower(jnp.ones((4, 64))).compile().as_text()
  cols = hlo.collectives(text, 8)
  per = {c.group_size: c for c in cols}
  assert per[2].executions == 15 and per[4].executions == 1, cols
  size = 4 * 64 * 4
  assert per[2].total == pytest.approx(15 * 2 * 1 / 2 * size)
  assert hlo.bytes_sent(text, 8) == pytest.approx(15 * size + 2 * 3 / 4 * size)
