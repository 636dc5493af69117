"""Windowed einsum (``gshard.partition(..., windowed_einsum=bytes)``).

A ``dot_general`` whose plan all-gathers an operand on a dim (or
reduce-scatters its result) runs as a ring of ``ppermute`` steps instead
(``gshard/spmd/partition/windowed_einsum.py``). Checked here:

* values and gradients equal the one-device ``jax.jit`` program, on random
  meshes, dimension numbers, shapes and dtypes (hypothesis), NaN positions
  included; the tolerance is derived below (:func:`assert_matches`);
* structure: ``n-1`` collective-permutes and no all-gather with the option on,
  the all-gather with it off, the same bytes recorded;
* memory: the compiled program's temp memory is lower with the ring, by a
  margin derived from the block sizes;
* the threshold, the fallbacks (uneven dims, below the threshold) and the
  argument's errors; inside ``lax.scan`` and ``lax.cond`` bodies.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import PartitionSpec as P

import gshard
from helpers_partition import hlo_collectives, mesh

pytestmark = pytest.mark.filterwarnings("error::gshard.PartitionWarning")

# The ring runs over an axis of 4 or more devices: over 2, its two blocks are
# the whole gathered operand and the plan's gather is kept (no memory to save).
MESHES = [((8,), ("x",)), ((4,), ("x",)), ((2, 4), ("x", "y")), ((4, 2), ("x", "y"))]
U = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8}     # unit roundoff
C = 8.0


def windowed(lowered) -> list:
  """The ppermutes gshard recorded for windowed einsums."""
  return [c for c in lowered.collectives() if "windowed einsum" in c.role]


# -- one dot_general, its value and its gradients ------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
  """``lax.dot_general(a, b, dn)``: ``a`` split on a free dim over ``axis``, ``b``
  on a free dim over the same axis; optionally the other mesh axis ``other`` on
  a batch dim, a contracting dim or a second free dim of ``a`` (``where``)."""

  mesh_shape: tuple[int, ...]
  names: tuple[str, ...]
  a_shape: tuple[int, ...]
  b_shape: tuple[int, ...]
  dn: tuple
  a_spec: tuple
  b_spec: tuple
  dtype: str
  seed: int
  nans: bool = False
  grads_like_inputs: bool = False    # out_specs: each gradient laid out as its input


def vjp_of(dn):
  """``(a, b, c) -> (a.b, c.(d/da), c.(d/db))``: the value and the gradients,
  every one of them a dot_general (bilinear in its two inputs)."""
  def h(a, b, c):
    y, back = jax.vjp(lambda a, b: lax.dot_general(a, b, dn), a, b)
    return (y, *back(c))
  return h


def numpy_vjp(dn, a, b, c):
  """:func:`vjp_of` in float64 numpy, as einsums: ``y = ab``, ``da = c b``,
  ``db = a c`` over the factors each pair shares (shares no code with jax)."""
  (lc, rc), (lb, rb) = dn
  names = iter("abcdefghijklmnopqrstuvwxyz")
  sa, sb = [None] * a.ndim, [None] * b.ndim
  for i, j in list(zip(lb, rb)) + list(zip(lc, rc)):
    sa[i] = sb[j] = next(names)
  sa = [x or next(names) for x in sa]
  sb = [x or next(names) for x in sb]
  sy = [sa[i] for i in lb] + [x for i, x in enumerate(sa) if i not in lb and i not in lc] + \
      [x for j, x in enumerate(sb) if j not in rb and j not in rc]
  sa, sb, sy = "".join(sa), "".join(sb), "".join(sy)
  return (np.einsum(f"{sa},{sb}->{sy}", a, b), np.einsum(f"{sy},{sb}->{sa}", c, b),
          np.einsum(f"{sa},{sy}->{sb}", a, c))


def exact_of(dn):
  return lambda a, b, c: numpy_vjp(dn, a, b, c)


def inputs(case: Case):
  rng = np.random.default_rng(case.seed)
  dt = jnp.dtype(case.dtype)
  a = rng.standard_normal(case.a_shape)
  b = rng.standard_normal(case.b_shape)
  if case.nans:
    a.flat[rng.integers(0, a.size, 2)] = np.nan
    b.flat[rng.integers(0, b.size, 1)] = np.nan
  y = jax.eval_shape(lambda a, b: lax.dot_general(a, b, case.dn),
                     jax.ShapeDtypeStruct(case.a_shape, dt), jax.ShapeDtypeStruct(case.b_shape, dt))
  c = rng.standard_normal(y.shape)
  return [jnp.asarray(v, dt) for v in (a, b, c)]


def assert_matches(got, want, args, exact_fn, dtype: str, what: str):
  """Each leaf of ``got`` (partitioned) matches ``want`` (one device, jit).

  Derivation (as ``tests/fuzzcheck.py``). Let ``o = exact_fn(*args)`` be the
  float64 numpy result on the same (exactly upcast) inputs, ``u`` the unit
  roundoff of ``dtype`` and ``S = exact_fn`` of their absolute values: every
  output is a dot (the value and gradients of one, :func:`numpy_vjp`), so
  ``S`` is exactly the sum of the magnitudes of the products each element
  adds. Any order of that sum, in precision ``u`` with results rounded to
  ``dtype``, errs by a small multiple of ``u S`` (first-order rounding
  analysis); the one-device program is one such order, and the partitioned
  one (ring steps, split contractions then psum, f32 accumulation of 16-bit
  partial products) another, so an element passes if ``|p - o| <= 2 |s - o| +
  C u S``, ``C = 8`` (a local dot, a cross-device sum of depth <= 3, the casts).
  A misplaced block of rows errs by about the size of the values; the bound's
  median is checked to stay below half their root mean square, so it can
  fail (``test_the_bound_catches_a_misplaced_block``). NaN positions must be
  equal.
  """
  up = [np.asarray(x, np.float64) for x in args]
  exact = exact_fn(*up)
  scale = exact_fn(*[np.abs(x) for x in up])
  u = U[dtype]
  for k, (p, s, o, S) in enumerate(zip(got, want, exact, scale)):
    p, s = np.asarray(p, np.float64), np.asarray(s, np.float64)
    assert p.shape == s.shape, (what, k)
    np.testing.assert_array_equal(np.isnan(p), np.isnan(s), err_msg=f"{what} leaf {k} NaNs")
    ok = ~np.isnan(s)
    bound = 2 * np.abs(s - o) + C * u * S
    err = np.abs(p - o)
    bad = ok & ~(err <= bound)
    assert not bad.any(), (f"{what} leaf {k}: {int(bad.sum())} elements off, worst "
                           f"{float(np.max(err[bad]))} > bound {float(bound[bad][0])}")
    if ok.any():    # a rounding bound: far below what a misplaced block changes
      rms = float(np.sqrt(np.mean(o[ok] ** 2)))
      assert np.median(bound[ok]) < 0.5 * rms, (what, k, float(np.median(bound[ok])), rms)


def run_case(case: Case, threshold=0):
  """Partition the value-and-gradients of ``case``'s dot with the ring; return
  the Lowered after checking the results against one device."""
  m = mesh(case.mesh_shape, case.names)
  fn = vjp_of(case.dn)
  args = inputs(case)
  out_specs = (None, P(*case.a_spec), P(*case.b_spec)) if case.grads_like_inputs else None
  step = gshard.partition(fn, m, in_specs=(P(*case.a_spec), P(*case.b_spec), None),
                          out_specs=out_specs, windowed_einsum=threshold)
  got = step(*args)
  want = jax.jit(fn)(*args)
  assert_matches(got, want, args, exact_of(case.dn), case.dtype, str(case))
  return step.lower(*args)


@st.composite
def cases(draw):
  shape, names = draw(st.sampled_from(MESHES))
  sizes = dict(zip(names, shape))
  axis = draw(st.sampled_from([a for a in names if sizes[a] >= 4]))
  other = next((a for a in names if a != axis), None)
  n = sizes[axis]
  nb, nc = draw(st.integers(0, 1)), draw(st.integers(1, 2))
  nl, nr = draw(st.integers(1, 2)), draw(st.integers(1, 2))
  where = draw(st.sampled_from(["none", "batch", "contract", "free"])) if other else "none"
  if (where == "batch" and nb == 0) or (where == "free" and nl < 2):
    where = "none"
  # Sizes where the gathered operand is what a device would hold most of: the
  # contraction (8 or 16, in neither the result nor a ring step's product) is
  # long and the other free and batch dims are short, so the ring always holds
  # less than the gather (it runs only then: windowed_einsum.py) and every
  # example exercises it: two blocks + a partial product < the gathered operand.
  small = st.sampled_from([1, 2])
  size = {}
  for kind, count in (("b", nb), ("c", nc), ("l", nl), ("r", nr)):
    for i in range(count):
      size[f"{kind}{i}"] = draw(small)
  size["c0"] = draw(st.sampled_from([8, 16]))
  size["l0"] = n * draw(st.sampled_from([1, 2]))
  size["r0"] = n * draw(st.sampled_from([1, 2]))
  grow = {"batch": "b0", "contract": "c0", "free": "l1"}.get(where)
  if grow and grow != "c0":
    size[grow] = sizes[other]
  a_f = [f"b{i}" for i in range(nb)] + [f"c{i}" for i in range(nc)] + \
      [f"l{i}" for i in range(nl)]
  b_f = [f"b{i}" for i in range(nb)] + [f"c{i}" for i in range(nc)] + \
      [f"r{i}" for i in range(nr)]
  a_f = draw(st.permutations(a_f))
  b_f = draw(st.permutations(b_f))
  dn = tuple((tuple(a_f.index(f"{k}{i}") for i in range(count)),
              tuple(b_f.index(f"{k}{i}") for i in range(count)))
             for k, count in (("c", nc), ("b", nb)))       # (contracting, batch)

  def spec(fs):
    out = []
    for f in fs:
      out.append(axis if f in ("l0", "r0") else other if f == grow else None)
    return tuple(out)

  return Case(shape, names, tuple(size[f] for f in a_f), tuple(size[f] for f in b_f), dn,
              spec(a_f), spec(b_f), draw(st.sampled_from(["float32", "bfloat16"])),
              draw(st.integers(0, 2 ** 16)), draw(st.booleans()), draw(st.booleans()))


# Megatron sequence parallel: x[B, T@x, D] . W[D, H@x] gathers x over T.
MEGATRON = Case((4,), ("x",), (2, 8, 6), (6, 8), (((2,), (0,)), ((), ())),
                (None, "x", None), (None, "x"), "float32", 0)


@settings(max_examples=2)
@given(cases())
@example(dataclasses.replace(MEGATRON, dtype="bfloat16", nans=True, seed=1,
                             grads_like_inputs=True))     # dx's reduce-scatter: a ring too
@example(Case((2, 4), ("x", "y"), (2, 8, 4), (2, 4, 8), (((2,), (1,)), ((0,), (0,))),
              ("x", "y", None), ("x", None, "y"), "float32", 2))        # batch dim over x
@example(Case((4, 2), ("x", "y"), (8, 6, 2), (6, 4), (((1,), (0,)), ((), ())),
              ("x", "y", None), ("y", "x"), "bfloat16", 3, True))     # contracting dim over y
def test_values_and_grads_match_one_device(case):
  lowered = run_case(case)
  assert windowed(lowered), f"no windowed einsum in {case}"


def test_the_bound_catches_a_misplaced_block():
  """:func:`assert_matches` fails on a result whose two T blocks are swapped."""
  case = MEGATRON
  fn = vjp_of(case.dn)
  args = inputs(case)
  want = jax.jit(fn)(*args)
  y = np.asarray(want[0]).copy()
  y[:, :2], y[:, 2:4] = y[:, 2:4].copy(), y[:, :2].copy()
  with pytest.raises(AssertionError, match="elements off"):
    assert_matches((y, *want[1:]), want, args, exact_of(case.dn), case.dtype, "swapped")
  bf = dataclasses.replace(case, dtype="bfloat16")
  args = inputs(bf)
  want = jax.jit(fn)(*args)
  y = np.asarray(want[0], np.float32).copy()
  y[:, :2], y[:, 2:4] = y[:, 2:4].copy(), y[:, :2].copy()
  with pytest.raises(AssertionError, match="elements off"):
    assert_matches((y, *want[1:]), want, args, exact_of(bf.dn), bf.dtype, "swapped bf16")


# -- structure: what the compiled program sends ----------------------------------

def rand(*shape, seed=0, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def lower_both(f, args, m, in_specs, out_specs=None, threshold=0):
  """``f`` partitioned without the ring and with it: both (Lowered, compiled),
  the compiled programs' values checked against ``jax.jit(f)``."""
  want = np.asarray(jax.jit(f)(*args))
  out = []
  for we in (None, threshold):
    lowered = gshard.partition(f, m, in_specs=in_specs, out_specs=out_specs, strict=True,
                               windowed_einsum=we).lower(*args)
    compiled = lowered.compile()
    # f32 sums reordered: 1e-5 of the largest value
    np.testing.assert_allclose(np.asarray(compiled(*args)), want, rtol=1e-5,
                               atol=1e-5 * max(1.0, float(np.max(np.abs(want)))))
    out.append((lowered, compiled))
  return out


def kinds(cols) -> list[str]:
  return sorted(c.kind for c in cols)


def test_gather_becomes_n_minus_1_collective_permutes():
  """Megatron sequence parallel: ``x[B, T@x, D] . W[D, H@x]``. Off, XLA's program
  all-gathers x; on, it has n-1 = 3 collective-permutes of one block each and
  no all-gather; gshard records the same bytes both ways."""
  m = mesh((4,), ("x",))
  x, w = rand(2, 16, 32), rand(32, 64, seed=1)
  f = lambda x, w: jnp.einsum("btd,dh->bth", x, w)  # noqa: E731
  (off, off_c), (on, on_c) = lower_both(f, (x, w), m, (P(None, "x"), P(None, "x")))
  assert [c.kind for c in off.collectives()] == ["all_gather"]
  assert [c.kind for c in on.collectives()] == ["ppermute"] * 3
  assert sum(c.bytes for c in on.collectives()) == sum(c.bytes for c in off.collectives())
  hlo_off = hlo_collectives(off_c.as_text(), m)
  hlo_on = hlo_collectives(on_c.as_text(), m)
  assert kinds(hlo_off) == ["all-gather"]
  assert kinds(hlo_on) == ["collective-permute"] * 3
  block = 2 * 4 * 32 * 4
  assert [c.nbytes for c in hlo_on] == [block] * 3
  assert sum(c.nbytes for c in hlo_on) == sum(c.bytes for c in on.collectives())


def test_reduce_scatter_becomes_n_minus_1_collective_permutes():
  """The dual: ``h[B, T, F@x] . W2[F@x, D]`` reduce-scattered to ``[B, T@x, D]``
  runs as a ring of partial sums: 3 collective-permutes, no reduce-scatter."""
  m = mesh((4,), ("x",))
  h, w = rand(2, 16, 64), rand(64, 32, seed=1)
  f = lambda h, w: jnp.einsum("btf,fd->btd", h, w)  # noqa: E731
  (off, off_c), (on, on_c) = lower_both(f, (h, w), m, (P(None, None, "x"), P("x", None)),
                                        P(None, "x", None))
  assert [c.kind for c in off.collectives()] == ["psum_scatter"]
  assert [c.kind for c in on.collectives()] == ["ppermute"] * 3
  assert sum(c.bytes for c in on.collectives()) == sum(c.bytes for c in off.collectives())
  assert kinds(hlo_collectives(off_c.as_text(), m)) == ["reduce-scatter"]
  assert kinds(hlo_collectives(on_c.as_text(), m)) == ["collective-permute"] * 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_contracted_gather_is_a_loop_of_one_collective_permute(dtype):
  """``dW = x^T dy`` gathers x on the contracted T (dy is the larger): on, the
  partial products are summed (in f32 for bf16) in a loop whose body holds the
  one collective-permute (run n-1 = 7 times); no all-gather; values within
  :func:`assert_matches`'s bound of one device."""
  m = mesh((8,), ("x",))
  x, dy = rand(2, 256, 4, dtype=dtype), rand(2, 256, 64, seed=1, dtype=dtype)
  f = lambda x, dy: jnp.einsum("btd,bth->dh", x, dy)  # noqa: E731
  out = []
  for we in (None, 0):
    lowered = gshard.partition(f, m, in_specs=(P(None, "x"), P(None, None, "x")), strict=True,
                               windowed_einsum=we).lower(x, dy)
    compiled = lowered.compile()
    assert_matches((compiled(x, dy),), (jax.jit(f)(x, dy),), (x, dy),
                   lambda x, dy: (np.einsum("btd,bth->dh", x, dy),), dtype, f"{dtype} {we}")
    out.append((lowered, compiled))
  (off, off_c), (on, on_c) = out
  assert [c.kind for c in off.collectives()] == ["all_gather"]
  assert [c.kind for c in on.collectives()] == ["ppermute"] * 7
  assert sum(c.bytes for c in on.collectives()) == sum(c.bytes for c in off.collectives())
  text = on_c.as_text()
  hlo, hlo_off = hlo_collectives(text, m), hlo_collectives(off_c.as_text(), m)
  assert kinds(hlo) == ["collective-permute"] and kinds(hlo_off) == ["all-gather"]
  # the loop sends 7 blocks of x, the all-gather 7 of its 8 (XLA's CPU backend
  # moves bf16 as f32 in both)
  assert hlo[0].nbytes * 8 == hlo_off[0].nbytes
  if dtype == "float32":
    assert hlo[0].nbytes * 7 == sum(c.bytes for c in on.collectives())
  assert re.search(r'"known_trip_count":\{"n":"7"\}', text), "the loop runs n-1 times"


def test_explain_names_the_ring_and_the_collective_it_replaces():
  """``explain()`` and ``choices()`` list the ring as the option chosen, with
  its n-1 collective-permutes, and the collective it replaces beside it: the
  same bytes, and more held per device (the gathered operand; the whole
  partial result before its reduce-scatter). Without the option, no ring."""
  m = mesh((4,), ("x",))
  x, w = rand(2, 16, 32), rand(32, 64, seed=1)
  gather = lambda x, w: jnp.einsum("btd,dh->bth", x, w)  # noqa: E731
  h, w2 = rand(2, 16, 64), rand(64, 32, seed=1)
  scatter = lambda h, w: jnp.einsum("btf,fd->btd", h, w)  # noqa: E731
  cases = [(gather, (x, w), (P(None, "x"), P(None, "x")), None,
            "(c) windowed einsum: ring of blocks", "operand 0", "all_gather[x]"),
           (scatter, (h, w2), (P(None, None, "x"), P("x", None)), P(None, "x", None),
            "(b) windowed einsum: ring of partial sums", "result 0", "psum_scatter[x]")]
  for f, args, in_specs, out_specs, label, role, replaced in cases:
    off = gshard.partition(f, m, in_specs=in_specs, out_specs=out_specs).lower(*args)
    assert not any("windowed" in o.label for c in off.choices() for o in c.options)
    on = gshard.partition(f, m, in_specs=in_specs, out_specs=out_specs,
                          windowed_einsum=0).lower(*args)
    (choice,) = on.choices()
    (ring,) = [o for o in choice.options if o.chosen]
    assert ring.label == label
    assert (role, "collective_permute[x] x3") in ring.moves
    assert ring.bytes == sum(c.bytes for c in on.collectives()) == \
        sum(c.bytes for c in off.collectives())
    (plain,) = [o for o in choice.options if any(replaced in mv for _, mv in o.moves)]
    assert not plain.chosen and plain.bytes == ring.bytes
    # the ring holds two blocks (and a block of the result) where the gather
    # holds x whole, the reduce-scatter the partial result whole
    full = 2 * 16 * 32 * 4
    assert plain.memory == full
    assert 0 < ring.memory < plain.memory
    # the ring is the replaced option with its collective run as the ring
    assert [r for r, _ in ring.moves] == [r for r, _ in plain.moves]
    text = on.explain()
    assert "chosen" in text and label in text and replaced in text


# -- memory ---------------------------------------------------------------------

def test_ring_holds_less_temp_memory_than_the_gather():
  """``x[1, 128@x, 256] . W[256, 2048@x]`` on 8 devices: the plan gathers x, G =
  128 KiB per device. Without the ring, the dot reads the gathered x whole, so
  the compiled program's temp memory holds at least G (x is neither an argument
  nor an output). With it, at any time a device holds the block in use and
  the one arriving (2 G/8) and one step's partial product (1/8 of the 128 KiB
  result): 48 KiB, below G/2. A ring that gathered, or kept every block alive,
  would hold >= G and fail here."""
  m = mesh((8,), ("x",))
  x, w = rand(1, 128, 256), rand(256, 2048, seed=1)
  f = lambda x, w: jnp.einsum("btd,dh->bth", x, w)  # noqa: E731
  (off, off_c), (on, on_c) = lower_both(f, (x, w), m, (P(None, "x"), P(None, "x")))
  assert [c.kind for c in off.collectives()] == ["all_gather"]
  assert off.collectives()[0].role == "operand 0"
  gathered = 128 * 256 * 4
  temp_off = off_c.memory_analysis().temp_size_in_bytes
  temp_on = on_c.memory_analysis().temp_size_in_bytes
  assert temp_off >= gathered
  assert temp_on <= gathered // 2, (temp_on, temp_off)


# -- the option -----------------------------------------------------------------

def test_threshold_is_the_gathered_bytes_per_device():
  """At the gathered operand's bytes per device the ring runs; one byte above, not."""
  m = mesh((4,), ("x",))
  x, w = rand(2, 16, 32), rand(32, 64, seed=1)
  f = lambda x, w: jnp.einsum("btd,dh->bth", x, w)           # noqa: E731
  gathered = 2 * 16 * 32 * 4
  for threshold, ring in ((gathered, True), (gathered + 1, False), (None, False)):
    lo = gshard.partition(f, m, in_specs=(P(None, "x"), P(None, "x")),
                          windowed_einsum=threshold).lower(x, w)
    assert bool(windowed(lo)) == ring, threshold


def test_uneven_split_keeps_the_gather():
  """T = 10 over 4 devices is padded: the plan's gather is kept, values right."""
  m = mesh((4,), ("x",))
  x, w = rand(2, 10, 32), rand(32, 64, seed=1)
  f = lambda x, w: jnp.einsum("btd,dh->bth", x, w)           # noqa: E731
  step = gshard.partition(f, m, in_specs=(P(None, "x"), P(None, "x")), windowed_einsum=0)
  np.testing.assert_allclose(np.asarray(step(x, w)), np.asarray(f(x, w)), rtol=1e-5,
                             atol=1e-5)
  lo = step.lower(x, w)
  assert not windowed(lo) and "all_gather" in [c.kind for c in lo.collectives()]


@pytest.mark.parametrize("bad", [-1, float("nan"), "1MB", True, [0]])
def test_bad_threshold_is_a_value_error(bad):
  m = mesh((4,), ("x",))
  with pytest.raises(ValueError, match=r"windowed_einsum=.*expected None \(never\) or a size "
                                       r"in bytes.*windowed_einsum=0"):
    gshard.partition(lambda x: x, m, windowed_einsum=bad)


def test_bf16_operands_with_f32_result():
  """bf16 inputs, ``preferred_element_type=f32``: the ring's local dots keep it."""
  m = mesh((4,), ("x",))
  x, w = rand(2, 16, 32, dtype=jnp.bfloat16), rand(32, 64, seed=1, dtype=jnp.bfloat16)
  f = lambda x, w: jnp.einsum("btd,dh->bth", x, w, preferred_element_type=jnp.float32)  # noqa: E731
  step = gshard.partition(f, m, in_specs=(P(None, "x"), P(None, "x")), windowed_einsum=0)
  got, want = step(x, w), jax.jit(f)(x, w)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert windowed(step.lower(x, w))


# -- inside loops and branches --------------------------------------------------

def test_ring_inside_scan_and_cond_bodies():
  """The rule runs on the bodies' dot_generals too: values and gradients equal
  one device, and the bytes of a ring in a scan of 3 trips count 3 times."""
  m = mesh((4,), ("x",))
  x, ws = rand(2, 16, 32), rand(3, 32, 64, seed=1)

  def f(x, ws):
    def body(acc, w):
      return acc + jnp.tanh(jnp.einsum("btd,dh->bth", x, w)), None
    y, _ = lax.scan(body, jnp.zeros((2, 16, 64)), ws)
    z = lax.cond(jnp.sum(x) > 0, lambda: jnp.einsum("btd,dh->bth", x, ws[0]),
                 lambda: jnp.einsum("btd,dh->bth", x, 2 * ws[1]))
    return jnp.sum(gshard.split(y, dim=2, axis="x") * z)

  g = jax.value_and_grad(f, (0, 1))
  step = gshard.partition(g, m, in_specs=(P(None, "x"), P(None, None, "x")),
                          windowed_einsum=0)
  got, want = step(x, ws), jax.jit(g)(x, ws)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-4)
  rings = windowed(step.lower(x, ws))
  block = 2 * 4 * 32 * 4
  assert any(c.bytes == 3 * block for c in rings), [str(c) for c in rings]
  assert any(c.bytes == block for c in rings), [str(c) for c in rings]
