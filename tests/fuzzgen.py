"""Random annotated JAX programs for fuzzing ``gshard.partition``.

A :class:`Program` is a small random DAG of jax.numpy / lax operations over a
few inputs, with random ``gshard.shard`` / ``split`` / ``replicate``
annotations, random ``in_specs`` (uneven splits included) and a random mesh of
up to 8 devices (1-D, 2-D or 3-D). It prints as a self-contained Python script
(``Program.repro()``), so a failure is a copy-pasteable repro.

What the generator covers: dtypes bool/int8/int32/float32/bfloat16; NaN and
+-inf in float inputs; ranks 0-4 with dims 1..9 (most splits uneven);
elementwise math, casts, comparisons, ``where``; reductions (sum, max, min,
mean, prod, argmax/argmin, any/all, an ``x * jnp.sum(x)`` pattern, logsumexp,
softmax, int8 sums that wrap, ``lax.psum``/``pmax``/``pmin`` over a ``vmap``ped
axis); dots and tensordots (bool, int8, float);
transposes, reshapes, slices, flips, rolls, concatenation, broadcasting;
``jnp.pad`` (constant, edge, reflect, wrap) and ``lax.pad`` (negative and
interior); gathers (``x[idx]``, ``x[:, idx]``, ``take`` with fill/clip,
``take_along_axis``, scalar two-index ``a.T[i, j]``, ``mask[idx]``);
dynamic slices with clamped (out-of-range) starts, dynamic index, dynamic
update slice; scatters (``.at[idx].add/set/max/min``, 2-D indices, dropped
out-of-range indices); sort, argsort, ``lax.top_k`` along any axis (k up to
the full dim), ``lax.approx_max_k``/``approx_min_k`` along any dim (small k;
NaNs replaced first), ``jnp.unique``, cumsum/cummax; ``lax.ragged_dot``
(grouped matmul, float or int; group sizes an int32 input with its own spec or
a constant, their total below, at or a little above the rows); a variadic
``lax.reduce`` with a computation of its own over random dims (an
argmax/argmin of (value, index) pairs, or (sum, max) of two operands);
``lax.scan`` (over an array, or over ``arange`` indexing a closed-over
array), ``fori_loop``, ``lax.cond``, ``lax.switch``, ``lax.while_loop`` (trip
count from an input, or data-dependent); in ``value`` mode the program's
outputs are compared, in ``grad`` mode ``jax.value_and_grad`` of a weighted
sum of its float outputs w.r.t. every float input.

Determinism bookkeeping (why the checker may demand exact equality): each
value carries ``exact`` (bitwise the same under any evaluation order of its
reductions) and, for floats, a *grid*: the value is a multiple of ``2**e`` no
larger than ``mag``. Float inputs are mostly multiples of 1/4 (on a grid),
so sums, dots, cumsums and scatter-adds of them stay exact as long as the
result fits the dtype's significand (24 bits f32, 8 bits bf16). Ops with a
discontinuity in their value (comparisons, argmax, argsort, top_k and
approx top-k indices, the index of a ``lax.reduce`` argmax, float->int casts,
floor, sign, unique, log/sqrt near 0) are only applied to
exact operands, so an integer or boolean output never depends on rounding and
must match bit for bit; in ``grad`` mode the same holds for ops whose
derivative has a kink (max/min, maximum, abs, relu, clip, sort, top_k, approx
top-k; a ``lax.reduce`` gets ``stop_gradient``-ed float operands). Float
outputs are compared with the derived tolerance of ``fuzzcheck``.

Choices come from a :class:`Draw`; :func:`from_seed` seeds a
:class:`RandomDraw`, so a program is named by its seed string
(``tests/fuzz_main.py``, ``make fuzz``) and :func:`programs` is the hypothesis
strategy over seeds (``tests/test_fuzz.py``).
"""

from __future__ import annotations

import dataclasses
import math
import random
import textwrap
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import gshard

MESHES = [((8,), ("x",)), ((4,), ("x",)), ((2,), ("x",)), ((2, 4), ("a", "b")),
          ((4, 2), ("a", "b")), ((2, 2), ("a", "b")), ((1, 4), ("a", "b")),
          ((2, 2, 2), ("p", "q", "r")), ((2, 1, 4), ("p", "q", "r"))]

DTYPES = ("f32", "bf16", "i32", "i8", "bool")
FLOATS = ("f32", "bf16")
INTS = ("i32", "i8")
JNP_DTYPE = {"f32": jnp.float32, "bf16": jnp.bfloat16, "i32": jnp.int32, "i8": jnp.int8,
             "bool": jnp.bool_}
NP_DTYPE = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "i32": np.int32, "i8": np.int8,
            "bool": np.bool_}
PRECISION = {"f32": 24, "bf16": 8}            # significand bits
INT_MAX = {"i32": 2 ** 31 - 1, "i8": 127}
MAX_MAG = 1e6            # floats never exceed this (no overflow anywhere)
MAX_ELEMS = 256


def dtype_name(dtype) -> str:
  d = np.dtype(dtype)
  for k, v in NP_DTYPE.items():
    if np.dtype(v) == d:
      return k
  raise ValueError(f"dtype {d} not generated")


# -- sources of choices ---------------------------------------------------------

class Draw:
  """The choices a generator makes; subclasses take them from a source."""

  def int(self, lo: int, hi: int) -> int:     # inclusive
    raise NotImplementedError

  def bool(self, p: float = 0.5) -> bool:
    return self.int(0, 999) < int(p * 1000)

  def choice(self, seq):
    seq = list(seq)
    return seq[self.int(0, len(seq) - 1)]

  def weighted(self, items: list[tuple[float, object]]):
    total = sum(w for w, _ in items)
    r = self.int(0, 9999) / 10000 * total
    for w, x in items:
      r -= w
      if r < 0:
        return x
    return items[-1][1]


class RandomDraw(Draw):
  def __init__(self, rng: random.Random):
    self.rng = rng

  def int(self, lo, hi):
    return self.rng.randint(lo, hi)


# -- values ---------------------------------------------------------------------

@dataclasses.dataclass
class V:
  """A value of the program under construction.

  ``exact``: bitwise the same under any evaluation order. ``e``: floats only,
  the grid exponent when the value is a multiple of ``2**e`` that fits its
  dtype (None: off the grid; a reduction of it is not exact). ``mag``: a bound
  on its finite magnitudes.
  """

  name: str
  shape: tuple[int, ...]
  dtype: str
  exact: bool = True
  e: int | None = None
  mag: float = 1.0
  uses: int = 0
  hidden: bool = False

  @property
  def rank(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def is_float(self) -> bool:
    return self.dtype in FLOATS

  @property
  def is_int(self) -> bool:
    return self.dtype in INTS

  @property
  def ongrid(self) -> bool:
    return self.is_float and self.exact and self.e is not None


def fits(dtype: str, e: int | None, mag: float) -> bool:
  if e is None or dtype not in FLOATS:
    return False
  return mag <= 2.0 ** (PRECISION[dtype] + e) and e >= -100


@dataclasses.dataclass
class Input:
  name: str
  value: np.ndarray
  dtype: str
  spec: tuple | None      # PartitionSpec entries, or None (left to propagation)


def spec_src(entries) -> str:
  def one(e):
    if e is None:
      return "None"
    if isinstance(e, str):
      return repr(e)
    return "(" + ", ".join(repr(a) for a in e) + ("," if len(e) == 1 else "") + ")"
  return "P(" + ", ".join(one(e) for e in entries) + ")"


def array_src(x: np.ndarray, dtype: str) -> str:
  """A Python expression for the array ``x`` (nan/inf as np.nan/np.inf)."""
  def fmt(v):
    if dtype == "bool":
      return "True" if v else "False"
    if dtype in INTS:
      return str(int(v))
    v = float(v)
    if math.isnan(v):
      return "nan"
    if math.isinf(v):
      return "inf" if v > 0 else "-inf"
    return repr(v) if v != int(v) or abs(v) > 1e15 else f"{int(v)}."
  def rec(a):
    if a.ndim == 0:
      return fmt(a[()])
    return "[" + ", ".join(rec(s) for s in a) + "]"
  body = rec(np.asarray(x, dtype=np.float64 if dtype in FLOATS else None))
  return f"np.array({body}, {dtype})"


# -- programs ---------------------------------------------------------------------

NAMESPACE_HEADER = """\
import os
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax, jax.numpy as jnp, numpy as np, ml_dtypes
from jax import lax
from jax.sharding import PartitionSpec as P
import gshard
f32, bf16, i32, i8 = jnp.float32, jnp.bfloat16, jnp.int32, jnp.int8
nan, inf = np.nan, np.inf
"""


def namespace(oracle: bool = False) -> dict:
  """Globals the program source runs in; ``oracle``: every float dtype is f64."""
  f = jnp.float64 if oracle else None
  return {"jax": jax, "jnp": jnp, "np": np, "lax": lax, "P": P, "gshard": gshard,
          "ml_dtypes": ml_dtypes,
          "f32": f or jnp.float32, "bf16": f or jnp.bfloat16, "i32": jnp.int32,
          "i8": jnp.int8, "nan": np.nan, "inf": np.inf}


@dataclasses.dataclass
class Program:
  mesh_shape: tuple[int, ...]
  axis_names: tuple[str, ...]
  inputs: list[Input]
  lines: list[str]
  outputs: list[str]
  out_dtypes: list[str]
  mode: str                      # "value" or "grad"
  features: frozenset[str] = frozenset()
  seed: str = ""                 # from_seed(seed) rebuilds it
  uncomparable: frozenset[str] = frozenset()   # values whose bits may depend on rounding

  def defined(self, line: str) -> list[str]:
    """The names a line of the body assigns."""
    return [n.strip() for n in line.split(" = ", 1)[0].split(",") if n.strip()]

  @property
  def float_argnums(self) -> tuple[int, ...]:
    return tuple(i for i, x in enumerate(self.inputs) if x.dtype in FLOATS)

  @property
  def in_specs(self) -> tuple:
    return tuple(None if x.spec is None else P(*x.spec) for x in self.inputs)

  @property
  def dtypes(self) -> set[str]:
    return {x.dtype for x in self.inputs} | set(self.out_dtypes) | {
        d for d in DTYPES if f"dtype:{d}" in self.features}

  # -- source -----------------------------------------------------------------
  def fn_source(self) -> str:
    args = ", ".join(x.name for x in self.inputs)
    body = "\n".join("    " + ln for ln in self.lines)
    outs = ", ".join(self.outputs) + ("," if len(self.outputs) == 1 else "")
    src = f"def f({args}):\n{body}\n    return ({outs})\n"
    if self.mode == "grad":
      argnums = self.float_argnums
      src += textwrap.dedent(f"""\

        def loss(*args):
            total = 0.0
            for o in f(*args):
                if jnp.issubdtype(o.dtype, jnp.floating):
                    w = ((jnp.arange(o.size) % 5 - 2) / 2).reshape(o.shape).astype(o.dtype)
                    total = total + jnp.sum(jnp.where(jnp.isfinite(o), o, 0) * w)
            return total

        g = jax.value_and_grad(loss, argnums={argnums!r})
        """)
    return src

  @property
  def entry(self) -> str:
    return "g" if self.mode == "grad" else "f"

  def args_source(self) -> str:
    return "args = (\n" + "".join(
        f"    {array_src(x.value, x.dtype)},   # {x.name}\n" for x in self.inputs) + ")\n"

  def repro(self) -> str:
    """A self-contained script: single device vs gshard (vs GSPMD)."""
    specs = "(" + ", ".join("None" if x.spec is None else spec_src(x.spec)
                            for x in self.inputs) + ("," if len(self.inputs) == 1 else "") + ")"
    return ((f"# fuzz program {self.seed} (python tests/fuzz_main.py --replay {self.seed})\n"
             if self.seed else "") + NAMESPACE_HEADER +
            f"mesh = gshard.make_mesh({self.mesh_shape!r}, {self.axis_names!r})\n\n" +
            self.fn_source() + "\n" + self.args_source() +
            f"in_specs = {specs}\n" +
            f"want = jax.jit({self.entry})(*args)\n"
            f"got = gshard.partition({self.entry}, mesh, in_specs=in_specs)(*args)\n"
            f"# gspmd = gshard.gspmd_jit({self.entry}, mesh, in_specs=in_specs)(*args)\n"
            "for k, (w, g_) in enumerate(zip(jax.tree.leaves(want), jax.tree.leaves(got))):\n"
            "    print(k, w.dtype, g_.dtype, np.asarray(w).tolist() == np.asarray(g_).tolist())\n")

  def __str__(self) -> str:
    return self.repro()

  # -- running ------------------------------------------------------------------
  def build(self, oracle: bool = False) -> Callable:
    ns = namespace(oracle)
    exec(compile(self.fn_source(), "<fuzz program>", "exec"), ns)
    return ns[self.entry]

  def args(self, oracle: bool = False) -> list:
    out = []
    for x in self.inputs:
      if oracle and x.dtype in FLOATS:
        out.append(np.asarray(x.value, np.float64))
      else:
        out.append(np.asarray(x.value, NP_DTYPE[x.dtype]))
    return out


# -- the generator ------------------------------------------------------------------

class Reject(Exception):
  """The op drawn does not apply here; draw another."""


class Gen:
  """Builds one :class:`Program` from a :class:`Draw`."""

  def __init__(self, d: Draw, mode: str | None = None, max_ops: int = 8):
    self.d = d
    self.mesh_shape, self.axis_names = d.choice(MESHES)
    self.sizes = dict(zip(self.axis_names, self.mesh_shape))
    self.mode = mode or ("grad" if d.bool(0.35) else "value")
    self.rng = np.random.default_rng(d.int(0, 2 ** 31 - 1))
    self.vars: list[V] = []
    self.inputs: list[Input] = []
    self.lines: list[str] = []
    self.features: set[str] = set()
    self.n_ops = d.int(1, max_ops)
    self._count = 0
    self._abstract: dict[str, jax.ShapeDtypeStruct] = {}
    self.uncomparable: set[str] = set()

  # -- naming / emitting ----------------------------------------------------------
  def _name(self, prefix="v") -> str:
    self._count += 1
    return f"{prefix}{self._count}"

  def _eval_shapes(self, expr: str, used: list[str]):
    """jax's shapes and dtypes of ``expr`` over the values it names."""
    ns = namespace()
    names = sorted(set(used))
    src = f"lambda {', '.join(names)}: ({expr})" if names else f"lambda: ({expr})"
    fn = eval(src, ns)
    return jax.eval_shape(fn, *[self._abstract[n] for n in names])

  def emit(self, expr: str, used: list[V], metas: list[dict] | dict, feature: str,
           hide: bool = False) -> list[V]:
    """Add ``vN[, vM] = expr``; ``metas`` gives exact/e/mag of each result."""
    if isinstance(metas, dict):
      metas = [metas]
    try:
      out = self._eval_shapes(expr, [u.name for u in used])
    except Exception as e:   # the op does not apply (generator's mistake): skip it
      raise Reject(f"{expr}: {type(e).__name__}: {e}") from None
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if len(outs) != len(metas):
      raise Reject(f"{expr}: {len(outs)} results, {len(metas)} metas")
    vs = []
    for o, m in zip(outs, metas):
      dt = dtype_name(o.dtype)
      if dt in FLOATS and m.get("mag", 1.0) > MAX_MAG:
        raise Reject(f"{expr}: magnitude {m['mag']}")
      if math.prod(o.shape) > MAX_ELEMS or len(o.shape) > 4:
        raise Reject(f"{expr}: {o.shape} too big")
      v = V(self._name(), tuple(o.shape), dt, **m)
      if dt in FLOATS and not fits(dt, v.e, v.mag):
        v.e = None
      if dt not in FLOATS:
        v.e = None
        v.exact = True if dt == "bool" or dt in INTS else v.exact
      vs.append(v)
    for u in used:
      u.uses += 1
      if hide:
        u.hidden = True
    lhs = ", ".join(v.name for v in vs) + ("," if len(vs) == 1 and len(metas) > 1 else "")
    self.lines.append(f"{lhs} = {expr}")
    for v in vs:
      self._abstract[v.name] = jax.ShapeDtypeStruct(v.shape, JNP_DTYPE[v.dtype])
      self.vars.append(v)
      self.features.add(f"dtype:{v.dtype}")
      self.features.add(f"rank:{v.rank}")
    self.features.add(feature)
    return vs

  def pick(self, pred: Callable[[V], bool] = lambda v: True) -> V:
    cands = [v for v in self.vars if not v.hidden and pred(v)]
    if not cands:
      raise Reject("no operand")
    if self.d.bool(0.5):
      return cands[-1 - self.d.int(0, min(2, len(cands) - 1))]
    return self.d.choice(cands)

  def pick_or_new(self, pred, make_shape: Callable[[], tuple], dtype: str,
                  p_new: float = 0.4) -> V:
    cands = [v for v in self.vars if not v.hidden and pred(v)]
    if cands and not self.d.bool(p_new):
      return self.d.choice(cands)
    shape = make_shape()
    v = self.new_input(shape, dtype)
    if not pred(v):
      raise Reject("new input does not fit")
    return v

  # -- shapes / specs / inputs ----------------------------------------------------
  def dim(self) -> int:
    return self.d.weighted([(3, 1), (4, 2), (3, 3), (5, 4), (3, 5), (3, 6), (2, 7),
                            (4, 8), (1, 9)])

  def shape(self, rank: int | None = None) -> tuple[int, ...]:
    if rank is None:
      rank = self.d.weighted([(1, 0), (5, 1), (6, 2), (3, 3), (1.5, 4)])
    for _ in range(10):
      s = tuple(self.dim() for _ in range(rank))
      if math.prod(s) <= MAX_ELEMS // 2:
        return s
    return tuple([2] * rank)

  def spec(self, shape, p: float = 0.45) -> tuple:
    """Any spec for ``shape``: each mesh axis at most once, uneven splits allowed."""
    free = list(self.axis_names)
    order = []
    while free:
      order.append(free.pop(self.d.int(0, len(free) - 1)))
    entries = []
    for n in shape:
      axes = []
      for a in list(order):
        if self.d.bool(p if n > 1 else p / 4):
          axes.append(a)
          order.remove(a)
      entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    while entries and entries[-1] is None:
      entries.pop()
    for n, e in zip(shape, entries):
      if e is not None:
        k = math.prod(self.sizes[a] for a in ((e,) if isinstance(e, str) else e))
        self.features.add("uneven" if n % k else "even")
    return tuple(entries)

  def new_input(self, shape, dtype: str, values: np.ndarray | None = None,
                spec: bool = True) -> V:
    name = f"x{len(self.inputs)}"
    rng = self.rng
    meta = {}
    if values is not None:
      x = np.asarray(values)
      meta = dict(mag=float(np.max(np.abs(x))) if x.size else 1.0)
    elif dtype in FLOATS:
      if self.d.bool(0.75):
        x = rng.integers(-8, 9, shape) / 4.0
        meta = dict(e=-2, mag=2.0)
        self.features.add("input:grid")
      else:
        x = np.round(rng.standard_normal(shape), 3)
        meta = dict(e=None, mag=5.0)
        self.features.add("input:normal")
      if x.size and self.d.bool(0.25):
        x = np.array(x, np.float64)
        for _ in range(self.d.int(1, 2)):
          flat = x.reshape(-1)
          k = self.d.int(0, flat.size - 1)
          flat[k] = self.d.choice([np.nan, np.nan, np.inf, -np.inf])
          self.features.add("input:nan" if np.isnan(flat[k]) else "input:inf")
    elif dtype == "bool":
      x = rng.random(shape) < self.d.choice([0.2, 0.5, 0.8])
    elif dtype == "i8" and self.d.bool(0.5):
      x = rng.integers(-128, 128, shape)
      meta = dict(mag=128.0)
    else:
      x = rng.integers(-5, 6, shape)
      meta = dict(mag=5.0)
    x = np.asarray(x).astype(NP_DTYPE[dtype]).reshape(shape)
    sp = self.spec(shape) if spec and self.d.bool(0.7) else None
    if spec and sp is None and self.d.bool(0.2):
      sp = ()
    self.inputs.append(Input(name, x, dtype, sp))
    v = V(name, tuple(shape), dtype, exact=True, **meta)
    if dtype in FLOATS and not fits(dtype, v.e, v.mag):
      v.e = None
    self.vars.append(v)
    self._abstract[name] = jax.ShapeDtypeStruct(tuple(shape), JNP_DTYPE[dtype])
    self.features.add(f"dtype:{dtype}")
    self.features.add(f"rank:{len(shape)}")
    return v

  def index_input(self, shape, lo: int, hi: int, unique: bool = False) -> V:
    """An int32 index input with values in [lo, hi] (inclusive)."""
    if unique:
      k = math.prod(shape)
      vals = self.rng.permutation(np.arange(lo, hi + 1))[:k]
      if vals.size < k:
        raise Reject("not enough unique indices")
      vals = vals.reshape(shape)
    else:
      vals = self.rng.integers(lo, hi + 1, shape)
    v = self.new_input(shape, "i32", values=vals.astype(np.int32), spec=bool(shape))
    return v

  def index_from(self, n: int, shape=None, lo: int | None = None, hi: int | None = None,
                 unique: bool = False) -> tuple[str, list[V]]:
    """An index expression (source, values used) with values in range of a dim of size ``n``.

    Default range [-n, n-1] (negative indices count from the end)."""
    lo = -n if lo is None else lo
    hi = n - 1 if hi is None else hi
    if shape is None:
      shape = self.d.choice([(), (self.d.int(1, 6),), (self.d.int(1, 3), self.d.int(1, 3))])
    if not unique and shape and lo >= -n and hi <= n - 1 and self.d.bool(0.3):
      # an index computed by the program: an int value taken modulo n
      w = None
      try:
        w = self.pick(lambda v: v.is_int and v.shape == tuple(shape))
      except Reject:
        pass
      if w is not None:
        self.features.add("index:computed")
        return f"({w.name} % {n})", [w]
    v = self.index_input(tuple(shape), lo, hi, unique)
    return v.name, [v]

  # -- annotations ------------------------------------------------------------------
  def annotate(self, v: V, inside: str | None = None) -> str:
    """Source of a random annotation of the value named ``inside or v.name``."""
    name = inside or v.name
    kind = self.d.weighted([(6, "shard"), (2, "split"), (1, "replicate")])
    if kind == "split" and v.rank:
      dim = self.d.int(0, v.rank - 1)
      axes = [a for a in self.axis_names if self.d.bool(0.5)] or [self.d.choice(self.axis_names)]
      k = math.prod(self.sizes[a] for a in axes)
      self.features.add("annot:split")
      self.features.add("uneven" if v.shape[dim] % k else "even")
      ax = repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))
      return f"gshard.split({name}, {dim}, {ax})"
    if kind == "replicate":
      self.features.add("annot:replicate")
      return f"gshard.replicate({name})"
    self.features.add("annot:shard")
    return f"gshard.shard({name}, {spec_src(self.spec(v.shape, p=0.55))})"

  # -- meta helpers -------------------------------------------------------------------
  @staticmethod
  def same(v: V, **kw) -> dict:
    m = dict(exact=v.exact, e=v.e, mag=v.mag)
    m.update(kw)
    return m

  def kink_ok(self, v: V) -> bool:
    """A kinked op (in grad mode) or a discontinuous one may take ``v``."""
    return v.exact or not v.is_float

  def discrete_ok(self, v: V) -> bool:
    return v.exact or not v.is_float

  # -- the ops --------------------------------------------------------------------------
  def op_unary_float(self):
    v = self.pick(lambda v: v.is_float)
    ops = [
        ("-{x}", lambda: self.same(v), False, False),
        ("{x} * 0.5", lambda: self.same(v, e=None if v.e is None else v.e - 1,
                                        mag=v.mag / 2), False, False),
        ("{x} * 3", lambda: self.same(v, mag=v.mag * 3), False, False),
        ("{x} * {x}", lambda: self.same(v, e=None if v.e is None else 2 * v.e,
                                        mag=v.mag ** 2), False, False),
        ("jnp.abs({x})", lambda: self.same(v), True, False),
        ("jax.nn.relu({x})", lambda: self.same(v), True, False),
        ("jnp.clip({x}, -1, 1)", lambda: self.same(v, mag=min(v.mag, 1)), True, False),
        ("jnp.sin({x})", lambda: dict(exact=False, mag=1.0), False, False),
        ("jnp.tanh({x})", lambda: dict(exact=False, mag=1.0), False, False),
        ("jax.nn.sigmoid({x})", lambda: dict(exact=False, mag=1.0), False, False),
        ("jnp.exp({x})", lambda: dict(exact=False, mag=math.exp(min(v.mag, 50))), False, False),
        ("jnp.log({x})", lambda: dict(exact=False, mag=60.0 + math.log(v.mag + 1)), False, True),
        ("jnp.sqrt({x})", lambda: dict(exact=False, mag=math.sqrt(v.mag)), False, True),
        ("jnp.floor({x})", lambda: self.same(v, e=0 if v.e is not None else None), True, True),
        ("jnp.sign({x})", lambda: dict(exact=v.exact, e=0, mag=1.0), True, True),
        ("jnp.where(jnp.isnan({x}), 0.0, {x})", lambda: self.same(v), False, False),
        ("jnp.nan_to_num({x}, posinf=9.0, neginf=-9.0)", lambda: self.same(v, mag=max(v.mag, 9)),
         False, False),
    ]
    src, meta, kink, discrete = self.d.choice(ops)
    if src.startswith("jnp.exp") and v.mag > 12:
      raise Reject("exp overflow")
    if discrete and not self.discrete_ok(v):
      raise Reject("discrete op on inexact")
    if kink and self.mode == "grad" and not self.kink_ok(v):
      raise Reject("kink on inexact")
    self.emit(src.format(x=v.name), [v], meta(), "unary:" + src.split("(")[0])

  def op_unary_int(self):
    v = self.pick(lambda v: v.is_int or v.dtype == "bool")
    if v.dtype == "bool":
      src = self.d.choice(["~{x}", "jnp.logical_not({x})"])
      self.emit(src.format(x=v.name), [v], {}, "unary:bool")
      return
    lim = INT_MAX[v.dtype]
    src, mag = self.d.choice([("-{x}", v.mag), ("{x} * 3", v.mag * 3), ("{x} // 2", v.mag),
                              ("{x} % 3", 3), ("jnp.abs({x})", v.mag), ("{x} >> 1", v.mag),
                              ("~{x}", v.mag + 1), ("jnp.clip({x}, -2, 3)", 3)])
    self.emit(src.format(x=v.name), [v], dict(mag=min(mag, lim + 1)), "unary:int")

  def op_cast(self):
    v = self.pick()
    to = self.d.choice([d for d in DTYPES if d != v.dtype])
    if v.is_float and to not in FLOATS and not self.discrete_ok(v):
      raise Reject("float->int of inexact")
    if v.is_float and to in FLOATS:
      meta = self.same(v)
    elif v.is_float:
      meta = dict(mag=min(v.mag, INT_MAX.get(to, 1)))
    elif v.is_int:
      meta = dict(exact=True, e=0, mag=v.mag)
      if to in INTS:
        meta = dict(mag=min(v.mag, INT_MAX[to] + 1))
    else:
      meta = dict(exact=True, e=0, mag=1.0)
    if v.dtype == "bool" or to == "bool":
      src = f"{v.name}.astype(bool)" if to == "bool" else f"{v.name}.astype({to})"
    else:
      src = f"{v.name}.astype({to})"
    if to in FLOATS and meta.get("mag", 1) > MAX_MAG:
      raise Reject("cast magnitude")
    self.emit(src, [v], meta, f"cast:{v.dtype}->{to}")

  def _broadcast_partner(self, v: V, dtype: str | None = None,
                         pred=lambda w: True) -> V:
    """A value broadcast-compatible with ``v`` (same shape, a suffix, size-1 dims, scalar)."""
    dtype = dtype or v.dtype

    def compatible(w):
      if w.dtype != dtype or w.rank > v.rank or not pred(w):
        return False
      return all(a == b or a == 1 for a, b in zip(reversed(w.shape), reversed(v.shape)))

    def make():
      kind = self.d.choice(["same", "same", "scalar", "suffix", "ones"])
      if kind == "same" or not v.rank:
        return v.shape
      if kind == "scalar":
        return ()
      if kind == "suffix":
        return v.shape[self.d.int(1, v.rank):]
      return tuple(1 if self.d.bool(0.5) else n for n in v.shape)
    return self.pick_or_new(compatible, make, dtype)

  def op_binary(self):
    a = self.pick()
    b = self._broadcast_partner(a)
    if self.d.bool(0.5):
      a, b = b, a
    if a.is_float:
      op = self.d.choice(["+", "-", "*", "max", "min"])
    elif a.is_int:
      op = self.d.choice(["+", "-", "*", "max", "min", "&", "|", "^"])
    else:
      op = self.d.choice(["&", "|", "^"])
    if op in ("max", "min"):
      if self.mode == "grad" and not (self.kink_ok(a) and self.kink_ok(b)):
        raise Reject("kink")
      src = f"jnp.{'maximum' if op == 'max' else 'minimum'}({a.name}, {b.name})"
    else:
      src = f"{a.name} {op} {b.name}"
    exact = a.exact and b.exact
    if a.is_float:
      ea, eb = a.e, b.e
      if op in ("+", "-"):
        e = None if ea is None or eb is None else min(ea, eb)
        mag = a.mag + b.mag
      elif op == "*":
        e = None if ea is None or eb is None else ea + eb
        mag = a.mag * b.mag
      else:
        e = None if ea is None or eb is None else min(ea, eb)
        mag = max(a.mag, b.mag)
      meta = dict(exact=exact, e=e, mag=mag)
    elif a.is_int:
      mag = {"+": a.mag + b.mag, "-": a.mag + b.mag, "*": a.mag * b.mag}.get(
          op, max(a.mag, b.mag) * 2)
      meta = dict(mag=min(mag, INT_MAX[a.dtype] + 1))
    else:
      meta = {}
    self.emit(src, [a, b], meta, f"binary:{op}")

  def op_compare(self):
    a = self.pick(lambda v: v.dtype != "bool" and self.discrete_ok(v))
    if self.d.bool(0.4):
      c = self.d.choice(["0", "1", "-1"] if a.is_int else ["0.0", "0.5", "-0.25"])
      op = self.d.choice([">", "==", "<=", "!="])
      self.emit(f"{a.name} {op} {c}", [a], {}, "compare")
      return
    b = self._broadcast_partner(a, pred=self.discrete_ok)
    op = self.d.choice([">", "==", "<=", "!=", "<"])
    self.emit(f"{a.name} {op} {b.name}", [a, b], {}, "compare")

  def op_where(self):
    a = self.pick()
    m = self._broadcast_partner(a, dtype="bool")
    b = self._broadcast_partner(a)
    neg = self.d.choice(["", "~"])
    exact = a.exact and b.exact
    e = None if a.e is None or b.e is None else min(a.e, b.e)
    self.emit(f"jnp.where({neg}{m.name}, {a.name}, {b.name})", [a, m, b],
              dict(exact=exact, e=e, mag=max(a.mag, b.mag)), "where")

  def op_reduce(self):
    v = self.pick(lambda v: v.rank >= 1)
    axis = None if self.d.bool(0.3) else self.d.int(-v.rank, v.rank - 1)
    n = v.size if axis is None else v.shape[axis]
    keep = self.d.bool(0.25)
    kd = ", keepdims=True" if keep else ""
    ax = f"axis={axis}"
    if v.is_float:
      kind = self.d.choice(["sum", "sum", "max", "min", "mean", "x_sum", "logsumexp",
                            "softmax", "argmax", "argmin", "prod", "vmap_psum", "vmap_pmax"])
    elif v.is_int:
      kind = self.d.choice(["sum", "sum_i8", "max", "min", "argmax", "argmin", "prod_i8",
                            "x_sum", "vmap_psum", "vmap_pmax"])
    else:
      kind = self.d.choice(["any", "all", "sum", "argmax", "argmin", "max"])
    sum_exact = v.ongrid and fits(v.dtype, v.e, v.mag * n)
    if kind in ("vmap_psum", "vmap_pmax"):
      # a collective over a vmapped axis: psum[axes=(d,)], the reduction of dim d
      d = 0 if axis is None else axis % v.rank
      n = v.shape[d]
      op = self.d.choice(["pmax", "pmin"]) if kind == "vmap_pmax" else "psum"
      if op != "psum" and self.mode == "grad" and not self.kink_ok(v):
        raise Reject("kink")
      if op != "psum":
        meta = self.same(v) if v.is_float else dict(mag=v.mag)
      elif v.is_float:
        ok = v.ongrid and fits(v.dtype, v.e, v.mag * n)
        meta = dict(exact=ok, e=v.e if ok else None, mag=v.mag * n)
      else:
        meta = dict(mag=min(v.mag * n, INT_MAX[v.dtype] + 1))
      self.emit(f"jax.vmap(lambda r: lax.{op}(r, 'v'), in_axes={d}, axis_name='v')"
                f"({v.name})", [v], meta, f"reduce:vmap_{op}")
      return
    if kind in ("max", "min", "argmax", "argmin") and self.mode == "grad" and \
       not self.kink_ok(v):
      raise Reject("kink")
    if kind in ("argmax", "argmin"):
      if not self.discrete_ok(v):
        raise Reject("argmax of inexact")
      kd = ", keepdims=True" if keep and axis is not None else ""
      self.emit(f"jnp.{kind}({v.name}, {ax}{kd})", [v], {}, f"reduce:{kind}")
    elif kind in ("sum", "mean") and v.is_float:
      if kind == "mean":
        pow2 = n & (n - 1) == 0
        meta = dict(exact=sum_exact and pow2, e=None if v.e is None or not pow2 else
                    v.e - int(math.log2(n)), mag=v.mag)
      else:
        meta = dict(exact=sum_exact, e=v.e if sum_exact else None, mag=v.mag * n)
      self.emit(f"jnp.{kind}({v.name}, {ax}{kd})", [v], meta, f"reduce:{kind}")
    elif kind in ("max", "min"):
      meta = self.same(v) if v.is_float else dict(mag=v.mag)
      self.emit(f"jnp.{kind}({v.name}, {ax}{kd})", [v], meta, f"reduce:{kind}")
    elif kind == "prod":
      if v.mag > 1.0 or n > 6:
        raise Reject("prod magnitude")
      e = None if v.e is None else v.e * n
      self.emit(f"jnp.prod({v.name}, {ax}{kd})", [v],
                dict(exact=v.ongrid and fits(v.dtype, e, 1.0), e=e, mag=1.0), "reduce:prod")
    elif kind == "x_sum":
      # x * jnp.sum(x): x split, the sum must be the full one on every shard
      s_mag = v.mag * v.size
      if v.is_float:
        se = sum_exact and v.ongrid and fits(v.dtype, v.e, s_mag)
        meta = dict(exact=v.exact and se, e=None if v.e is None else 2 * v.e,
                    mag=v.mag * s_mag)
      else:
        meta = dict(mag=min(v.mag * s_mag, INT_MAX[v.dtype] + 1))
      self.emit(f"{v.name} * jnp.sum({v.name})", [v], meta, "reduce:x_sum")
    elif kind == "logsumexp":
      if v.mag > 12:
        raise Reject("exp")
      self.emit(f"jax.nn.logsumexp({v.name}, {ax}{kd})", [v],
                dict(exact=False, mag=v.mag + math.log(n) + 1), "reduce:logsumexp")
    elif kind == "softmax":
      self.emit(f"jax.nn.softmax({v.name}, axis={axis if axis is not None else -1})", [v],
                dict(exact=False, mag=1.0), "reduce:softmax")
    elif kind == "sum_i8":
      self.emit(f"jnp.sum({v.name}, {ax}, dtype=i8{kd})", [v], dict(mag=128), "reduce:sum_i8")
    elif kind == "prod_i8":
      self.emit(f"jnp.prod({v.name}, {ax}, dtype=i8{kd})", [v], dict(mag=128),
                "reduce:prod_i8")
    elif kind == "sum":   # ints and bools: promoted to int32
      self.emit(f"jnp.sum({v.name}, {ax}{kd})", [v], dict(mag=min(v.mag * n, 2 ** 31)),
                "reduce:sum")
    else:                 # any / all
      self.emit(f"jnp.{kind}({v.name}, {ax}{kd})", [v], {}, f"reduce:{kind}")

  def op_dot(self):
    a = self.pick(lambda v: v.rank >= 1 and v.rank <= 3)
    ia = self.d.int(0, a.rank - 1)
    n = a.shape[ia]

    def ok(w):
      return w.dtype == a.dtype and 1 <= w.rank <= 3 and n in w.shape and w is not a

    def make():
      r = self.d.int(1, 2)
      s = list(self.shape(r))
      s[self.d.int(0, r - 1)] = n
      return tuple(s)
    b = self.pick_or_new(ok, make, a.dtype, p_new=0.5)
    ib = self.d.choice([k for k, m in enumerate(b.shape) if m == n])
    if a.rank + b.rank - 2 > 4:
      raise Reject("dot rank")
    if a.is_float:
      e = None if a.e is None or b.e is None else a.e + b.e
      mag = a.mag * b.mag * n
      meta = dict(exact=a.ongrid and b.ongrid and fits(a.dtype, e, mag), e=e, mag=mag)
    elif a.is_int:
      meta = dict(mag=min(a.mag * b.mag * n, INT_MAX[a.dtype] + 1))
    else:
      meta = {}
    form = self.d.choice(["tensordot", "matmul", "einsum"])
    if form == "matmul" and ia == a.rank - 1 and (b.rank == 1 or ib == b.rank - 2):
      src = f"{a.name} @ {b.name}"
    elif form == "einsum":
      la = "abcd"[:a.rank]
      lb = list("efgh"[:b.rank])
      lb[ib] = la[ia]
      lb = "".join(lb)
      lo = la.replace(la[ia], "") + lb.replace(la[ia], "")
      src = f"jnp.einsum('{la},{lb}->{lo}', {a.name}, {b.name})"
    else:
      src = f"jnp.tensordot({a.name}, {b.name}, axes=([{ia}], [{ib}]))"
    self.emit(src, [a, b], meta, f"dot:{a.dtype}")

  def op_shape(self):
    v = self.pick()
    kind = self.d.choice(["transpose", "reshape", "slice", "flip", "roll", "expand",
                          "broadcast", "concat", "stack", "squeeze"])
    m = self.same(v) if v.is_float else dict(mag=v.mag)
    if kind == "transpose" and v.rank >= 2:
      perm = list(range(v.rank))
      self.rng.shuffle(perm)
      src = f"{v.name}.T" if v.rank == 2 and self.d.bool(0.5) else \
          f"jnp.transpose({v.name}, {tuple(int(p) for p in perm)})"
    elif kind == "reshape" and v.rank >= 1:
      s = list(v.shape)
      choice = self.d.int(0, 2)
      if choice == 0 and v.rank >= 2:
        k = self.d.int(0, v.rank - 2)
        s[k:k + 2] = [s[k] * s[k + 1]]
      elif choice == 1:
        k = self.d.int(0, v.rank - 1)
        divs = [f for f in range(2, s[k]) if s[k] % f == 0]
        if not divs or v.rank >= 4:
          raise Reject("no split")
        f = self.d.choice(divs)
        s[k:k + 1] = [f, s[k] // f]
      else:
        s = [-1]
      src = f"{v.name}.reshape({tuple(s)})"
    elif kind == "slice" and v.rank >= 1:
      k = self.d.int(0, v.rank - 1)
      n = v.shape[k]
      lo = self.d.int(0, n - 1)
      hi = self.d.int(lo + 1, n)
      step = self.d.choice([1, 1, 2])
      idx = ", ".join([":"] * k + [f"{lo}:{hi}" + (f":{step}" if step > 1 else "")])
      src = f"{v.name}[{idx}]"
    elif kind == "flip" and v.rank >= 1:
      src = f"jnp.flip({v.name}, {self.d.int(0, v.rank - 1)})"
    elif kind == "roll" and v.rank >= 1:
      k = self.d.int(0, v.rank - 1)
      src = f"jnp.roll({v.name}, {self.d.int(-3, 3)}, axis={k})"
    elif kind == "expand" and v.rank <= 3:
      src = f"jnp.expand_dims({v.name}, {self.d.int(0, v.rank)})"
    elif kind == "broadcast" and v.rank <= 3:
      k = self.d.int(0, v.rank)
      n = self.dim()
      shape = v.shape[:k] + (n,) + v.shape[k:]
      src = f"jnp.broadcast_to(jnp.expand_dims({v.name}, {k}), {shape})"
    elif kind in ("concat", "stack") and v.rank >= 1:
      k = self.d.int(0, v.rank - 1)

      def ok(w):
        if w.dtype != v.dtype or w.rank != v.rank:
          return False
        return all(a == b or (j == k and kind == "concat")
                   for j, (a, b) in enumerate(zip(w.shape, v.shape)))

      def make():
        s = list(v.shape)
        if kind == "concat":
          s[k] = self.dim()
        return tuple(s)
      w = self.pick_or_new(ok, make, v.dtype)
      exact = v.exact and w.exact
      e = None if v.e is None or w.e is None else min(v.e, w.e)
      m = dict(exact=exact, e=e, mag=max(v.mag, w.mag)) if v.is_float else \
          dict(mag=max(v.mag, w.mag))
      fn = "concatenate" if kind == "concat" else "stack"
      self.emit(f"jnp.{fn}([{v.name}, {w.name}], axis={k})", [v, w], m, f"shape:{kind}")
      return
    elif kind == "squeeze" and 1 in v.shape:
      src = f"jnp.squeeze({v.name}, {v.shape.index(1)})"
    else:
      raise Reject("shape op n/a")
    self.emit(src, [v], m, f"shape:{kind}")

  def op_pad(self):
    v = self.pick(lambda v: v.rank >= 1)
    m = self.same(v) if v.is_float else dict(mag=v.mag)
    if self.d.bool(0.25):
      cfg = []
      for n in v.shape:
        lo, hi = self.d.int(-1, 2), self.d.int(-1, 2)
        interior = self.d.int(0, 1) if n > 1 else 0
        if n + lo + hi + interior * (n - 1) < 1:
          lo = hi = 0
        cfg.append((lo, hi, interior))
      pv = {"bool": "False", "i32": "1", "i8": "1"}.get(v.dtype, "0.5")
      dt = {"bool": "bool"}.get(v.dtype, v.dtype)
      if v.is_float and v.e is not None:
        m["e"] = min(v.e, -1)
      self.emit(f"lax.pad({v.name}, jnp.array({pv}, {dt}), {cfg})", [v], m, "pad:lax")
      return
    mode = self.d.choice(["constant", "edge", "edge", "reflect", "wrap", "symmetric"])
    widths = []
    for n in v.shape:
      if self.d.bool(0.5):
        widths.append((0, 0))
      else:
        lim = n - 1 if mode == "reflect" else n if mode in ("wrap", "symmetric") else 3
        widths.append((self.d.int(0, max(0, min(3, lim))), self.d.int(0, max(0, min(3, lim)))))
    if all(w == (0, 0) for w in widths):
      k = self.d.int(0, v.rank - 1)
      widths[k] = (1, 0) if mode != "reflect" or v.shape[k] > 1 else (0, 0)
    extra = ""
    if mode == "constant" and v.dtype != "bool" and self.d.bool(0.5):
      extra = ", constant_values=1"
    self.emit(f"jnp.pad({v.name}, {tuple(widths)}, mode={mode!r}{extra})", [v], m,
              f"pad:{mode}")

  def op_gather(self):
    v = self.pick(lambda v: v.rank >= 1)
    m = self.same(v) if v.is_float else dict(mag=v.mag)
    kind = self.d.choice(["first", "first", "axis1", "take", "along", "scalar2"])
    if kind == "first":
      idx, used = self.index_from(v.shape[0])
      self.emit(f"{v.name}[{idx}]", [v] + used, m, "gather:x[idx]")
    elif kind == "axis1" and v.rank >= 2:
      idx, used = self.index_from(v.shape[1])
      self.emit(f"{v.name}[:, {idx}]", [v] + used, m, "gather:x[:,idx]")
    elif kind == "take":
      ax = self.d.int(0, v.rank - 1)
      n = v.shape[ax]
      mode = self.d.choice(["fill", "clip"])
      idx, used = self.index_from(n, lo=-n - 2, hi=n + 2)
      if mode == "fill" and v.is_float:
        m = dict(m, mag=v.mag)
      self.emit(f"jnp.take({v.name}, {idx}, axis={ax}, mode={mode!r})", [v] + used, m,
                f"gather:take_{mode}")
    elif kind == "along":
      ax = self.d.int(0, v.rank - 1)
      shape = list(v.shape)
      shape[ax] = self.d.int(1, 5)
      idx, used = self.index_from(v.shape[ax], shape=tuple(shape), lo=0)
      self.emit(f"jnp.take_along_axis({v.name}, {idx}, axis={ax})", [v] + used, m,
                "gather:take_along_axis")
    elif kind == "scalar2" and v.rank == 2:
      t = self.d.bool(0.5)
      s0, s1 = (v.shape[1], v.shape[0]) if t else v.shape
      i, ui = self.index_from(s0, shape=())
      j, uj = self.index_from(s1, shape=())
      src = f"{v.name}{'.T' if t else ''}[{i}, {j}]"
      self.emit(src, [v] + ui + uj, m, "gather:scalar2")
    else:
      raise Reject("gather n/a")

  def _start(self, n: int, size: int) -> tuple[str, list[V]]:
    """A scalar start index, often out of range (dynamic_slice clamps it)."""
    if self.d.bool(0.2):   # typed: a Python int would be int64 in the float64 oracle
      return f"i32({self.d.int(0, n - size)})", []
    v = self.index_input((), -2, n + 1)
    return v.name, [v]

  def op_dynamic_slice(self):
    v = self.pick(lambda v: v.rank >= 1)
    m = self.same(v) if v.is_float else dict(mag=v.mag)
    kind = self.d.choice(["in_dim", "full", "index", "update", "update", "update_in_dim"])
    if kind == "in_dim":
      ax = self.d.int(0, v.rank - 1)
      size = self.d.int(1, v.shape[ax])
      s, used = self._start(v.shape[ax], size)
      self.emit(f"lax.dynamic_slice_in_dim({v.name}, {s}, {size}, axis={ax})", [v] + used, m,
                "dslice:in_dim")
    elif kind == "full":
      sizes = tuple(self.d.int(1, n) for n in v.shape)
      starts, used = [], []
      for n, size in zip(v.shape, sizes):
        s, u = self._start(n, size)
        starts.append(s)
        used += u
      self.emit(f"lax.dynamic_slice({v.name}, ({', '.join(starts)},), {sizes})", [v] + used, m,
                "dslice:full")
    elif kind == "index":
      ax = self.d.int(0, v.rank - 1)
      s, used = self._start(v.shape[ax], 1)
      self.emit(f"lax.dynamic_index_in_dim({v.name}, {s}, axis={ax}, keepdims=False)",
                [v] + used, m, "dslice:index")
    else:
      in_dim = kind == "update_in_dim"
      ax = self.d.int(0, v.rank - 1)

      def ok(w):
        if w.dtype != v.dtype or w.rank != v.rank:
          return False
        if in_dim:
          return all(a == b or j == ax and a <= b
                     for j, (a, b) in enumerate(zip(w.shape, v.shape)))
        return all(a <= b for a, b in zip(w.shape, v.shape))

      def make():
        if in_dim:
          s = list(v.shape)
          s[ax] = self.d.int(1, v.shape[ax])
          return tuple(s)
        return tuple(self.d.int(1, n) for n in v.shape)
      u = self.pick_or_new(ok, make, v.dtype, p_new=0.6)
      if self.d.bool(0.4):   # the update annotated (split along an offset dim)
        u = self.emit(self.annotate(u), [u], self.same(u) if u.is_float else
                      dict(mag=u.mag), "annotate")[0]
      uname = u.name
      exact = v.exact and u.exact
      e = None if v.e is None or u.e is None else min(v.e, u.e)
      mm = dict(exact=exact, e=e, mag=max(v.mag, u.mag)) if v.is_float else \
          dict(mag=max(v.mag, u.mag))
      if in_dim:
        s, used = self._start(v.shape[ax], u.shape[ax])
        src = f"lax.dynamic_update_slice_in_dim({v.name}, {uname}, {s}, axis={ax})"
      else:
        starts, used = [], []
        for n, size in zip(v.shape, u.shape):
          s, uu = self._start(n, size)
          starts.append(s)
          used += uu
        src = f"lax.dynamic_update_slice({v.name}, {uname}, ({', '.join(starts)},))"
      self.emit(src, [v, u] + used, mm, "dslice:" + kind)

  def op_scatter(self):
    v = self.pick(lambda v: v.rank >= 1)
    kind = self.d.weighted([(4, "add"), (2, "set"), (1, "max"), (1, "min"), (1, "add2"),
                            (1, "set_scalar")])
    if kind in ("max", "min") and self.mode == "grad" and not self.kink_ok(v):
      raise Reject("kink")
    if v.dtype == "bool" and kind in ("add", "add2"):
      raise Reject("bool add")
    n = v.shape[0]
    if kind == "set_scalar":
      i, used = self.index_from(n, shape=())
      c = {"bool": "True", "i32": "7", "i8": "7"}.get(v.dtype, "-0.5")
      m = self.same(v, mag=max(v.mag, 7)) if v.is_float else dict(mag=max(v.mag, 7))
      if v.is_float and v.e is not None:
        m["e"] = min(v.e, -1)
      self.emit(f"{v.name}.at[{i}].set({c})", [v] + used, m, "scatter:set_scalar")
      return
    two = kind == "add2" and v.rank >= 2
    dim = 1 if two else 0
    nd = v.shape[dim]
    k = self.d.int(1, max(1, min(6, nd if kind == "set" else 6)))
    if kind == "set":
      idx, used = self.index_from(nd, shape=(k,), lo=0, hi=nd - 1, unique=True)
    else:
      idx, used = self.index_from(nd, shape=(k,), lo=-nd, hi=nd + 1)   # may be dropped
    ushape = (k,) + v.shape[1:] if not two else (v.shape[0], k) + v.shape[2:]
    if self.d.bool(0.25):
      ushape = ()
    upd = self.pick_or_new(lambda w: w.dtype == v.dtype and w.shape == tuple(ushape),
                           lambda: tuple(ushape), v.dtype, p_new=0.7)
    if v.is_float:
      exact = v.exact and upd.exact
      e = None if v.e is None or upd.e is None else min(v.e, upd.e)
      mag = v.mag + k * upd.mag if "add" in kind else max(v.mag, upd.mag)
      if "add" in kind:
        exact = exact and v.ongrid and upd.ongrid and fits(v.dtype, e, mag)
      m = dict(exact=exact, e=e, mag=mag)
    else:
      m = dict(mag=min(v.mag + k * upd.mag, INT_MAX.get(v.dtype, 1) + 1))
    op = "add" if kind == "add2" else kind
    target = f"[:, {idx}]" if two else f"[{idx}]"
    self.emit(f"{v.name}.at{target}.{op}({upd.name})", [v, upd] + used, m, f"scatter:{kind}")

  def op_sort(self):
    v = self.pick(lambda v: v.rank >= 1)
    ax = self.d.int(-1, v.rank - 1)
    kind = self.d.choice(["sort", "argsort", "top_k", "top_k", "unique", "cumsum", "cummax",
                          "cumsum", "cumprod"])
    kinked = kind in ("sort", "top_k", "cummax")
    if kinked and self.mode == "grad" and not self.kink_ok(v):
      raise Reject("kink")
    m = self.same(v) if v.is_float else dict(mag=v.mag)
    if kind == "sort":
      self.emit(f"jnp.sort({v.name}, axis={ax})", [v], m, "sort:sort")
    elif kind == "argsort":
      if not self.discrete_ok(v):
        raise Reject("argsort of inexact")
      self.emit(f"jnp.argsort({v.name}, axis={ax})", [v], {}, "sort:argsort")
    elif kind == "top_k":
      if v.dtype == "bool":
        raise Reject("top_k bool")
      n = v.shape[ax]
      k = self.d.int(1, n)
      idx_ok = self.discrete_ok(v)
      if ax in (-1, v.rank - 1):
        src = f"lax.top_k({v.name}, {k})"
      else:
        src = (f"(lambda t: (jnp.moveaxis(t[0], -1, {ax}), jnp.moveaxis(t[1], -1, {ax})))"
               f"(lax.top_k(jnp.moveaxis({v.name}, {ax}, -1), {k}))")
      outs = self.emit(src, [v], [m, {}], "sort:top_k" + ("" if ax in (-1, v.rank - 1)
                                                          else "_axis"))
      if not idx_ok:
        outs[1].hidden = True     # indices of near-ties: not compared
        self.uncomparable.add(outs[1].name)
        self.features.add("top_k:hidden_idx")
    elif kind == "unique":
      if not self.discrete_ok(v):
        raise Reject("unique of inexact")
      size = self.d.int(1, min(v.size, 8))
      fill = {"bool": "False"}.get(v.dtype, "0")
      self.emit(f"jnp.unique({v.name}.reshape(-1), size={size}, fill_value={fill})", [v], m,
                "sort:unique")
    elif kind == "cumsum":
      if v.dtype == "bool":
        raise Reject("cumsum bool")
      n = v.shape[ax]
      if v.is_float:
        ok = v.ongrid and fits(v.dtype, v.e, v.mag * n)
        m = dict(exact=ok, e=v.e if ok else None, mag=v.mag * n)
      else:
        m = dict(mag=min(v.mag * n, INT_MAX[v.dtype] + 1))
      if self.d.int(0, 2) == 0:   # the reverse scan (a cumsum's transpose is one)
        self.emit(f"lax.cumsum({v.name}, axis={ax % v.rank}, reverse=True)", [v], m,
                  "sort:cumsum_reverse")
      else:
        self.emit(f"jnp.cumsum({v.name}, axis={ax})", [v], m, "sort:cumsum")
    elif kind == "cumprod":
      if v.is_float or v.dtype == "bool":   # integer products wrap: any order is exact
        raise Reject("cumprod of a float")
      self.emit(f"lax.cumprod({v.name}, axis={ax % v.rank}, reverse={self.d.int(0, 1) == 1})",
                [v], dict(mag=INT_MAX[v.dtype] + 1), "sort:cumprod")
    else:
      if v.dtype == "bool":
        raise Reject("cummax bool")
      op, rev = self.d.choice(["cummax", "cummin"]), self.d.int(0, 1) == 1
      self.emit(f"lax.{op}({v.name}, axis={ax % v.rank}, reverse={rev})", [v], m,
                f"sort:{op}")

  # -- grouped matmul, approximate top-k, reductions of the program's own computation -------
  def op_ragged_dot(self):
    """``lax.ragged_dot(lhs[m, k], rhs[g, k, n], group_sizes[g])``: row block ``j`` of
    lhs times ``rhs[j]``; rows past the groups' total are zero, groups past ``m`` rows
    are cut. Group sizes: an int32 input (own spec, maybe split) or a constant."""
    dt = self.d.weighted([(4, "f32"), (2, "bf16"), (1, "i32"), (1, "i8")])
    a = self.pick_or_new(lambda v: v.rank == 2 and v.dtype != "bool", lambda: self.shape(2),
                         dt, p_new=0.3)
    m, k = a.shape
    g = self.d.weighted([(2, 1), (3, 2), (3, 3), (2, 4)])
    n = self.dim()
    while g * k * n > MAX_ELEMS // 2 and n > 1:
      n -= 1

    def ok(w):
      return w.dtype == a.dtype and w.rank == 3 and w.shape[1] == k and w is not a

    b = self.pick_or_new(ok, lambda: (g, k, n), a.dtype, p_new=0.85)
    g = b.shape[0]
    # the groups cover fewer rows than m (the rest are zero), all of them, or more
    cover = self.d.weighted([(2, "less"), (3, "all"), (1, "more")])
    total = (self.d.int(0, max(0, m - 1)) if cover == "less" else m if cover == "all"
             else m + self.d.int(1, 2))
    cuts = sorted(self.d.int(0, total) for _ in range(g - 1))
    sizes = np.diff([0] + cuts + [total]).astype(np.int32)
    if self.d.bool(0.6):
      gs = self.new_input((g,), "i32", values=sizes)
      gsrc, used, how = gs.name, [gs], "input"
    else:
      gsrc, used, how = f"jnp.array({sizes.tolist()}, i32)", [], "const"
    if a.is_float:
      e = None if a.e is None or b.e is None else a.e + b.e
      mag = a.mag * b.mag * k
      meta = dict(exact=a.ongrid and b.ongrid and fits(a.dtype, e, mag), e=e, mag=mag)
    else:
      meta = dict(mag=min(a.mag * b.mag * k, INT_MAX[a.dtype] + 1))
    self.features.add(f"ragged_dot:sizes_{how}")
    # ints: in the float64 oracle one of them may be int64 (lax does not promote)
    bsrc = b.name if a.is_float else f"{b.name}.astype({a.name}.dtype)"
    self.emit(f"lax.ragged_dot({a.name}, {bsrc}, {gsrc})", [a, b] + used, meta,
              f"ragged_dot:{a.dtype}")

  def op_approx_top_k(self):
    """``lax.approx_max_k`` / ``approx_min_k`` along a random dim, small k. On CPU it is
    a sort whose comparison is not an order with NaN (which element comes first is up
    to the sort), so NaNs are replaced first; indices are discontinuous and values
    kinked, as for ``top_k``."""
    v = self.pick_or_new(lambda v: v.rank >= 1 and v.is_float,
                         lambda: self.shape(self.d.int(1, 3)),
                         self.d.weighted([(3, "f32"), (1, "bf16")]), p_new=0.25)
    if self.mode == "grad" and not self.kink_ok(v):
      raise Reject("kink")
    ax = self.d.int(-v.rank, v.rank - 1)
    k = self.d.int(1, min(v.shape[ax], 4))
    which = self.d.choice(["max", "min"])
    recall = ", recall_target=0.9" if self.d.bool(0.3) else ""
    src = (f"lax.approx_{which}_k(jnp.where(jnp.isnan({v.name}), 0.0, {v.name}), {k}, "
           f"reduction_dimension={ax}{recall})")
    outs = self.emit(src, [v], [self.same(v), {}], f"approx_top_k:{which}")
    if not self.discrete_ok(v):
      outs[1].hidden = True     # indices of near-ties: not compared
      self.uncomparable.add(outs[1].name)
      self.features.add("approx_top_k:hidden_idx")

  def op_reduce_variadic(self):
    """``lax.reduce`` of two operands with a computation of the program's own over
    random dims: an argmax/argmin of (value, flat index) pairs (NaN wins, then the
    larger/smaller value, then the smaller index: a total order, so any evaluation
    order picks the same pair; the init pair loses to every element), or (sum of one,
    max of the other). In grad mode its float operands are ``stop_gradient``-ed (jax
    has no JVP of a variadic reduce with an operand of zero tangent, e.g. an int one)."""
    v = self.pick(lambda v: v.rank >= 1 and v.dtype != "bool")
    dims = [j for j in range(v.rank) if self.d.bool(0.5)] or [self.d.int(0, v.rank - 1)]
    n = math.prod(v.shape[j] for j in dims)

    def arg(x: V) -> str:
      return f"lax.stop_gradient({x.name})" if self.mode == "grad" and x.is_float else x.name

    # inits typed as the operand: an int value may be int64 in the float64 oracle
    def lowest(x: V, sign: int = -1) -> str:
      if x.is_float:
        c = "-inf" if sign < 0 else "inf"
      else:
        c = -INT_MAX[x.dtype] - 1 if sign < 0 else INT_MAX[x.dtype]
      return f"jnp.array({c}, {x.name}.dtype)"

    def vmeta(x: V) -> dict:
      return self.same(x) if x.is_float else dict(mag=x.mag)

    kind = self.d.weighted([(2, "argmax"), (1, "argmin"), (1.5, "sum_max"), (1, "sum_max_f")])
    if kind in ("argmax", "argmin"):
      strides, s = [], 1
      for j in reversed(dims):
        strides.insert(0, s)
        s *= v.shape[j]
      idx = " + ".join(f"lax.broadcasted_iota(i32, {v.shape}, {j})" +
                       (f" * {st}" if st != 1 else "") for j, st in zip(dims, strides))
      cmp = ">" if kind == "argmax" else "<"
      if v.is_float:
        better = f"(b[0] {cmp} a[0]) | (jnp.isnan(b[0]) & ~jnp.isnan(a[0]))"
        tie = "((b[0] == a[0]) | (jnp.isnan(b[0]) & jnp.isnan(a[0])))"
      else:
        better, tie = f"(b[0] {cmp} a[0])", "(b[0] == a[0])"
      comp = (f"lambda a, b: (lambda t: (jnp.where(t, b[0], a[0]), jnp.where(t, b[1], a[1])))"
              f"({better} | ({tie} & (b[1] < a[1])))")
      init = f"({lowest(v, -1 if kind == 'argmax' else 1)}, i32({INT_MAX['i32']}))"
      src = f"lax.reduce(({arg(v)}, {idx}), {init}, {comp}, {tuple(dims)})"
      outs = self.emit(src, [v], [vmeta(v), {}], f"reduce_variadic:{kind}")
      if not self.discrete_ok(v):
        outs[1].hidden = True     # the index of near-ties: not compared
        self.uncomparable.add(outs[1].name)
        self.features.add("reduce_variadic:hidden_idx")
      return
    if kind == "sum_max":        # (sum of ints, max of v)
      w = self.pick_or_new(lambda w: w.is_int and w.shape == v.shape, lambda: v.shape,
                           self.d.choice(INTS), p_new=0.5)
      wm = dict(mag=min(w.mag * n, INT_MAX[w.dtype] + 1))
    else:                        # (sum of floats, max of v)
      if not v.is_float:
        raise Reject("float sum of ints")
      w = self.pick_or_new(lambda w: w.dtype == v.dtype and w.shape == v.shape,
                           lambda: v.shape, v.dtype, p_new=0.3)
      ok = w.ongrid and fits(w.dtype, w.e, w.mag * n)
      wm = dict(exact=ok, e=w.e if ok else None, mag=w.mag * n)
    comp = "lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1]))"
    init = f"(jnp.array(0, {w.name}.dtype), {lowest(v)})"
    src = f"lax.reduce(({arg(w)}, {arg(v)}), {init}, {comp}, {tuple(dims)})"
    self.emit(src, [w, v], [wm, vmeta(v)], f"reduce_variadic:{kind}")

  # -- control flow ------------------------------------------------------------------
  def _body_fn(self, v: V, var: str) -> tuple[str, dict]:
    """A shape- and dtype-preserving expression of ``var`` (a value like ``v``)."""
    if v.is_float:
      opts = [(f"{var} * 2", dict(e=v.e, mag=v.mag * 2, exact=v.exact)),
              (f"-{var}", self.same(v)),
              (f"{var} + 1", dict(e=None if v.e is None else min(v.e, 0), mag=v.mag + 1,
                                  exact=v.exact)),
              (f"jnp.sin({var})", dict(exact=False, mag=1.0))]
      if v.rank:
        opts += [(f"jnp.flip({var}, 0)", self.same(v)),
                 (f"jnp.cumsum({var}, axis=0)", dict(exact=v.ongrid and fits(
                     v.dtype, v.e, v.mag * v.shape[0]), e=v.e, mag=v.mag * v.shape[0])),
                 (f"{var} * jnp.sum({var})", dict(
                     exact=v.ongrid and fits(v.dtype, None if v.e is None else 2 * v.e,
                                             v.mag * v.mag * v.size),
                     e=None if v.e is None else 2 * v.e, mag=v.mag * v.mag * v.size))]
    elif v.is_int:
      opts = [(f"{var} + 1", dict(mag=v.mag + 1)), (f"{var} * 2", dict(mag=v.mag * 2)),
              (f"-{var}", dict(mag=v.mag))]
    else:
      opts = [(f"~{var}", {}), (var, {})]
      if v.rank:
        opts.append((f"jnp.roll({var}, 1, axis=0)", {}))
    src, m = self.d.choice(opts)
    if self.d.bool(0.25):
      src = self.annotate(v, inside=f"({src})")
    return src, m

  @staticmethod
  def _merge(ms: list[dict], v: V) -> dict:
    if not v.is_float:
      return dict(mag=max([m.get("mag", v.mag) for m in ms] + [v.mag]))
    exact = all(m.get("exact", True) for m in ms) and v.exact
    es = [m.get("e") for m in ms] + [v.e]
    e = None if any(x is None for x in es) else min(es)
    return dict(exact=exact, e=e, mag=max([m.get("mag", v.mag) for m in ms] + [v.mag]))

  def _pred(self) -> tuple[str, list[V]]:
    if self.d.bool(0.5):
      w = self.pick(lambda w: self.discrete_ok(w) and w.dtype != "bool" and w.size >= 1)
      return f"jnp.sum({w.name}) > 0", [w]
    p = self.index_input((), -1, 2)
    return f"{p.name} > 0", [p]

  def op_cond(self):
    v = self.pick()
    if self.d.bool(0.3):
      i = self.index_input((), -1, 3)
      fs = [self._body_fn(v, "a") for _ in range(3)]
      branches = ", ".join(f"lambda a: {s}" for s, _ in fs)
      self.emit(f"lax.switch(jnp.clip({i.name}, 0, 2), [{branches}], {v.name})", [v, i],
                self._merge([m for _, m in fs], v), "control:switch")
      return
    pred, used = self._pred()
    (s1, m1), (s2, m2) = self._body_fn(v, "a"), self._body_fn(v, "a")
    self.emit(f"lax.cond({pred}, lambda a: {s1}, lambda a: {s2}, {v.name})", [v] + used,
              self._merge([m1, m2], v), "control:cond")

  def op_scan(self):
    kind = self.d.choice(["xs", "xs", "arange", "fori"])
    if kind == "fori":
      v = self.pick()
      n = self.d.int(0, 4)
      s, m = self._body_fn(v, "c")
      self.emit(f"lax.fori_loop(0, {n}, lambda i, c: {s}, {v.name})", [v],
                self._grow(v, m, n), "control:fori")
      return
    if kind == "arange":
      # a closed-over (maybe split) array indexed by the loop counter
      v = self.pick(lambda v: v.rank >= 1 and v.dtype != "bool")
      n = v.shape[0]
      sub = v.shape[1:]
      acc = "c + t" if self.d.bool(0.6) else "jnp.maximum(c, t)"
      if "maximum" in acc and self.mode == "grad" and not self.kink_ok(v):
        raise Reject("kink")
      body = f"{acc}"
      if self.d.bool(0.3):
        body = self.annotate(V("c", sub, v.dtype), inside=f"({body})")
      y = "jnp.sum(t)" if v.dtype != "bool" else "jnp.any(t)"
      zero = f"jnp.zeros({sub}, {v.dtype})"
      step = f"lambda c, i: (lambda t: ({body}, {y}))({v.name}[i])"
      cm = self._sum_meta(v, n)
      ym = self._sum_meta(v, math.prod(sub))
      self.emit(f"lax.scan({step}, {zero}, jnp.arange({n}, dtype=i32))", [v], [cm, ym],
                "control:scan_arange")
      return
    xs = self.pick(lambda v: v.rank >= 1)
    sub = xs.shape[1:]
    n = xs.shape[0]
    if xs.is_float:
      acc = self.d.choice(["c * 0.5 + x", "c + x", "jnp.sin(c) + x"])
      y = self.d.choice(["jnp.sum(c * x)", "c", "jnp.max(x)"])
      if y == "jnp.max(x)" and self.mode == "grad" and not self.kink_ok(xs):
        y = "c"
    elif xs.is_int:
      acc, y = self.d.choice(["c + x", "c * 2 + x"]), self.d.choice(["jnp.max(c)", "c"])
    else:
      acc, y = "c ^ x", self.d.choice(["jnp.any(c)", "c"])
    body = acc
    if self.d.bool(0.3):
      body = self.annotate(V("c", sub, xs.dtype), inside=f"({acc})")
    init = self.pick_or_new(lambda w: w.dtype == xs.dtype and w.shape == sub,
                            lambda: sub, xs.dtype, p_new=0.5)
    rev = ", reverse=True" if self.d.bool(0.2) else ""
    cm = self._scan_meta(xs, init, acc, n)
    if y == "c":
      ym = cm
    elif y.startswith("jnp.sum"):
      e = None if cm.get("e") is None or xs.e is None else cm["e"] + xs.e
      mag = cm.get("mag", 1) * xs.mag * max(1, math.prod(sub))
      ym = dict(exact=cm.get("exact", True) and fits(xs.dtype, e, mag) and xs.ongrid,
                e=e, mag=mag)
    else:
      ym = self.same(xs) if xs.is_float else dict(mag=cm.get("mag", 1))
    self.emit(f"lax.scan(lambda c, x: ({body}, {y}), {init.name}, {xs.name}{rev})",
              [init, xs], [cm, ym], "control:scan")

  def _sum_meta(self, v: V, n: int) -> dict:
    if v.is_float:
      ok = v.ongrid and fits(v.dtype, v.e, v.mag * n)
      return dict(exact=ok, e=v.e if ok else None, mag=v.mag * n)
    return dict(mag=min(v.mag * n, INT_MAX.get(v.dtype, 1) + 1))

  def _scan_meta(self, xs: V, init: V, acc: str, n: int) -> dict:
    if not xs.is_float:
      return dict(mag=min((init.mag + xs.mag) * 2 ** n, INT_MAX.get(xs.dtype, 1) + 1))
    mag = init.mag + n * xs.mag
    if "sin" in acc:
      return dict(exact=False, mag=1 + n * xs.mag)
    e = None if xs.e is None or init.e is None else min(xs.e, init.e) - (n if "0.5" in acc
                                                                          else 0)
    ok = xs.ongrid and init.ongrid and fits(xs.dtype, e, mag)
    return dict(exact=ok, e=e if ok else None, mag=mag)

  def _grow(self, v: V, m: dict, n: int) -> dict:
    """Meta after ``n`` applications of a body with one-step meta ``m``."""
    if not v.is_float:
      return dict(mag=min(v.mag * 2 ** n + n, INT_MAX.get(v.dtype, 1) + 1)) \
          if v.is_int else {}
    if n == 0:
      return self.same(v)
    ratio = m.get("mag", v.mag) / max(v.mag, 1e-9)
    mag = v.mag * max(ratio, 1) ** n + n
    exact = m.get("exact", True) and v.exact
    if m.get("e") is None or v.e is None:
      e = None
    else:
      e = min(v.e, m["e"]) if m["e"] >= v.e else v.e + (m["e"] - v.e) * n
    return dict(exact=exact and fits(v.dtype, e, mag) if e is not None else False,
                e=e, mag=mag)

  def op_while(self):
    v = self.pick()
    if self.mode == "grad" and v.is_float:
      operand = f"lax.stop_gradient({v.name})"    # reverse-mode of while_loop is undefined
    else:
      operand = v.name
    if self.d.bool(0.6):
      lim = self.index_input((), -1, 4)
      s, m = self._body_fn(v, "s[1]")
      self.emit(f"lax.while_loop(lambda s: s[0] < {lim.name}, "
                f"lambda s: (s[0] + 1, {s}), (0, {operand}))[1]", [v, lim],
                self._grow(v, m, 4), "control:while")
      return
    # data-dependent trip count: count up an int value until its sum reaches a bound
    w = self.pick(lambda w: w.is_int and w.dtype == "i32" and w.size >= 1)
    s, m = self._body_fn(v, "s[1]")
    self.emit(f"lax.while_loop(lambda s: (jnp.sum(s[0]) < 10) & (s[2] < 4), "
              f"lambda s: (s[0] + 1, {s}, s[2] + 1), ({w.name}, {operand}, 0))[1]", [v, w],
              self._grow(v, m, 4), "control:while_data")

  def op_annotate(self):
    v = self.pick()
    src = self.annotate(v)
    self.emit(src, [v], self.same(v) if v.is_float else dict(mag=v.mag), "annotate",
              hide=self.d.bool(0.7))

  OPS = [("unary_float", 3), ("unary_int", 1.5), ("cast", 1.5), ("binary", 3),
         ("compare", 1.5), ("where", 1.5), ("reduce", 4), ("dot", 3), ("shape", 3),
         ("pad", 1.5), ("gather", 3), ("dynamic_slice", 3), ("scatter", 3), ("sort", 2.5),
         ("cond", 1.2), ("scan", 1.5), ("while", 0.8), ("annotate", 3),
         ("ragged_dot", 0.7), ("approx_top_k", 0.7), ("reduce_variadic", 0.7)]

  # -- the whole program -------------------------------------------------------------
  def generate(self) -> Program:
    n_in = self.d.int(1, 3)
    for _ in range(n_in):
      dt = self.d.weighted([(4, "f32"), (1.5, "bf16"), (1.5, "i32"), (1.5, "i8"),
                            (1.5, "bool")])
      if self.mode == "grad" and not any(x.dtype in FLOATS for x in self.inputs):
        dt = self.d.choice(FLOATS)
      self.new_input(self.shape(), dt)
    done, tries = 0, 0
    self.rejects = []
    while done < self.n_ops and tries < self.n_ops * 12:
      tries += 1
      name = self.d.weighted([(w, n) for n, w in self.OPS])
      saved = (len(self.lines), len(self.vars), len(self.inputs), set(self.features),
               [(v.uses, v.hidden) for v in self.vars])
      try:
        getattr(self, "op_" + name)()
        done += 1
        if self.d.bool(0.2) and name != "annotate":
          try:
            self.op_annotate()
          except Reject:
            pass
      except Reject as r:
        self.rejects.append(str(r))
        # roll back anything the failed op added
        n_lines, n_vars, n_in, feats, uses = saved
        del self.lines[n_lines:]
        for v in self.vars[n_vars:]:
          self._abstract.pop(v.name, None)
        del self.vars[n_vars:]
        for x in self.inputs[n_in:]:
          self._abstract.pop(x.name, None)
        del self.inputs[n_in:]
        self.features = feats
        for v, (u, h) in zip(self.vars, uses):
          v.uses, v.hidden = u, h
    outs = self._outputs()
    mode = self.mode
    if mode == "grad" and not (any(v.is_float for v in outs) and
                               any(x.dtype in FLOATS for x in self.inputs)):
      mode = "value"
    self.features.add(f"mode:{mode}")
    self.features.add(f"mesh:{self.mesh_shape}")
    if any(x.spec for x in self.inputs):
      self.features.add("in_specs")
    return Program(self.mesh_shape, self.axis_names, self.inputs, self.lines,
                   [v.name for v in outs], [v.dtype for v in outs], mode,
                   frozenset(self.features), uncomparable=frozenset(self.uncomparable))

  def _outputs(self) -> list[V]:
    made = [v for v in self.vars if not v.name.startswith("x") and not v.hidden]
    if not made:
      made = [v for v in self.vars if not v.hidden] or self.vars[-1:]
    sinks = [v for v in made if v.uses == 0]
    outs = sinks[-3:] if sinks else made[-1:]
    extra = [v for v in made if v not in outs]
    if extra and self.d.bool(0.3):
      outs.insert(0, self.d.choice(extra))
    return outs


def generate(d: Draw, **kw) -> Program:
  return Gen(d, **kw).generate()


def from_seed(seed: int | str, **kw) -> Program:
  """The program ``make fuzz`` ran for ``seed`` (``"<run seed>-<index>"``)."""
  prog = generate(RandomDraw(random.Random(str(seed))), **kw)
  prog.seed = str(seed)
  return prog


def programs(**kw):
  """A hypothesis strategy of programs: a drawn seed, then :func:`from_seed`.

  Choices drawn one by one from hypothesis (``st.integers`` or ``st.randoms``)
  lean towards each choice's first option and starve the generator (replicated
  specs, the first op kind); a drawn seed keeps ``make fuzz``'s distribution,
  and derandomized runs stay reproducible. (Shrinking is off in test_fuzz.)
  """
  from hypothesis import strategies as st
  return st.builds(lambda s: from_seed(f"h-{s}", **kw), st.integers(0, 2 ** 63 - 1))
