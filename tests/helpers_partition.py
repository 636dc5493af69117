"""Shared helpers of the partitioner tests (test_partition, test_structure,
test_partition_properties): cached meshes, tree comparison, a host-side block
reference, and a parser of the collectives in XLA's optimized HLO text.

The block reference and the HLO parser share no code with gshard: they are
written from jax's ``NamedSharding`` convention and XLA's text format.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import numpy as np
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gshard


@functools.lru_cache(maxsize=None)
def mesh(shape: tuple[int, ...], names: tuple[str, ...]):
  """``gshard.make_mesh`` on the first ``prod(shape)`` devices, built once."""
  return gshard.make_mesh(tuple(shape), tuple(names))


BATCH_MESHES = [((8,), ("x",)), ((2, 4), ("x", "y")), ((4, 2), ("x", "y"))]


def draw_batch(data, least: int = 1):
  """For the micro-batch properties: a mesh of :data:`BATCH_MESHES`, the
  batch's axes on it (one or two), ``n`` their devices, ``K`` micro-batches
  (from ``least``; below, at and above ``n``) and ``M``, a multiple of ``n``:
  ``(shape, names, sizes, axes, n, K, M)``."""
  shape, names = data.draw(st.sampled_from(BATCH_MESHES), label="mesh")
  sizes = dict(zip(names, shape))
  axes = data.draw(st.sampled_from([names[:1], names[-1:], names]), label="axes")
  n = math.prod(sizes[a] for a in axes)
  count = data.draw(st.integers(least, 2 * n + 1), label="K")
  rows = n * data.draw(st.integers(1, 2), label="rows per device")
  return shape, names, sizes, axes, n, count, rows


@st.composite
def specs_2d(draw, choices):
  """A PartitionSpec of a 2-D array: each dim one of ``choices`` (None, an axis
  or a tuple of axes), no mesh axis twice."""
  while True:
    d0, d1 = draw(st.sampled_from(choices)), draw(st.sampled_from(choices))
    used = [a for d in (d0, d1) if d for a in ((d,) if isinstance(d, str) else d)]
    if len(used) == len(set(used)):
      return P(d0, d1)


def assert_within_ulps(got, want, ulps: float) -> None:
  """Every leaf of ``got`` (unpadded) within ``ulps`` float32 ulps of the
  largest magnitude (at least 1) of the same leaf of ``want``."""
  for g, w in zip(jax.tree.leaves(gshard.unpad(got)), jax.tree.leaves(want)):
    g, w = np.asarray(g), np.asarray(w)
    assert np.abs(g - w).max() <= ulps * np.finfo(np.float32).eps * max(1.0, np.abs(w).max())


def assert_trees_close(got, want, rtol=1e-5, atol=1e-5, what=""):
  """Same tree structure; every leaf equal to tolerance (f32 reductions reorder).

  ``got`` is compared by its logical values: state gshard keeps split unevenly
  (a ``gshard.PaddedArray``) counts as the array it stands for."""
  got = gshard.unpad(got)
  got_leaves, got_tree = jax.tree_util.tree_flatten(got)
  want_leaves, want_tree = jax.tree_util.tree_flatten(want)
  assert got_tree == want_tree, f"{what}: tree {got_tree} != {want_tree}"
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(want)[0]]
  for path, g, w in zip(paths, got_leaves, want_leaves):
    assert np.shape(g) == np.shape(w), \
        f"{what}{path}: shape {np.shape(g)} != {np.shape(w)}"
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol,
                               err_msg=f"{what}{path}")


# -- the NamedSharding block convention, on the host ---------------------------

def spec_dims(spec, rank: int) -> list[tuple[str, ...]]:
  """``P("a", None, ("b", "c"))`` -> ``[("a",), (), ("b", "c")]`` padded to ``rank``."""
  out = []
  for e in list(spec) + [None] * (rank - len(spec)):
    out.append(() if e is None else (e,) if isinstance(e, str) else tuple(e))
  return out


def device_coords(m) -> dict[int, dict[str, int]]:
  """Device id -> its coordinate along each mesh axis."""
  out = {}
  for idx in np.ndindex(m.devices.shape):
    out[m.devices[idx].id] = dict(zip(m.axis_names, idx))
  return out


def block_slice(spec, shape, coords: dict[str, int], sizes: dict[str, int]) -> tuple:
  """The global slice a device at ``coords`` holds of an evenly split value.

  A dim split over ``(a1, a2)`` is cut into ``|a1|*|a2|`` equal blocks and the
  device at ``(i1, i2)`` holds block ``i1*|a2| + i2``.
  """
  out = []
  for n, axes in zip(shape, spec_dims(spec, len(shape))):
    k = math.prod(sizes[a] for a in axes)
    assert n % k == 0, f"dim {n} not divisible by {k} ({axes})"
    i = 0
    for a in axes:
      i = i * sizes[a] + coords[a]
    out.append(slice(i * (n // k), (i + 1) * (n // k)))
  return tuple(out)


def check_shards_against_reference(out: jax.Array, ref, spec, m, rtol=1e-5, atol=1e-5,
                                   what="") -> None:
  """Each device's shard of ``out`` equals the numpy block of ``ref`` it should hold."""
  ref = np.asarray(ref)
  sizes = dict(zip(m.axis_names, m.devices.shape))
  coords = device_coords(m)
  shards = out.addressable_shards
  assert sorted(s.device.id for s in shards) == sorted(coords), what
  for s in shards:
    want = block_slice(spec, ref.shape, coords[s.device.id], sizes)
    np.testing.assert_allclose(np.asarray(s.data), ref[want], rtol=rtol, atol=atol,
                               err_msg=f"{what} device {s.device.id} block {want}")


def assert_named_sharding(x, m, spec, what="") -> None:
  """``x`` is a global jax.Array laid out as ``NamedSharding(m, spec)``."""
  assert isinstance(x, jax.Array), f"{what}: {type(x)} is not a jax.Array"
  assert isinstance(x.sharding, NamedSharding), f"{what}: {x.sharding}"
  want = NamedSharding(m, spec)
  assert x.sharding.is_equivalent_to(want, x.ndim), \
      f"{what}: sharding {x.sharding.spec} != {spec}"


# -- collectives in XLA's optimized HLO -------------------------------------

_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
          "collective-permute", "collective-broadcast", "ragged-all-to-all")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
             "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
             "c128": 16}
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*"
    r"(?P<type>\((?:[^()]|\([^()]*\))*\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)"
    r"\s+(?P<op>" + "|".join(re.escape(k) for k in _KINDS) + r")(?P<async>-start)?\(")
_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class HloCollective:
  """One collective instruction of an HLO module.

  Attributes:
    kind: ``all-reduce``, ``all-gather`` ...
    axes: the mesh axes its replica groups span (sorted by mesh order).
    shapes: the (dtype, shape) of each array of its result (a tuple when XLA
      combined several collectives into one).
    groups: the replica groups as tuples of device ids.
  """

  kind: str
  axes: tuple[str, ...]
  shapes: tuple[tuple[str, tuple[int, ...]], ...]
  groups: tuple[tuple[int, ...], ...]

  @property
  def nbytes(self) -> int:
    return sum(_ITEMSIZE[d] * math.prod(s) for d, s in self.shapes)


def parse_replica_groups(line: str, num_devices: int) -> list[list[int]]:
  """The replica groups of one HLO instruction, both text formats.

  ``replica_groups={{0,4},{1,5}}`` lists them; ``replica_groups=[2,4]<=[8]`` is
  iota(8).reshape(2,4); ``[4,2]<=[2,4]T(1,0)`` transposes before the reshape;
  ``{}`` (or no attribute) is one group of every device.
  """
  m = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", line)
  if m:
    shape = [int(v) for v in m.group(1).split(",")]
    dims = [int(v) for v in m.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
      ids = ids.transpose([int(v) for v in m.group(3).split(",")])
    return ids.reshape(shape).tolist()
  m = re.search(r"replica_groups=\{(.*?)\}\}", line)
  if m:
    return [[int(v) for v in g.split(",") if v.strip()]
            for g in re.findall(r"\{([0-9,\s]*)", m.group(1) + "}")]
  return [list(range(num_devices))]


def groups_to_axes(groups, m, exact: bool = True) -> tuple[str, ...]:
  """The mesh axes a set of replica groups spans; with ``exact`` checks the
  groups are exactly the sub-meshes over those axes (not some other device set)."""
  coords = device_coords(m)
  sizes = dict(zip(m.axis_names, m.devices.shape))
  varying = set()
  for g in groups:
    for a in m.axis_names:
      if len({coords[d][a] for d in g}) > 1:
        varying.add(a)
  axes = tuple(a for a in m.axis_names if a in varying)
  if not exact:
    return axes
  expected = math.prod(sizes[a] for a in axes)
  for g in groups:
    assert len(g) == expected and len(set(g)) == len(g), \
        f"replica group {g} is not a sub-mesh over {axes} of {sizes}"
    fixed = {a: coords[g[0]][a] for a in m.axis_names if a not in varying}
    assert all(coords[d][a] == v for d in g for a, v in fixed.items()), \
        f"replica group {g} mixes coordinates of axes other than {axes}"
  return axes


def hlo_collectives(hlo_text: str, m) -> list[HloCollective]:
  """Every collective instruction of an optimized HLO module (async pairs once)."""
  out = []
  n = m.devices.size
  for line in hlo_text.splitlines():
    match = _INSTR.match(line)
    if not match:
      continue
    typ = match.group("type")
    arrays = tuple((d, tuple(int(v) for v in s.split(",") if v))
                   for d, s in _ARRAY.findall(typ))
    if match.group("async") and match.group("op") != "all-reduce":
      # an async start's tuple holds the operands and the results: keep the results
      arrays = arrays[len(arrays) // 2:]
    if "source_target_pairs" in line:   # collective-permute: pairs, not groups
      groups = [[int(v) for v in p.split(",")]
                for p in re.findall(r"\{([0-9]+,[0-9]+)\}", line)]
      axes = groups_to_axes(groups, m, exact=False)
    else:
      groups = parse_replica_groups(line, n)
      axes = groups_to_axes(groups, m)
    out.append(HloCollective(match.group("op"), axes, arrays,
                             tuple(tuple(g) for g in groups)))
  return out
