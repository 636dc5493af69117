"""Tolerances of train-step comparisons, derived from a float64 run.

A partitioned f32 step and its 1-device f32 run (``jax.jit``) compute the same
sums in different orders: the partitioned program adds per-device partial sums
and then all-reduces them, and XLA fuses each program its own way. Neither is
exact, so they cannot be compared bit for bit, and a fixed ``atol``/``rtol``
is a guess that either hides bugs or fails on an unlucky element (it did: one
of 16384 MoE expert weights was 6.3e-6 off after an Adam step, atol 1e-6).
Instead each step is run a third time, on one device in float64 from the same
input state (``f64_run``), and both f32 results are compared with that run
(``assert_close_to_f64``):

* ``E``, a leaf's f32 rounding scale: the 1-device f32 run's largest error on
  the leaf, floored at one f32 unit roundoff of the leaf's largest value,
  ``max(max|want - exact|, u max|exact|)``, ``u = 2**-24``. The floor covers a
  leaf that the 1-device run happens to get exactly right.
* ``K = sqrt(n)``, ``n`` the length of the step's longest reduction (the batch
  tokens that every weight gradient sums over). Higham's bound on the error of
  a sum of ``n`` terms in f32, ``(n - 1) u sum|t_i|``, holds for every order of
  the sum, while rounding errors that behave like independent signs give
  ``sqrt(n) u sum|t_i|``: no order is worse than about ``sqrt(n)`` times the
  typical error, which the 1-device run's ``E`` measures for this leaf's terms.
* Every element of a partitioned leaf is within ``K E`` of the f64 run; Adam's
  parameters get their own bound, below. A partitioning bug (a missing or
  doubled all-reduce, a wrong block) makes errors of the size of the values,
  ``1/u = 1.7e7`` times the rounding scale, far outside ``K ~ 11``; the bound
  catches a 1e-4 relative change of a single leaf.
* The 1-device f32 run itself is within ``n u`` of the f64 run, relative to
  each leaf's largest value (the worst-case sum bound): the f64 run computes
  the same thing (the same dropout masks, the same expert routing), so ``K E``
  is a rounding bound and never a vacuous one. Integer leaves (step counters)
  are equal.

Adam (``adam=AdamSpec``). The update is ``theta -= lr (f + wd theta)``,
``f = m^ / (sqrt(v^) + eps)``, with the moments ``mu = b1 mu0 + (1 - b1) g``,
``nu = b2 nu0 + (1 - b2) g^2`` and their bias corrections ``m^ = mu / c1``,
``v^ = nu / c2``, ``c = 1 - b^t``. The division by ``sqrt(v^) + eps``
amplifies gradient noise where the gradient is small: at the first step ``f =
g / (|g| + eps)``, whose derivative ``eps / (|g| + eps)^2`` is ``1e8`` at ``g =
0``; a gradient below its own f32 noise (the flaky expert weight's was 6.6e-9
against a noise of 7e-9) has no sign at f32 precision, and its parameter may
move anywhere in ``+-lr``. No tolerance scaled to the parameters holds there,
and one scaled to the worst case (``2 lr``) tests nothing elsewhere. So:

* the moments are leaves like any other (``K E``): linear and quadratic in
  ``g``, not amplified;
* the checked ``mu`` bounds the partitioned run's gradient: ``|g - g64| <= dg =
  (K E_mu + 2u (b1 |mu0| + |mu|)) / (1 - b1)`` (the second term the f32
  rounding of the moment update), with ``g64 = (mu64 - b1 mu0) / (1 - b1)``
  and ``mu0`` the step's input moment, the same for every run;
* both f32 runs' bias corrections differ from ``1 - b^t``: ``b`` is rounded to
  f32 and ``1 - b2`` cancels all but three digits, so ``c2`` is 1.3e-5 off at
  ``t = 1`` (``_f32_interval``: also the power's and the subtraction's
  rounding);
* each parameter is within ``lr max|f(g, c1, c2) - f64|`` over ``g`` in ``g64
  +- dg`` and ``c1``, ``c2`` in their f32 intervals, plus the rounding of the
  f32 update (eight roundings of at most ``u (|theta| + lr (|f| + wd
  |theta|))``). ``f`` is monotone in ``c1`` and ``c2``, and over ``g`` its
  extremes are at the interval's ends or at its critical points (roots of a
  quadratic, ``_critical_points``), so the maximum is exact, not sampled.

That model of the update is checked against the f64 run first: an optimizer
with other hyperparameters than the ``AdamSpec`` fails there, not in the bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import numpy as np

import gshard

U32 = 2.0 ** -24          # f32 unit roundoff


def flat(tree) -> dict[str, np.ndarray]:
  """``keystr(path) -> leaf`` as a host numpy array."""
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def to_f64(tree):
  """Every floating leaf as a float64 numpy array (exact: f32 values are f64 values)."""
  def cast(x):
    x = np.asarray(x)
    return x.astype(np.float64) if np.issubdtype(x.dtype, np.floating) else x
  return jax.tree.map(cast, tree)


def to_host(tree):
  """Every leaf as a numpy array: a 1-device reference must not inherit the
  partitioned run's mesh shardings from its arguments."""
  return jax.tree.map(np.asarray, tree)


@contextlib.contextmanager
def _f32_bernoulli():
  """``jax.random.bernoulli`` drawing its uniforms in f32 for a Python-float
  ``p``: under x64 ``p = 0.9`` is an f64, whose uniforms use other random bits,
  and dropout (flax's ``nnx.Dropout`` calls ``jax.random.bernoulli(key,
  keep_prob)``) would mask other elements than the f32 runs do."""
  original = jax.random.bernoulli

  def bernoulli(key, p=np.float32(0.5), shape=None, **kw):
    if isinstance(p, float):
      p = np.float32(p)
    return original(key, p, shape, **kw)

  jax.random.bernoulli = bernoulli
  try:
    yield
  finally:
    jax.random.bernoulli = original


def f64_run(jitted, *args):
  """``jitted(*args)`` under x64 with every floating argument in float64;
  numpy results. Integer arguments (tokens, seeds) are passed as they are.
  Use a ``jax.jit`` object of its own: its trace is an f64 program."""
  with jax.enable_x64(True), _f32_bernoulli():
    return to_host(jitted(*to_f64(args)))


@dataclasses.dataclass(frozen=True)
class AdamSpec:
  """Where Adam's parameters, moments and step count are among the flat paths
  of a step's result (the parameter ``params + S`` has the moments ``mu + S``
  and ``nu + S``; the step's input has the same paths), and the optimizer's
  hyperparameters (optax's ``adam``/``adamw``; ``wd = 0`` for ``adam``)."""

  params: str
  mu: str
  nu: str
  count: str
  lr: float
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  wd: float = 0.0


def assert_close_to_f64(got, want, exact, *, n: int, old=None,
                        adam: AdamSpec | None = None, what: str = "") -> dict[str, float]:
  """``got`` (partitioned, f32) is within the derived bound of ``exact`` (the
  f64 run) on every element, the bound scaled by the error of ``want`` (the
  1-device f32 run); see the module docstring. ``old`` is the step's input,
  with the same paths as ``got`` (for Adam's parameters and moments).
  Returns each floating leaf's largest ``|got - exact| / bound``."""
  g, w, x = flat(got), flat(want), flat(exact)
  assert g.keys() == w.keys() == x.keys(), f"{what}trees differ"
  k = math.sqrt(n)
  scale = {}
  for path, xv in x.items():
    assert g[path].shape == w[path].shape == xv.shape, f"{what}{path}: shapes differ"
    if np.issubdtype(xv.dtype, np.floating):
      err = float(np.max(np.abs(w[path].astype(np.float64) - xv), initial=0.0))
      top = float(np.max(np.abs(xv), initial=0.0))
      scale[path] = max(err, U32 * top)
    else:
      np.testing.assert_array_equal(g[path], xv, err_msg=f"{what}{path}")
      np.testing.assert_array_equal(w[path], xv, err_msg=f"{what}{path}")
  params = {p for p in scale if adam is not None and p.startswith(adam.params)}
  before = flat(to_f64(old)) if params else {}
  ratios = {}
  for path, e in scale.items():
    xv = x[path]
    if path in params:
      bound = _adam_bound(path, x, scale, before, adam, k, what)
    else:
      top = float(np.max(np.abs(xv), initial=0.0))
      assert e <= n * U32 * top, (
          f"{what}{path}: the 1-device f32 run is {e:.3g} from the f64 run, over "
          f"n u max|f64| = {n * U32 * top:.3g}: they do not compute the same thing")
      bound = np.full(xv.shape, k * e)
    err = np.abs(g[path].astype(np.float64) - xv)
    ratios[path] = float(np.max(err / np.where(bound > 0, bound, np.inf), initial=0.0))
    if (err > bound).any():
      i = np.unravel_index(np.argmax(err - bound), err.shape)
      raise AssertionError(
          f"{what}{path}: {int((err > bound).sum())} of {err.size} elements outside "
          f"the derived bound; worst at {tuple(int(v) for v in i)}: partitioned "
          f"{g[path][i]!r}, f64 {xv[i]!r}, 1-device f32 {w[path][i]!r}; "
          f"|partitioned - f64| = {err[i]:.3g} > bound {bound[i]:.3g} "
          f"(K = sqrt({n}), E = {e:.3g})")
  return ratios


def check_steps(step, ref_step, exact_step, state, batch, *, n: int,
                adam: AdamSpec | None = None, steps: int = 3):
  """Run ``steps`` partitioned steps, ``step(*state, *batch) -> (*new_state,
  loss)``; from each step's input state run it on one device in f32
  (``ref_step``) and in f64 (``exact_step``, a ``jax.jit`` of its own), and
  check the partitioned state and loss with :func:`assert_close_to_f64`
  (``n``: the step's longest reduction; ``adam``: where Adam's moments are).
  All three runs start each step from the partitioned run's state, so the
  bound is one step's rounding, not a trajectory's. Returns the last output."""
  got = tuple(state)
  for i in range(steps):
    out = step(*got, *batch)       # state split unevenly comes back a PaddedArray
    logical = gshard.unpad(got)
    want = ref_step(*to_host(logical), *batch)
    assert_close_to_f64(gshard.unpad(out), want, f64_run(exact_step, *logical, *batch),
                        n=n, old=logical, adam=adam, what=f"step {i}: ")
    got = tuple(out[:-1])
  return out


def _f32_interval(b: float, t: int) -> tuple[float, float]:
  """Where the f32 runs' bias correction ``1 - b^t`` lies: ``b`` rounded to
  f32, its power within one ulp (``2u`` relative), the subtraction rounded
  (``u``). For ``b2 = 0.999``, ``t = 1``: 1.3e-5 off ``1 - b2``, 6e-5 wide."""
  b32 = float(np.float32(b))
  nominal = 1.0 - b32 ** t
  half = 2 * U32 * b32 ** t + U32 * abs(nominal)
  return nominal - half, nominal + half


def _quotient(g, mu0, nu0, c1, c2, adam: AdamSpec):
  """Adam's ``f = m^ / (sqrt(v^) + eps)`` as a function of the gradient ``g``."""
  m_hat = (adam.b1 * mu0 + (1 - adam.b1) * g) / c1
  v_hat = (adam.b2 * nu0 + (1 - adam.b2) * g * g) / c2
  return m_hat / (np.sqrt(v_hat) + adam.eps)


def _critical_points(mu0, nu0, c1, c2, adam: AdamSpec):
  """The ``g`` where ``d f / d g = 0`` (or NaN): with ``f = (a + b g) / (s +
  eps)``, ``s = sqrt(c + d g^2)``, the condition ``b c + b eps s = a d g``
  squared is the quadratic ``d (a^2 d - b^2 eps^2) g^2 - 2 a b c d g + b^2 c
  (c - eps^2) = 0`` (its extra roots only add points of the interval)."""
  a, b = adam.b1 * mu0 / c1, (1 - adam.b1) / c1
  c, d = adam.b2 * nu0 / c2, (1 - adam.b2) / c2
  qa = d * (a * a * d - b * b * adam.eps ** 2)
  qb = -2 * a * b * c * d
  qc = b * b * c * (c - adam.eps ** 2)
  with np.errstate(divide="ignore", invalid="ignore"):
    root = np.sqrt(qb * qb - 4 * qa * qc)
    return (-qb + root) / (2 * qa), (-qb - root) / (2 * qa), -qc / qb


def _adam_bound(path, x, scale, old, adam: AdamSpec, k, what):
  """The per-element bound of an Adam parameter (module docstring)."""
  suffix = path[len(adam.params):]
  mu_path, nu_path = adam.mu + suffix, adam.nu + suffix
  mu, nu, mu0, nu0 = x[mu_path], x[nu_path], old[mu_path], old[nu_path]
  theta = old[path]
  t = int(x[adam.count])
  c1, c2 = 1 - adam.b1 ** t, 1 - adam.b2 ** t
  g64 = (mu - adam.b1 * mu0) / (1 - adam.b1)
  f64 = _quotient(g64, mu0, nu0, c1, c2, adam)
  # the model of the update is the one the f64 run applied
  tol = U32 * (float(np.max(np.abs(theta))) + adam.lr)
  np.testing.assert_allclose(
      nu, adam.b2 * nu0 + (1 - adam.b2) * g64 * g64, rtol=1e-12, atol=0,
      err_msg=f"{what}{nu_path}: the f64 run's moments are not Adam's of {adam}")
  np.testing.assert_allclose(
      x[path], theta - adam.lr * (f64 + adam.wd * theta), rtol=0, atol=tol,
      err_msg=f"{what}{path}: the f64 run is not the Adam update of {adam}")
  # the partitioned run's gradient, as far as its checked first moment tells
  dg = (k * scale[mu_path] + 2 * U32 * (adam.b1 * np.abs(mu0) + np.abs(mu))) / (1 - adam.b1)
  lo, hi = g64 - dg, g64 + dg
  dev = np.zeros_like(f64)
  for c1_ in _f32_interval(adam.b1, t):
    for c2_ in _f32_interval(adam.b2, t):
      points = [lo, hi, *(np.clip(np.nan_to_num(r, nan=0.0), lo, hi)
                          for r in _critical_points(mu0, nu0, c1_, c2_, adam))]
      for p in points:
        dev = np.maximum(dev, np.abs(_quotient(p, mu0, nu0, c1_, c2_, adam) - f64))
  rounding = 8 * U32 * (np.abs(theta) + adam.lr * (np.abs(f64) + adam.wd * np.abs(theta)))
  return adam.lr * dev + rounding
