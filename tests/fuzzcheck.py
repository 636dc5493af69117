"""Run a fuzz :class:`~fuzzgen.Program` three ways and classify the outcome.

The reference is ``jax.jit(f)`` on one device. ``gshard.partition(f, mesh,
in_specs)`` (and, side by side, ``gshard.gspmd_jit``) must return the same
tree of arrays, with the same shapes and dtypes, and:

* **bool and integer leaves equal, bit for bit.** The generator only applies
  discontinuous ops (comparisons, argmax, argsort, top_k indices, float->int
  casts, floor, unique, log/sqrt...) to values whose bits do not depend on
  evaluation order (see ``fuzzgen``), so any difference is a wrong value.
* **Non-finite positions equal**: where the one-device result (or the float64
  oracle below) is NaN, +inf or -inf, the partitioned one must be the same.
* **Floats within a derived bound.** Reordering a computation (local sums,
  then a cross-device sum; a dot split over its contracting dim) changes its
  rounding, not its value. Let ``o`` be the float64 *oracle* (the same program
  traced with every float dtype f64, inputs upcast), ``s`` the one-device
  result, ``p`` the partitioned one, ``u = 2**-t`` the unit roundoff of the
  least precise float dtype in the program (t = 24 for f32, 8 for bf16) and
  ``S`` the *running-error scale* of the element (below). An element passes if

      |p - o| <= 2 |s - o| + C u max(S, |o|),     C = 8.

  Why: in the standard model every rounding of a value ``y`` errs by at most
  ``u |y|``, and a first-order error analysis bounds the error of any
  evaluation order of the program by a small multiple of ``u S``, where ``S``
  accumulates the magnitudes of everything that was rounded on the way
  (``S(a+b) = S(a)+S(b)``, ``S(sum x) = sum S(x)``, ``S(dot(a,b)) =
  dot(S(a),S(b))`` and likewise for ``ragged_dot`` with the same group sizes,
  ``S(f(a)) = |f(a)| + |f'(a)| S(a)``, a ``lax.reduce`` of the program's own
  computation reduces (value, scale) pairs with that computation interpreted on
  pairs, ...). For a sum that is ``sum |x_i|``, not ``|sum x_i|``, so
  catastrophic cancellation in the program is not blamed on the partitioner. ``2 |s - o|``: the one-device
  program is one valid evaluation order; a reordering may err about as much
  (the worst-case bound grows with the reduction length n, the typical error
  with sqrt(n); the one-device error measures the actual conditioning).
  ``C u S``: the floor for elements where the one-device error happens to
  be ~0; C = 8 covers a few roundings per term (local sum, cast to bf16,
  a cross-device sum tree of depth <= 3, the final cast), no more. A wrong
  value (a missed, doubled or misplaced term) errs by about one term, which
  for f32 is ~10^5 times more than this bound.

  ``S`` comes from an abstract interpreter over the float64 jaxpr (the
  program *or* its ``value_and_grad``, so backward passes are covered) that
  evaluates each primitive on the values and a rule on the scales; control
  flow is interpreted with ``lax.scan``/``while_loop``/``switch`` on (value,
  scale) pairs. A primitive without a rule gets ``|out| + max S(inputs)``
  (conservative) and is counted in ``SCALE_FALLBACKS``.

  A cheap sufficient test runs first and avoids the oracle for most programs:
  ``|p - s| <= C u |s|`` implies the bound (``|s| <= |s-o| + S`` and
  ``C u <= 1``).

Outcomes (:class:`Outcome`): ``pass``; ``wrong`` (which leaf, what kind, the
largest error and its bound); ``crash`` (exception type and first line; where
it was raised: an exception raised inside ``gshard/`` is ``internal``);
``gspmd`` has ``refuse`` instead of ``crash`` (jax/XLA rejecting the
shardings, e.g. uneven ``in_shardings``). ``warned``: a
``gshard.PartitionWarning`` was emitted (the safe path: allowed, counted).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import re
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

import gshard
from fuzzgen import FLOATS, PRECISION, Program

C = 8.0
SCALE_FALLBACKS: collections.Counter = collections.Counter()


# -- the running-error scale interpreter ------------------------------------------------

def _isfloat(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _abs(x):
  return jnp.abs(jnp.asarray(x, jnp.float64))


def _clean(s, shape):
  s = jnp.asarray(s, jnp.float64)
  s = jnp.where(jnp.isfinite(s), s, 0.0)
  return jnp.broadcast_to(s, shape)


def _closed(j) -> tuple[Jaxpr, list]:
  if isinstance(j, ClosedJaxpr):
    return j.jaxpr, list(j.consts)
  return j, []


def _eval(jaxpr: Jaxpr, consts, args):
  """Interpret ``jaxpr`` on (value, scale) pairs; scale None for non-floats."""
  env = {}

  def read(v):
    if isinstance(v, Literal):
      val = v.val
      return val, (_abs(val) if _isfloat(val) else None)
    return env[v]

  def write(v, val, s):
    if _isfloat(val):
      s = _abs(val) if s is None else _clean(s, jnp.shape(val))
    else:
      s = None
    env[v] = (val, s)

  for v, c in zip(jaxpr.constvars, consts):
    write(v, c, None)
  for v, (a, s) in zip(jaxpr.invars, args):
    write(v, a, s)
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    outs = _rule(eqn, ins)
    for v, (o, s) in zip(eqn.outvars, outs):
      write(v, o, s)
  return [read(v) for v in jaxpr.outvars]


_STRUCTURAL = {"reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims",
               "slice", "rev", "copy", "copy_p", "reduce_precision", "reduce_sum",
               "cumsum", "reduce_max", "reduce_min", "cummax", "cummin", "reduce_prod",
               "cumprod", "split", "unstack", "real"}
_MAXLIKE_2 = {"max", "min"}
_ELEMENTWISE_D = {   # |f'(a)| as a function of (a, out)
    "sin": lambda a, o: 1.0, "cos": lambda a, o: 1.0, "tanh": lambda a, o: 1.0,
    "logistic": lambda a, o: 0.25, "erf": lambda a, o: 1.2,
    "exp": lambda a, o: jnp.abs(o), "exp2": lambda a, o: 0.7 * jnp.abs(o),
    "expm1": lambda a, o: jnp.abs(o) + 1, "log": lambda a, o: 1 / jnp.abs(a),
    "log1p": lambda a, o: 1 / jnp.abs(1 + a), "sqrt": lambda a, o: 0.5 / jnp.abs(o),
    "rsqrt": lambda a, o: 0.5 * jnp.abs(o) ** 3, "square": lambda a, o: 2 * jnp.abs(a),
    "atan": lambda a, o: 1.0, "tan": lambda a, o: 1 + o * o,
    "asinh": lambda a, o: 1.0, "sinh": lambda a, o: jnp.cosh(a),
    "cosh": lambda a, o: jnp.abs(jnp.sinh(a)),
}
_ZERO_ERROR = {"floor", "ceil", "round", "sign", "iota", "nextafter", "is_finite", "empty",
               "empty2"}
_IDENTITY = {"sharding_annotation", "annotate", "optimization_barrier", "stop_gradient", "pvary", "copy"}


def _rule(eqn, ins):
  name = eqn.primitive.name
  p = eqn.params
  vals = [x for x, _ in ins]
  S = [s for _, s in ins]

  # -- higher-order primitives: interpret inside ----------------------------------------
  inner = p.get("jaxpr") if name in ("jit", "pjit", "closed_call", "core_call",
                                     "checkpoint", "remat", "remat2") else None
  if name in ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"):
    inner = p.get("call_jaxpr") or p.get("fun_jaxpr")
  if inner is not None:
    j, c = _closed(inner)
    return _eval(j, c, ins)
  if name == "scan":
    j, c = _closed(p["jaxpr"])
    nc, ncar = p["num_consts"], p["num_carry"]
    consts, init, xs = ins[:nc], ins[nc:nc + ncar], ins[nc + ncar:]

    def step(carry, x):
      out = _eval(j, c, consts + list(carry) + list(x))
      return tuple(out[:ncar]), tuple(out[ncar:])
    carry, ys = lax.scan(step, tuple(init), tuple(xs), length=p["length"],
                         reverse=p["reverse"])
    return list(carry) + list(ys)
  if name == "while":
    cj, cc = _closed(p["cond_jaxpr"])
    bj, bc = _closed(p["body_jaxpr"])
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
    out = lax.while_loop(lambda carry: _eval(cj, cc, cconsts + list(carry))[0][0],
                         lambda carry: tuple(_eval(bj, bc, bconsts + list(carry))),
                         tuple(init))
    return list(out)
  if name == "cond":
    branches = [_closed(b) for b in p["branches"]]
    ops = tuple(ins[1:])
    fns = [lambda o, j=j, c=c: tuple(_eval(j, c, list(o))) for j, c in branches]
    return list(lax.switch(vals[0], fns, ops))

  # -- first-order primitives --------------------------------------------------------------
  out = eqn.primitive.bind(*vals, **p)
  outs = list(out) if eqn.primitive.multiple_results else [out]
  res = _scales(name, p, vals, S, outs, eqn)
  return list(zip(outs, res))


def _scales(name, p, vals, S, outs, eqn):
  o = outs[0]
  if not any(_isfloat(x) for x in outs):
    return [None] * len(outs)
  fS = [s for s in S if s is not None]
  if name in _IDENTITY:
    return [s for s in S[:len(outs)]]
  if name in _STRUCTURAL and S[0] is not None:
    r = eqn.primitive.bind(S[0], **p)
    return list(r) if eqn.primitive.multiple_results else [r]
  if name == "convert_element_type":
    return [S[0] if S[0] is not None else _abs(o)]
  if name in _ZERO_ERROR:
    return [_abs(o)]
  if name in ("neg", "abs"):
    return [S[0]]
  if name in ("add", "sub", "add_any"):
    return [S[0] + S[1]]
  if name == "mul":
    return [S[0] * S[1]]
  if name == "div":
    b = _abs(vals[1])
    return [_abs(o) + (S[0] + _abs(o) * S[1]) / b]
  if name == "rem":
    return [_abs(o) + S[0] + S[1]]
  if name in _MAXLIKE_2:
    return [jnp.maximum(S[0], S[1])]
  if name == "clamp":
    return [jnp.maximum(jnp.maximum(S[0], S[1]), S[2])]
  if name == "integer_pow":
    y = p["y"]
    return [_abs(o) + abs(y) * _abs(vals[0]) ** (y - 1) * S[0]]
  if name == "pow":
    a, b = vals
    return [_abs(o) + _abs(b * a ** (b - 1)) * S[0] + _abs(o * jnp.log(_abs(a))) * S[1]]
  if name in _ELEMENTWISE_D:
    d = _ELEMENTWISE_D[name](vals[0], o)
    return [_abs(o) + jnp.abs(d) * S[0]]
  if name == "dot_general":
    return [lax.dot_general(S[0], S[1], p["dimension_numbers"],
                            preferred_element_type=jnp.float64)]
  if name == "stack" and all(x is not None for x in S):
    return [eqn.primitive.bind(*S, **p)]
  if name == "concatenate":
    return [lax.concatenate(S, p["dimension"])]
  if name == "pad":
    return [lax.pad(S[0], S[1], p["padding_config"])]
  if name == "select_n":
    return [lax.select_n(vals[0], *S[1:])]
  if name == "dynamic_slice":
    return [lax.dynamic_slice(S[0], vals[1:], p["slice_sizes"])]
  if name == "dynamic_update_slice":
    return [lax.dynamic_update_slice(S[0], S[1], vals[2:])]
  if name == "gather":
    return [eqn.primitive.bind(S[0], vals[1], **p)]
  if name in ("scatter-add", "scatter_add", "scatter-sub", "scatter", "scatter-mul",
              "scatter_mul", "scatter-max", "scatter_max", "scatter-min", "scatter_min"):
    q = dict(p)
    if name in ("scatter-sub",):
      return [_abs(o) + jnp.max(S[0]) + jnp.max(S[2])]
    return [eqn.primitive.bind(S[0], vals[1], S[2], **q)]
  if name == "sort":
    n = len(vals)
    extra = [s for s in S if s is not None]
    pos = [k for k, s in enumerate(S) if s is not None]
    r = eqn.primitive.bind(*vals, *extra, **p)
    res = [None] * n
    for k, s in zip(pos, r[n:]):
      res[k] = s
    return res
  if name == "top_k":
    axis = p.get("axis", -1)
    return [jnp.take_along_axis(S[0], outs[1], axis=axis), None]
  if name == "approx_top_k":
    return [jnp.take_along_axis(S[0], outs[1], axis=p["reduction_dimension"]), None]
  if name in ("argmax", "argmin"):
    return [None]
  if name == "ragged_dot_general" and S[0] is not None and S[1] is not None:
    # like a dot: the same grouped matmul of the scales, with the same group sizes
    return [eqn.primitive.bind(S[0], S[1], *vals[2:], **p)]
  if name == "reduce" and "jaxpr" in p:
    try:
      return _reduce_scales(p, vals, S)
    except Exception:  # noqa: BLE001 - a computation the interpreter cannot run: fall back
      pass
  # no rule: |out| + the largest input scale (conservative)
  SCALE_FALLBACKS[name] += 1
  big = functools.reduce(jnp.maximum, [jnp.max(s) for s in fS], jnp.float64(0))
  return [(_abs(x) + big) if _isfloat(x) else None for x in outs]


def _reduce_scales(p, vals, S):
  """``lax.reduce`` of the program's own computation: the same reduction over
  (value, scale) pairs, the computation interpreted on pairs (a selection picks
  the scale of the element it picks, a sum adds the scales); the init values'
  scales are 0 (an identity adds no rounding)."""
  j, c = _closed(p["jaxpr"])
  n = len(vals) // 2
  fl = [k for k in range(n) if S[k] is not None]

  def pairs(t):
    s = [None] * n
    for q, k in enumerate(fl):
      s[k] = t[n + q]
    return list(zip(t[:n], s))

  def comp(a, b):
    out = _eval(j, c, pairs(a) + pairs(b))
    return tuple(o for o, _ in out) + tuple(out[k][1] for k in fl)

  ops = tuple(vals[:n]) + tuple(S[k] for k in fl)
  inits = tuple(vals[n:]) + tuple(jnp.zeros((), jnp.float64) for _ in fl)
  r = lax.reduce(ops, inits, comp, p["dimensions"])
  res = [None] * n
  for q, k in enumerate(fl):
    res[k] = r[n + q]
  return res


def oracle(prog: Program):
  """(values, scales) of the float64 program, one pair per output leaf."""
  with jax.enable_x64(True):
    fn = prog.build(oracle=True)
    args = prog.args(oracle=True)
    closed = jax.make_jaxpr(fn)(*args)

    def run(*xs):
      ins = [(x, _abs(x) if _isfloat(x) else None) for x in xs]
      out = _eval(closed.jaxpr, closed.consts, ins)
      return [v for v, _ in out], [s for _, s in out]
    vals, scales = jax.jit(run)(*args)
    return [np.asarray(v) for v in vals], [None if s is None else np.asarray(s)
                                           for s in scales]


# -- comparison -----------------------------------------------------------------------------

@dataclasses.dataclass
class Mismatch:
  leaf: str
  kind: str          # "tree", "shape", "dtype", "int", "bool", "nonfinite", "float"
  detail: str
  dtype: str = ""

  def __str__(self):
    return f"{self.leaf} ({self.dtype}): {self.kind}: {self.detail}"


def leaf_names(prog: Program, n: int) -> list[str]:
  if prog.mode == "grad":
    names = ["loss"] + [f"grad[{prog.inputs[i].name}]" for i in prog.float_argnums]
  else:
    names = [f"out[{k}]:{prog.outputs[k]}" for k in range(len(prog.outputs))]
  return (names + [f"leaf{k}" for k in range(len(names), n)])[:n]


def unit_roundoff(prog: Program) -> float:
  ds = [d for d in prog.dtypes if d in FLOATS] or ["f32"]
  return 2.0 ** -min(PRECISION[d] for d in ds)


def _cls(x):
  return np.where(np.isnan(x), 1, np.where(np.isposinf(x), 2, np.where(np.isneginf(x), 3, 0)))


def compare(prog: Program, got, want, get_oracle) -> list[Mismatch]:
  """Mismatches of ``got`` against the one-device ``want``; [] when it passes.
  State split unevenly comes back a ``gshard.PaddedArray``: its logical value
  is compared."""
  g_leaves, g_tree = jax.tree.flatten(gshard.unpad(got))
  w_leaves, w_tree = jax.tree.flatten(want)
  if g_tree != w_tree:
    return [Mismatch("all", "tree", f"{g_tree} != {w_tree}")]
  names = leaf_names(prog, len(w_leaves))
  u = unit_roundoff(prog)
  out = []
  for k, (g, w, nm) in enumerate(zip(g_leaves, w_leaves, names)):
    g, w = np.asarray(g), np.asarray(w)
    dt = str(w.dtype)
    if g.shape != w.shape:
      out.append(Mismatch(nm, "shape", f"{g.shape} != {w.shape}", dt))
      continue
    if g.dtype != w.dtype:
      out.append(Mismatch(nm, "dtype", f"{g.dtype} != {w.dtype}", dt))
      continue
    if not jnp.issubdtype(w.dtype, jnp.floating):
      bad = g != w
      if bad.any():
        kind = "bool" if w.dtype == np.bool_ else "int"
        pos = np.argwhere(bad)[:3].tolist()
        out.append(Mismatch(nm, kind, f"{int(bad.sum())}/{w.size} differ, first at {pos}: "
                            f"got {g[bad][:4].tolist()} want {w[bad][:4].tolist()}", dt))
      continue
    p64, s64 = g.astype(np.float64), w.astype(np.float64)
    cp, cs = _cls(p64), _cls(s64)
    with np.errstate(invalid="ignore"):
      quick = ((cp == cs) & ((cp != 0) | (np.abs(p64 - s64) <= C * u * np.abs(s64))))
    if quick.all():
      continue
    vals, scales = get_oracle()
    o = np.asarray(vals[k], np.float64).reshape(w.shape)
    S = scales[k]
    S = np.abs(o) if S is None else np.maximum(np.asarray(S, np.float64).reshape(w.shape),
                                               np.where(np.isfinite(o), np.abs(o), 0))
    co = _cls(o)
    with np.errstate(invalid="ignore"):
      bound = 2 * np.abs(s64 - o) + C * u * S + 1e-30
      err = np.abs(p64 - o)
      fin_ok = (cp == 0) & (co == 0) & (err <= bound)
    ok = quick | ((cp == cs) & (cp != 0)) | ((cp == co) & (cp != 0)) | fin_ok
    if ok.all():
      continue
    bad = ~ok
    nonfin = bad & ((cp != 0) | (cs != 0) | (co != 0))
    idx = tuple(np.argwhere(bad)[0])
    if nonfin.any():
      idx = tuple(np.argwhere(nonfin)[0])
      out.append(Mismatch(nm, "nonfinite", f"{int(bad.sum())}/{w.size} differ, at "
                          f"{list(map(int, idx))}: got {p64[idx]} want {s64[idx]} "
                          f"(f64 {o[idx]})", dt))
      continue
    fb = np.where(bad, err, 0)
    j = tuple(np.unravel_index(np.argmax(fb), fb.shape))
    out.append(Mismatch(nm, "float", f"{int(bad.sum())}/{w.size} beyond bound, worst at "
                        f"{list(map(int, j))}: got {p64[j]:.6g} want {s64[j]:.6g} "
                        f"(f64 {o[j]:.6g}); err {err[j]:.3g} > bound {bound[j]:.3g}", dt))
  return out


# -- running -------------------------------------------------------------------------------

@dataclasses.dataclass
class Outcome:
  status: str                  # pass / wrong / crash / refuse / checker / reference
  detail: str = ""
  where: str = ""              # crash: "internal" (raised in gshard/) or the module
  mismatches: list = dataclasses.field(default_factory=list)
  warned: bool = False
  safe_path: tuple = ()        # primitives (and why) that took the safe path

  fallback: "Outcome | None" = None   # gspmd: the run with in_specs as constraints

  @property
  def key(self) -> str:
    """The failure class, for counting (numbers and mesh details normalized away)."""
    if self.status in ("pass", "skip", "reference"):
      return self.status
    if self.status == "wrong":
      kinds = sorted({f"{m.kind}:{m.dtype}" for m in self.mismatches})
      return "wrong " + ",".join(kinds)
    line = self.detail.splitlines()[0] if self.detail else ""
    line = re.sub(r"NamedSharding\(mesh=Mesh\(.*", "NamedSharding(...)", line)
    line = re.sub(r"\d+", "N", line)[:100]
    where = re.sub(r":\d+", "", self.where)
    return f"{self.status} {line} [{where}]"


@dataclasses.dataclass
class Result:
  prog: Program
  single_error: str | None
  gshard: Outcome | None
  gspmd: Outcome | None


def _where(e: BaseException) -> str:
  tb = traceback.extract_tb(e.__traceback__)
  for fr in reversed(tb):
    f = fr.filename.replace(os.sep, "/")
    if "/gshard/" in f and "/tests/" not in f:
      return "internal " + f.split("/gshard/", 1)[1] + f":{fr.lineno} {fr.name}"
  for fr in reversed(tb):
    f = fr.filename.replace(os.sep, "/")
    if "/jax/" in f:
      return "jax " + f.split("/jax/", 1)[1] + f":{fr.lineno}"
  return tb[-1].filename if tb else "?"


def _first_line(e: BaseException) -> str:
  msg = str(e).strip().splitlines()
  return f"{type(e).__name__}: {msg[0] if msg else ''}"


def run_one(prog: Program, fn_maker, want, get_oracle, refuse_status="crash",
            op_by_op=None) -> Outcome:
  with warnings.catch_warnings(record=True) as ws:
    warnings.simplefilter("always", gshard.PartitionWarning)
    try:
      step = fn_maker()
      got = jax.block_until_ready(step(*prog.args()))
    except Exception as e:  # noqa: BLE001 - classified
      return Outcome(refuse_status, _first_line(e), _where(e))
  warned = any(issubclass(w.category, gshard.PartitionWarning) for w in ws)
  safe = tuple(sorted({re.sub(r"\d+", "N", m.group(1)) for w in ws
                       if issubclass(w.category, gshard.PartitionWarning)
                       for m in [re.search(r"no partition rule for (.*?) at ", str(w.message))]
                       if m}))
  try:
    mm = compare(prog, got, want, get_oracle)
  except Exception as e:  # noqa: BLE001 - the oracle failed: not gshard's fault
    return Outcome("checker", _first_line(e), _where(e), warned=warned, safe_path=safe)
  if mm and op_by_op is not None:
    # XLA can miscompile the one-device program itself (seen: a fused
    # dynamic_slice / dynamic_update_slice pair with a clamped start). The
    # same program run op by op (``jax.disable_jit``, each primitive compiled
    # alone) is the semantics jax documents: equal to it is not a wrong value.
    eager_want, eager_oracle = op_by_op()
    if not compare(prog, got, eager_want, eager_oracle):
      return Outcome("reference", "jax.jit of the one-device program differs from its "
                     "op-by-op run, which this equals", mismatches=mm, warned=warned,
                     safe_path=safe)
  return Outcome("wrong" if mm else "pass", mismatches=mm, warned=warned, safe_path=safe)


def check(prog: Program, gspmd: bool = True, do_gshard: bool = True,
          on_stage=None) -> Result:
  """Run ``prog`` on one device, through gshard and (``gspmd``) through GSPMD.

  ``on_stage(name, outcome)`` is called after the one-device run
  (``"reference"``, no outcome) and after each of the two (a driver that runs
  this in a subprocess learns which one took the process down).
  """
  fn = prog.build()
  args = prog.args()
  try:
    want = jax.block_until_ready(jax.jit(fn)(*args))
  except Exception as e:  # noqa: BLE001 - a generator bug: counted, not blamed
    return Result(prog, _first_line(e), None, None)
  if on_stage is not None:
    on_stage("reference", None)
  cache = []

  def get_oracle():
    if not cache:
      cache.append(oracle(prog))
    return cache[0]

  eager = []

  def op_by_op():
    """The one-device run and its float64 oracle, primitive by primitive."""
    if not eager:
      with jax.disable_jit():   # jax arrays: numpy ones have no ``.at`` outside a trace
        eager.append((jax.block_until_ready(fn(*jax.tree.map(jnp.asarray, args))),
                      oracle(prog)))
    w, o = eager[0]
    return w, lambda: o

  from helpers_partition import mesh as cached_mesh
  mesh = cached_mesh(prog.mesh_shape, prog.axis_names)
  in_specs = prog.in_specs
  g = run_one(prog, lambda: gshard.partition(fn, mesh, in_specs=in_specs), want,
              get_oracle, op_by_op=op_by_op) if do_gshard else None
  if on_stage is not None and g is not None:
    on_stage("gshard", g)
  x = None
  if gspmd:
    x = run_one(prog, lambda: gshard.gspmd_jit(fn, mesh, in_specs=in_specs), want,
                get_oracle, refuse_status="refuse", op_by_op=op_by_op)
    if x.status == "refuse":
      # jit's in_shardings must divide evenly; give GSPMD the same intent as
      # sharding constraints on the arguments (XLA pads uneven ones itself)
      def constrained(*a):
        return fn(*[v if s is None else gshard.shard(v, s) for v, s in zip(a, in_specs)])
      x.fallback = run_one(prog, lambda: gshard.gspmd_jit(constrained, mesh), want,
                           get_oracle, op_by_op=op_by_op)
  return Result(prog, None, g, x)


def _cone(prog: Program, targets: set[str]) -> set[int]:
  """Indices of the lines the values ``targets`` depend on."""
  need, out = set(targets), set()
  for k in reversed(range(len(prog.lines))):
    names = prog.defined(prog.lines[k])
    if need & set(names):
      out.add(k)
      need |= set(re.findall(r"\b[vux]\d+\b", prog.lines[k].split(" = ", 1)[1]))
  return out


def localize(prog: Program, log=print, outcome: Outcome | None = None):
  """The first line of ``prog`` whose values differ (or that crashes) under gshard.

  Runs prefixes of the program whose outputs are the values the last line
  defines (value mode); when every forward value agrees and ``prog`` is a grad
  program, the same with ``value_and_grad`` of each prefix. Returns (line
  number, line, mode, Outcome) or None. Changing the outputs can change the
  shardings propagation picks, so this is a guide, not a proof.
  """
  modes = ["value"] + (["grad"] if prog.mode == "grad" else [])
  cone = set(range(len(prog.lines)))
  if outcome is not None and outcome.status == "wrong" and prog.mode == "value":
    bad = {m.leaf.split(":")[-1] for m in outcome.mismatches}
    cone = _cone(prog, bad & set(prog.outputs)) or cone
  for mode in modes:
    for k, line in enumerate(prog.lines):
      if k not in cone:
        continue
      outs = [n for n in prog.defined(line) if n not in prog.uncomparable]
      if not outs:
        continue
      sub = dataclasses.replace(prog, lines=prog.lines[:k + 1], outputs=outs, mode=mode)
      r = check(sub, gspmd=False)
      if r.single_error:
        continue
      if r.gshard.status not in ("pass",):
        log(f"first divergence ({mode}): line {k + 1}: {line}\n  {r.gshard.key}"
            + "".join(f"\n    {m}" for m in r.gshard.mismatches))
        return k + 1, line, mode, r.gshard
  log("no prefix diverges on its own")
  return None
