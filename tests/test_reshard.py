"""Tests of gshard.spmd.reshard: which collectives, what bytes, and the values.

Every value test feeds each device its own block (a ``[n_devices, *local]``
array stacked over all mesh axes), runs ``reshard`` inside ``jax.shard_map``
and reassembles the result on the host with numpy: a slow reference that
shares no code with the planner.
"""

import functools
import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AbstractMesh, AxisType, Mesh
from jax.sharding import PartitionSpec as P

import gshard
from gshard.spmd.collectives import apply_plan
from gshard.spmd.reshard import ReshardPlan, Step, plan_reshard, ppermute_pairs
from gshard.spmd.sharding import TensorSharding

SIZES_2x4 = {"data": 2, "model": 4}


def ts(*dims, partial=()):
  """``ts("data", None, ("data","model"), partial=["x"])``: a TensorSharding."""
  entries = [() if d is None else (d,) if isinstance(d, str) else tuple(d)
             for d in dims]
  return TensorSharding(tuple(entries), frozenset(partial))


# -- host-side reference ------------------------------------------------------

@functools.lru_cache(maxsize=None)
def make_mesh(shape, names):
  devices = np.array(jax.devices()[:math.prod(shape)]).reshape(shape)
  return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(shape))


def device_coords(names, shape):
  """Mesh coordinates of each device, in mesh (row-major) order."""
  return [dict(zip(names, c)) for c in itertools.product(*map(range, shape))]


def block_index(sharding, coords, sizes):
  """Per dim, the block this device holds: i1*|a2| + i2 for axes (a1, a2)."""
  out = []
  for axes in sharding.dims:
    i = 0
    for a in axes:
      i = i * sizes[a] + coords[a]
    out.append(i)
  return out


def block_slices(sharding, coords, sizes, global_shape):
  local = sharding.local_shape(global_shape, sizes)
  return tuple(slice(b * l, (b + 1) * l)
               for b, l in zip(block_index(sharding, coords, sizes), local))


def logical(shape):
  return tuple(slice(0, n) for n in shape)


def padding_mask(global_shape, padded_shape):
  """True where a padded array holds padding."""
  mask = np.ones(padded_shape, bool)
  mask[logical(global_shape)] = False
  return mask


def place(value, src, names, shape, rng, pad_value):
  """Per-device blocks ``[n_devices, *local]`` of ``value`` laid out as ``src``.

  A partial ``src`` gets random integer parts that sum to ``value`` over the
  partial axes. Padding holds ``pad_value`` (NaN: garbage that must never
  reach a logical position).
  """
  sizes = dict(zip(names, shape))
  padded = src.padded_shape(value.shape, sizes)
  partial = sorted(src.partial)
  n_parts = math.prod(sizes[a] for a in partial)
  parts = rng.integers(-9, 10, (n_parts, *padded)).astype(value.dtype)
  parts[(-1, *logical(value.shape))] = value - parts[:-1].sum(0)[
      logical(value.shape)]
  parts = np.where(padding_mask(value.shape, padded), pad_value, parts)
  blocks = []
  for c in device_coords(names, shape):
    k = 0
    for a in partial:
      k = k * sizes[a] + c[a]
    blocks.append(parts[k][block_slices(src, c, sizes, value.shape)])
  return np.stack(blocks)


def assemble(blocks, dst, names, shape, global_shape):
  """One padded global array per replica group (partial parts summed)."""
  sizes = dict(zip(names, shape))
  groups = {}
  for b, c in zip(blocks, device_coords(names, shape)):
    key = tuple(v for a, v in c.items() if a not in dst.axes | dst.partial)
    arr = groups.setdefault(
        key, np.zeros(dst.padded_shape(global_shape, sizes), blocks.dtype))
    arr[block_slices(dst, c, sizes, global_shape)] += b
  return list(groups.values())


@functools.lru_cache(maxsize=None)
def runner(names, shape, src, dst, global_shape, reverse_sizes=False, chunks_first=False):
  """jit(shard_map(reshard)); ``reverse_sizes`` hands reshard the mesh sizes
  in reverse mesh order (plans must not depend on that order); ``chunks_first``
  runs reduce-scatters and all-gathers on a leading dim of the chunks (the
  form gshard emits on CPU devices)."""
  mesh = make_mesh(shape, names)
  sizes = dict(zip(names, shape))
  if reverse_sizes:
    sizes = dict(reversed(sizes.items()))
  spec = P(names)

  def body(x_):
    plan = plan_reshard(src, dst, global_shape, x_.dtype, sizes)
    return apply_plan(x_[0], plan, global_shape, sizes, chunks_first)[None]

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                               check_vma=False))


def check_values(src, dst, global_shape, names=("data", "model"), shape=(2, 4),
                 seed=0, reverse_sizes=False, always_zero_padding=False,
                 chunks_first=False):
  """Run reshard with NaN padding (logical part exact) and zero padding
  (result padding zero too; with ``always_zero_padding`` even from NaN)."""
  rng = np.random.default_rng(seed)
  sizes = dict(zip(names, shape))
  global_shape = tuple(global_shape)
  value = rng.integers(-9, 10, global_shape).astype(np.float32)
  run = runner(names, shape, src, dst, global_shape, reverse_sizes, chunks_first)
  for pad_value in (np.nan, 0.0):
    stacked = place(value, src, names, shape, rng, pad_value)
    out = np.asarray(run(stacked))
    assert out.shape[1:] == dst.local_shape(global_shape, sizes)
    for full in assemble(out, dst, names, shape, global_shape):
      np.testing.assert_array_equal(full[logical(global_shape)], value)
      if pad_value == 0.0 or always_zero_padding:
        assert not full[padding_mask(global_shape, full.shape)].any()


# -- the reshard matrix on a (data=2, model=4) mesh ---------------------------

MATRIX = [
    # (src, dst, step kinds)
    (ts(None, None), ts(None, None), ()),
    (ts("model", None), ts("model", None), ()),
    (ts(None, None), ts("model", None), ("slice",)),
    (ts(None, None), ts(("data", "model"), None), ("slice",)),
    (ts(None, None), ts("data", "model"), ("slice", "slice")),
    (ts("model", None), ts(None, None), ("all_gather",)),
    (ts(("data", "model"), None), ts(None, None), ("all_gather",)),
    (ts(("data", "model"), None), ts("data", None), ("all_gather",)),
    (ts("data", "model"), ts(None, None), ("all_gather", "all_gather")),
    (ts("model", None), ts(None, "model"), ("all_to_all",)),
    (ts(("data", "model"), None), ts(None, ("data", "model")), ("all_to_all",)),
    (ts("data", None), ts("data", "model"), ("slice",)),
    (ts(None, None, partial=["model"]), ts(None, None), ("psum",)),
    (ts(None, None, partial=["data", "model"]), ts(None, None), ("psum",)),
    (ts(None, None, partial=["model"]), ts("model", None), ("psum_scatter",)),
    (ts(None, None, partial=["data", "model"]), ts(("data", "model"), None),
     ("psum_scatter",)),
    (ts(None, None, partial=["data", "model"]), ts(None, "model",
                                                   partial=["data"]),
     ("psum_scatter",)),
    (ts("data", None, partial=["model"]), ts(("data", "model"), None),
     ("psum_scatter",)),
    (ts(None, None, partial=["model"]), ts(None, None, partial=["model"]), ()),
    (ts(("data", "model"), None), ts(("model", "data"), None), ("ppermute",)),
    (ts(("data", "model"), None), ts("model", None),
     ("ppermute", "all_gather")),
    (ts("data", None), ts(None, "model"), ("slice", "all_gather")),
    (ts("data", None), ts("model", None),
     ("slice", "ppermute", "all_gather")),
]


def _id(case):
  src, dst, _ = case
  return f"{src}->{dst}"


@pytest.mark.parametrize("chunks_first", [False, True])
@pytest.mark.parametrize("case", MATRIX, ids=map(_id, MATRIX))
def test_matrix_kinds_and_values(case, chunks_first):
  src, dst, kinds = case
  plan = plan_reshard(src, dst, (8, 16), np.float32, SIZES_2x4)
  assert plan.kinds == kinds, str(plan)
  assert not plan.fallback
  assert plan.bytes_per_device == sum(s.bytes_per_device for s in plan.steps)
  check_values(src, dst, (8, 16), chunks_first=chunks_first)


@pytest.mark.parametrize("case", MATRIX[:12], ids=map(_id, MATRIX[:12]))
def test_matrix_uneven_values(case):
  """5 and 6 are multiples of neither 4 nor 8: every dim is padded."""
  src, dst, _ = case
  check_values(src, dst, (5, 6), seed=1)


# -- bytes: the ring formulas -------------------------------------------------
# f32[8,16] is 512 B; split 4 ways on dim 0 it is 128 B per device.

@pytest.mark.parametrize("src, dst, nbytes", [
    (ts("model", None), ts(None, None), 3 * 128),          # (n-1)/n * S_out
    (ts(("data", "model"), None), ts(None, None), 7 * 64),
    (ts(None, None, partial=["model"]), ts(None, None), 2 * 3 * 512 // 4),
    (ts(None, None, partial=["model"]), ts("model", None), 3 * 512 // 4),
    (ts("model", None), ts(None, "model"), 3 * 128 // 4),   # (n-1)/n * S
    (ts(("data", "model"), None), ts(("model", "data"), None), 64),  # S
    (ts(None, None), ts("model", None), 0),
])
def test_bytes(src, dst, nbytes):
  plan = plan_reshard(src, dst, (8, 16), "float32", SIZES_2x4)
  assert plan.bytes_per_device == nbytes, str(plan)


def test_step_fields():
  plan = plan_reshard(ts("model", None), ts(None, "model"), (8, 16),
                      "float32", SIZES_2x4)
  assert plan.steps == (Step("all_to_all", ("model",), None, 96, src_dim=0,
                             dst_dim=1),)
  assert str(plan) == "[model,_] -> [_,model]: all_to_all(model) dim 0->1: 96 B"
  gather = plan_reshard(ts(("data", "model"), None), ts(None, None), (8, 16),
                        "bfloat16", SIZES_2x4)
  assert gather.steps == (Step("all_gather", ("data", "model"), 0, 7 * 32),)


def test_uneven_pads():
  """Replicated -> split of 5 over 4 pads to 8 first (zeros), then slices."""
  plan = plan_reshard(ts(None), ts("model"), (5,), "float32", SIZES_2x4)
  assert plan.kinds == ("pad", "slice")
  assert plan.steps[0].length == 8
  back = plan_reshard(ts("model"), ts(None), (5,), "float32", SIZES_2x4)
  assert back.kinds == ("all_gather", "pad")   # 8 -> 5
  assert back.steps[1].length == 5


def test_fallback_reported():
  """5 rows over data (blocks of 3) to data*model (blocks of 1): block
  boundaries move, so the dim is gathered whole and sliced again."""
  plan = plan_reshard(ts("data", None), ts(("data", "model"), None), (5, 1),
                      "float32", SIZES_2x4)
  assert plan.fallback, str(plan)
  check_values(ts("data", None), ts(("data", "model"), None), (5, 1))


def test_pad_steps_zero_the_padding():
  """Rows 5..7 of the gathered f32[8] are garbage; the pad to 6 zeroes row 5."""
  src, dst = ts(("data", "model")), ts("data")
  plan = plan_reshard(src, dst, (5,), "float32", SIZES_2x4)
  assert plan.kinds == ("all_gather", "pad", "slice")
  check_values(src, dst, (5,), always_zero_padding=True)
  check_values(ts(None, None), ts("model", "data"), (5, 3),
               always_zero_padding=True)


def test_size_one_axes_are_trivial():
  sizes = {"one": 1, "model": 4}
  plan = plan_reshard(ts(("one", "model")), ts("model", partial=["one"]), (8,),
                      "float32", sizes)
  assert plan.steps == ()


def test_ppermute_pairs_swap():
  pairs = ppermute_pairs([("a", "b")], [("b", "a")], ("a", "b"),
                         {"a": 2, "b": 2})
  assert sorted(pairs) == [(0, 0), (1, 2), (2, 1), (3, 3)]


def test_ppermute_with_axes_out_of_mesh_order():
  """A ppermute over (model, data) on a (data, model) mesh, with the mesh
  sizes given in either order."""
  for reverse in (False, True):
    check_values(ts(("model", "data"), None), ts(("data", "model"), None),
                 (8, 2), reverse_sizes=reverse)
    check_values(ts("model", "data"), ts("data", "model"), (4, 8),
                 reverse_sizes=reverse)


def test_3d_mesh_values():
  names, shape = ("x", "y", "z"), (2, 2, 2)
  for src, dst in [(ts(("x", "y", "z"), None), ts(("z", "x"), "y")),
                   (ts("x", "y", partial=["z"]), ts(("y", "z"), None)),
                   (ts(None, ("z", "y"), partial=["x"]), ts(("x", "z"), "y"))]:
    plan = plan_reshard(src, dst, (4, 6), "float32", dict(zip(names, shape)))
    assert not plan.fallback, str(plan)
    check_values(src, dst, (4, 6), names, shape)


def test_ppermute_step_numbers_devices_by_its_axes():
  """jax numbers a multi-axis ppermute's devices in mesh order; a Step numbers
  them in the order of its ``axes``: apply_plan must translate."""
  layout = ts(("model", "data"))
  shift = tuple((i, (i + 1) % 8) for i in range(8))
  plan = ReshardPlan(layout, layout, (Step("ppermute", ("model", "data"),
                                           perm=shift),), 0, False)
  mesh, sizes = make_mesh((2, 4), ("data", "model")), SIZES_2x4
  spec = P(("model", "data"))
  run = jax.jit(jax.shard_map(lambda x_: apply_plan(x_, plan, (8,), sizes),
                              mesh=mesh, in_specs=spec, out_specs=spec,
                              check_vma=False))
  x = np.arange(8, dtype=np.float32)
  np.testing.assert_array_equal(np.asarray(run(x)), np.roll(x, 1))


# -- errors -------------------------------------------------------------------

def test_cannot_create_partial_sums():
  with pytest.raises(ValueError, match=r"destination is a pending partial sum "
                     r"over \['model'\] but the source is not"):
    plan_reshard(ts(None), ts(None, partial=["model"]), (8,), "float32",
                 SIZES_2x4)


def test_rank_mismatch():
  with pytest.raises(ValueError, match="reshard source: the sharding"):
    plan_reshard(ts(None), ts(None, None), (8, 8), "float32", SIZES_2x4)


def test_unknown_axis():
  with pytest.raises(ValueError, match="mesh axis 'expert' is not in the mesh"):
    plan_reshard(ts("expert"), ts(None), (8,), "float32", SIZES_2x4)


def test_apply_plan_checks_local_shape():
  plan = plan_reshard(ts("model"), ts(None), (8,), "float32", SIZES_2x4)
  with pytest.raises(ValueError, match=r"local block has shape \(8,\) but "
                     r"source sharding \[model\].*gives local shape \(2,\)"):
    apply_plan(np.zeros(8, np.float32), plan, (8,), SIZES_2x4)


# -- random meshes, shapes and shardings --------------------------------------

MESH_SHAPES = [s for r in (1, 2, 3)
               for s in itertools.product(range(1, 9), repeat=r)
               if math.prod(s) <= 8 and math.prod(s) > 1]


@st.composite
def problems(draw, standard=False):
  """(names, mesh shape, global shape, src, dst); ``standard`` draws only
  the cases GSPMD handles without a full gather."""
  shape = draw(st.sampled_from(MESH_SHAPES))
  names = ("x", "y", "z")[:len(shape)]
  rank = draw(st.integers(1 if standard else 0, 3))
  global_shape = tuple(draw(st.lists(st.integers(1, 9), min_size=rank,
                                     max_size=rank)))
  if standard:
    src, dst = draw(_standard_pair(names, rank))
  else:
    src = draw(_sharding(names, rank, ["partial"]))
    dst = draw(_sharding(names, rank, sorted(src.partial)))
  return names, shape, global_shape, src, dst


@st.composite
def _sharding(draw, names, rank, may_be_partial):
  """Each axis unused, on a dim, or (if allowed) partial; random order."""
  dims, partial = [[] for _ in range(rank)], []
  for a in names:
    where = draw(st.sampled_from(["none", *range(rank)] + (
        ["partial"] if "partial" in may_be_partial or a in may_be_partial
        else [])))
    if where == "partial":
      partial.append(a)
    elif where != "none":
      dims[where].append(a)
  dims = [draw(st.permutations(d)) for d in dims]
  return TensorSharding(tuple(map(tuple, dims)), frozenset(partial))


@st.composite
def _standard_pair(draw, names, rank):
  kind = draw(st.sampled_from(["gather", "slice", "move", "reduce"]))
  if kind == "gather":
    return draw(_sharding(names, rank, [])), TensorSharding.replicated(rank)
  if kind == "slice":
    return TensorSharding.replicated(rank), draw(_sharding(names, rank, []))
  if kind == "reduce":
    dst = draw(_sharding(names, rank, ["partial"]))
    return TensorSharding.replicated(rank).with_partial(
        dst.axes | dst.partial), dst
  dims = list(draw(_sharding(names, rank, [])).dims)   # move dim i to j
  i, j = draw(st.permutations(range(rank)).map(lambda p: (p[0], p[-1])))
  dims[j] = ()
  src = TensorSharding(tuple(dims))
  dims[j], dims[i] = dims[i], ()
  return src, TensorSharding(tuple(dims))


def _check_plan(names, shape, global_shape, src, dst):
  sizes = dict(zip(names, shape))
  plan = plan_reshard(src, dst, global_shape, "float32", sizes)
  if src == dst:                 # nothing to move
    assert plan.bytes_per_device == 0
  assert plan.bytes_per_device == sum(s.bytes_per_device for s in plan.steps)
  assert all(s.bytes_per_device == 0 for s in plan.steps if not s.is_collective)
  return plan


@settings(max_examples=40, deadline=None)
@given(problems(), st.booleans())
def test_random_reshard(problem, chunks_first):
  names, shape, global_shape, src, dst = problem
  _check_plan(names, shape, global_shape, src, dst)
  check_values(src, dst, global_shape, names, shape, chunks_first=chunks_first)


def _inner(plan) -> bool:
  return any(s.kind in ("psum_scatter", "all_gather") and s.dim > 0 for s in plan.steps)


@settings(max_examples=25, deadline=None)
@given(problems().filter(lambda p: _inner(plan_reshard(p[3], p[4], p[2], "float32",
                                                       dict(zip(p[0], p[1]))))),
       st.integers(0, 2**31 - 1))
def test_chunks_first_gives_the_same_floats(problem, seed):
  """A reduce-scatter or all-gather onto an inner dim, on its chunks' leading
  dim (gshard's form on CPU devices) or as is: the same blocks, bit for bit,
  for floats whose partial sums round (each element is summed over the same
  devices in the same order either way)."""
  names, shape, global_shape, src, dst = problem
  rng = np.random.default_rng(seed)
  sizes = dict(zip(names, shape))
  stacked = rng.standard_normal((math.prod(shape), *src.local_shape(global_shape, sizes)),
                                dtype=np.float32)
  a, b = (np.asarray(runner(names, shape, src, dst, global_shape, False, c)(stacked))
          for c in (False, True))
  np.testing.assert_array_equal(a, b)


def test_chunks_first_runs_on_a_leading_dim_on_cpu_devices_only():
  """On a mesh of CPU devices the program's reduce-scatter and all-gather of an
  inner dim run on a leading dim; lowered for an AbstractMesh they stay as
  they are. The values are jax.jit's."""
  def f(x, w):
    y = gshard.shard(x @ w, P(None, "model"))        # partial over model: scatter dim 1
    return gshard.shard(y * 2.0, P(None, None))      # gather dim 1
  rng = np.random.default_rng(0)
  x = rng.integers(-4, 5, (8, 16)).astype(np.float32)
  w = rng.integers(-4, 5, (16, 32)).astype(np.float32)
  specs = (P(None, "model"), P("model", None))

  def dims(text, op, attr):
    return [int(m) for line in text.splitlines() if f"stablehlo.{op}" in line
            for m in re.findall(attr + r" = (\d+)", line)]
  m = make_mesh((2, 4), ("data", "model"))
  step = gshard.partition(f, m, in_specs=specs)
  text = step.lower(x, w).as_text()
  assert dims(text, "reduce_scatter", "scatter_dimension") == [0]
  assert dims(text, "all_gather", "all_gather_dim") == [0]
  np.testing.assert_array_equal(np.asarray(step(x, w)), np.asarray(jax.jit(f)(x, w)))
  am = AbstractMesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, w)]
  text = gshard.partition(f, am, in_specs=specs).lower(*structs, platform="cpu").as_text()
  assert dims(text, "reduce_scatter", "scatter_dimension") == [1]
  assert dims(text, "all_gather", "all_gather_dim") == [1]


@settings(max_examples=30, deadline=None)
@given(problems(standard=True))
def test_standard_cases_never_fall_back(problem):
  names, shape, global_shape, src, dst = problem
  plan = _check_plan(names, shape, global_shape, src, dst)
  assert not plan.fallback, str(plan)
  check_values(src, dst, global_shape, names, shape)


@settings(max_examples=200, deadline=None)
@given(problems())
def test_random_plans_only(problem):
  """Planning alone (no compile): many more cases, all must plan."""
  _check_plan(*problem)


# -- an XLA verifier failure the executor keeps clear of --------------------------

def _built_then_moved(kind: str, extra: int):
  """A transposed outer product (XLA gives it a transposed layout), padded or
  concatenated with zeros, then moved from a split of dim 1 to a split of dim
  0: an all-to-all whose operand XLA splits per piece."""
  def f(x, y):
    z = jnp.outer(x, y).T
    if kind == "pad":
      w = jnp.pad(z, ((0, extra), (0, 0)))
    else:
      w = jnp.concatenate([z, jnp.zeros((extra, z.shape[1]), z.dtype)])
    return gshard.shard(gshard.shard(w, P(None, "b")), P("b", None))
  return f


@settings(max_examples=12, deadline=None)
@given(st.sampled_from(["pad", "concat"]), st.integers(1, 2), st.integers(2, 4),
       st.sampled_from([2, 4]), st.sampled_from([np.float32, np.int32]))
def test_an_all_to_all_of_a_padded_transposed_product_compiles(kind, extra, m, k, dtype):
  """XLA (jaxlib 0.10.2) rejected such a program ("all-to-all has operands
  with different shapes: f32[2,2] ... f32[2,2]"; found by the fuzzer in a
  gradient, padded for an uneven split). Values equal jax.jit's, bitwise
  (each element is one product)."""
  mesh = make_mesh((2, 2), ("a", "b"))
  f = _built_then_moved(kind, extra)
  x = (np.arange(m) + 1).astype(dtype)
  y = (np.arange(k) - 1).astype(dtype)
  step = gshard.partition(f, mesh)
  # (an output that does not divide the mesh is gathered where it leaves)
  assert [c.kind for c in step.lower(x, y).collectives()
          if not c.role.startswith("output")] == ["all_to_all"]
  np.testing.assert_array_equal(np.asarray(step(x, y)), np.asarray(jax.jit(f)(x, y)))
