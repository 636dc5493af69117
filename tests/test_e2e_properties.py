"""End-to-end properties over small real-model programs: partitioning never
changes a result.

Hypothesis draws a mesh of up to 8 real devices (1-D, 2-D or 3-D), a program
that mixes what real models do, in a random selection and with random sizes
(every dim 1..13, so most splits are uneven):

* an embedding lookup (``table[tokens]``, a gather; vocabulary often split);
* ``lax.scan`` over a stacked weight (a layer stack), with an optional
  annotation of the carry inside the body and the per-layer outputs as ``ys``;
* ``lax.cond`` on a traced predicate or ``lax.switch`` on a traced index, whose
  branches use a weight;
* a 1-D convolution (``conv_general_dilated``, SAME padding) over the sequence,
  which may be split (halo exchange) or uneven (gathered);
* a tied-logits cross-entropy (``log_softmax`` + ``take_along_axis`` over the
  vocabulary);

with random ``in_specs`` (uneven splits included) and random ``gshard.shard``
annotations. The partitioned program equals the unpartitioned one, forward and
under ``jax.value_and_grad`` w.r.t. every float input; outputs have their
logical shapes. ``gshard.PartitionWarning`` is an error: every primitive drawn
has a partition rule (a convolution that cannot keep its split gathers that
dim, which is not the safe path).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import PartitionSpec as P

import gshard
from helpers_partition import mesh

pytestmark = pytest.mark.filterwarnings("error::gshard.PartitionWarning")

MESHES = [((8,), ("x",)), ((4,), ("x",)), ((2, 4), ("a", "b")), ((4, 2), ("a", "b")),
          ((2, 2, 2), ("p", "q", "r"))]
# Each program compiles four times (partitioned and reference, forward and
# gradient): a third of the profile's examples keeps the file well under a minute.
EXAMPLES = max(1, settings().max_examples // 3)
SLOW = settings(max_examples=EXAMPLES,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclasses.dataclass(frozen=True)
class Program:
  """A small model: [embed] -> [scan over layers] -> [cond/switch] -> [conv] -> [xent].

  Sizes: batch ``b``, sequence ``t``, vocabulary ``v``, width ``d``, conv
  output channels ``c``, layers ``layers``, conv kernel ``k``. ``branch`` is
  None (no cond), ``"cond"`` or ``"switch"``. ``shards`` maps a place in the
  program to the spec annotated there.
  """

  b: int
  t: int
  v: int
  d: int
  c: int
  layers: int
  k: int
  embed: bool
  scan: bool
  branch: str | None
  conv: bool
  xent: bool
  shards: tuple[tuple[str, tuple], ...]

  # -- inputs ---------------------------------------------------------------
  def inputs(self) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of each argument; kind is "f32", "tokens" or "index"."""
    out = []
    if self.embed:
      out += [("table", (self.v, self.d), "f32"), ("tokens", (self.b, self.t), "tokens")]
    else:
      out.append(("x", (self.b, self.t, self.d), "f32"))
    if self.scan:
      out.append(("ws", (self.layers, self.d, self.d), "f32"))
    if self.branch:
      out += [("wc", (self.d, self.d), "f32"), ("pred", (), "index")]
    if self.conv:
      out.append(("kernel", (self.k, self.d, self.c), "f32"))
    if self.xent:
      out.append(("targets", (self.b, self.t), "tokens"))
    return out

  def make_inputs(self, rng, pred: int) -> list[np.ndarray]:
    xs = []
    for name, shape, kind in self.inputs():
      if kind == "f32":
        scale = 1.0 / math.sqrt(shape[-2]) if len(shape) >= 2 and name != "table" else 1.0
        xs.append((rng.standard_normal(shape) * scale).astype(np.float32))
      elif kind == "tokens":
        xs.append(rng.integers(0, self.v, shape).astype(np.int32))
      else:
        xs.append(np.int32(pred))
    return xs

  @property
  def float_argnums(self) -> tuple[int, ...]:
    return tuple(i for i, (_, _, kind) in enumerate(self.inputs()) if kind == "f32")

  # -- the program ------------------------------------------------------------
  def _shard(self, where: str, x):
    spec = dict(self.shards).get(where)
    return x if spec is None else gshard.shard(x, P(*spec))

  def __call__(self, *args):
    a = dict(zip([n for n, _, _ in self.inputs()], args))
    outs = {}
    if self.embed:
      h = a["table"][a["tokens"]]                            # gather
    else:
      h = a["x"]
    h = self._shard("h", h)
    if self.scan:
      def layer(carry, w):
        carry = jnp.tanh(carry @ w) + carry
        carry = self._shard("carry", carry)
        return carry, carry.sum(-1)
      h, outs["ys"] = lax.scan(layer, h, a["ws"])
    if self.branch == "cond":
      h = lax.cond(a["pred"] > 0, lambda y, w: jnp.sin(y @ w), lambda y, w: y * 2.0 - y @ w,
                   h, a["wc"])
    elif self.branch == "switch":
      h = lax.switch(a["pred"], [lambda y, w: jnp.sin(y @ w), lambda y, w: y * 2.0,
                                 lambda y, w: jax.nn.gelu(y) @ w], h, a["wc"])
    if self.conv:
      h = lax.conv_general_dilated(h, a["kernel"], (1,), "SAME",
                                   dimension_numbers=("NWC", "WIO", "NWC"))
      h = self._shard("conv", h)
    outs["h"] = h
    if self.xent:
      logits = h @ a["table"].T if self.embed and not self.conv else \
          h[..., :1] * jnp.arange(self.v, dtype=jnp.float32) / self.v
      logp = jax.nn.log_softmax(logits, axis=-1)
      outs["gold"] = jnp.take_along_axis(logp, a["targets"][..., None], axis=-1)[..., 0]
    return outs


def _entry(axes):
  return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


@st.composite
def specs(draw, shape, sizes: dict[str, int]) -> tuple:
  """Any spec for ``shape``: each mesh axis at most once, uneven splits allowed."""
  free = list(draw(st.permutations(list(sizes))))
  entries = []
  for _ in shape:
    axes = []
    for a in list(free):
      if draw(st.integers(0, 2)) == 0:
        axes.append(a)
        free.remove(a)
    entries.append(_entry(axes))
  return tuple(entries)


@st.composite
def cases(draw):
  """(mesh, program, arguments, in_specs)."""
  shape, names = draw(st.sampled_from(MESHES))
  sizes = dict(zip(names, shape))
  dim = st.integers(1, 13)
  b, t, v, d, c = (draw(dim) for _ in range(5))
  embed, scan, conv, xent = (draw(st.booleans()) for _ in range(4))
  branch = draw(st.sampled_from([None, "cond", "switch"]))
  xent = xent and embed
  prog_shapes = {"h": (b, t, d), "carry": (b, t, d), "conv": (b, t, c)}
  shards = []
  for where, s in prog_shapes.items():
    if draw(st.integers(0, 2)) == 0:
      shards.append((where, draw(specs(s, sizes))))
  prog = Program(b, t, v, d, c, draw(st.integers(1, 3)), draw(st.sampled_from([1, 3, 5])),
                 embed, scan, branch, conv, xent, tuple(shards))
  in_specs = tuple(P(*draw(specs(s, sizes))) if draw(st.integers(0, 3)) else None
                   for _, s, _ in prog.inputs())
  pred = draw(st.sampled_from([-1, 0, 1, 2, 5]))
  rng = np.random.default_rng(draw(st.integers(0, 2 ** 31 - 1)))
  return mesh(shape, names), prog, prog.make_inputs(rng, pred), in_specs


def _tol(ref) -> dict:
  scale = max([1.0] + [float(np.max(np.abs(np.asarray(r)))) for r in jax.tree.leaves(ref)
                       if np.size(r)])
  return dict(rtol=1e-4, atol=1e-4 * scale)


def _compare(got, want, what: str) -> None:
  tol = _tol(want)
  got_l, got_t = jax.tree.flatten(got)
  want_l, want_t = jax.tree.flatten(want)
  assert got_t == want_t, (what, got_t, want_t)
  for k, (g, w) in enumerate(zip(got_l, want_l)):
    assert g.shape == w.shape and g.dtype == w.dtype, (what, k, g.shape, w.shape)
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), err_msg=f"{what} leaf {k}",
                               **tol)


@SLOW
@given(cases())
def test_program_matches_unpartitioned(case):
  m, prog, xs, in_specs = case
  step = gshard.partition(prog, m, in_specs=in_specs)
  out = step(*xs)
  _compare(out, jax.jit(prog)(*xs), f"{prog}")
  for k, o in enumerate(jax.tree.leaves(out)):      # global arrays on the mesh
    assert isinstance(o, jax.Array) and o.sharding.mesh == m, k
  assert not step.lower(*xs).fallbacks


@SLOW
@given(cases())
def test_program_value_and_grad_matches_unpartitioned(case):
  m, prog, xs, in_specs = case

  def loss(*args):
    total = 0.0
    for k, o in enumerate(jax.tree.leaves(prog(*args))):
      w = np.cos(np.arange(o.size, dtype=np.float32) * 0.7 + k).reshape(o.shape)
      total = total + jnp.sum(o * w)
    return total

  fn = jax.value_and_grad(loss, argnums=prog.float_argnums)
  step = gshard.partition(fn, m, in_specs=in_specs)
  _compare(step(*xs), jax.jit(fn)(*xs), f"{prog}")


def test_hand_picked_program_with_every_feature():
  """All features at once, on (2, 4): vocabulary 50 over b (uneven), the
  sequence split over b before the convolution (a halo exchange), the batch
  over a, a 3-layer scan and a switch."""
  m = mesh((2, 4), ("a", "b"))
  prog = Program(b=4, t=12, v=50, d=8, c=6, layers=3, k=3, embed=True, scan=True,
                 branch="switch", conv=True, xent=True,
                 shards=(("h", ("a", "b", None)),))
  in_specs = (P("b"), P("a"), P(None, None, "b"), P(None, "b"), None, P(), P("a"))
  assert len(in_specs) == len(prog.inputs())

  def loss(*args):
    return sum(jnp.sum(jnp.sin(o)) for o in jax.tree.leaves(prog(*args)))

  fn = jax.value_and_grad(loss, argnums=prog.float_argnums)
  step = gshard.partition(prog, m, in_specs=in_specs)
  grad_step = gshard.partition(fn, m, in_specs=in_specs)
  ref, grad_ref = jax.jit(prog), jax.jit(fn)
  for pred in (0, 1, 2):             # a traced index: one compilation for all three
    xs = prog.make_inputs(np.random.default_rng(pred), pred)
    _compare(step(*xs), ref(*xs), f"pred={pred}")
    _compare(grad_step(*xs), grad_ref(*xs), f"grad pred={pred}")
  low = step.lower(*xs)
  assert not low.fallbacks
  assert "ppermute" in {c.kind for c in low.collectives()}, low.explain()   # the halo
  jaxpr = low.as_text("jaxpr")
  assert "scan[" in jaxpr and "cond[" in jaxpr and "conv_general_dilated" in jaxpr


def test_generator_covers_every_feature():
  """The strategy reaches every feature, mesh and branch kind, uneven splits
  and annotations (a blind generator would make the properties vacuous)."""
  seen = set()

  @settings(max_examples=200, derandomize=True, database=None,
            suppress_health_check=list(HealthCheck))
  @given(cases())
  def collect(case):
    m, prog, _, in_specs = case
    sizes = dict(zip(m.axis_names, m.devices.shape))
    seen.add(("mesh", m.devices.shape))
    seen.update(k for k in ("embed", "scan", "conv", "xent") if getattr(prog, k))
    seen.add(("branch", prog.branch))
    seen.update(("shard", w) for w, _ in prog.shards)
    for spec, (_, shape, _) in zip(in_specs, prog.inputs()):
      for n, e in zip(shape, spec or ()):
        if e is not None:
          k = math.prod(sizes[a] for a in ((e,) if isinstance(e, str) else e))
          seen.add("uneven" if n % k else "even")

  collect()
  want = {("mesh", s) for s, _ in MESHES} | {"embed", "scan", "conv", "xent", "uneven",
                                             "even"} | {("branch", b) for b in
                                                        (None, "cond", "switch")} | \
      {("shard", w) for w in ("h", "carry", "conv")}
  assert want <= seen, want - seen
