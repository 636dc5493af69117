"""Random programs (``fuzzgen``): partitioning never changes a result.

The derandomized CI slice of ``make fuzz``. Hypothesis draws a random program
(a small DAG over bool/int8/int32/f32/bf16 inputs with NaN/inf, ranks 0-4,
gathers, dynamic slices, scatters, sort/top_k/approx top-k/unique, grouped
matmuls (``ragged_dot``), variadic ``lax.reduce``, pads, scan/cond/while,
uneven sizes, random annotations and in_specs on a random 1-D/2-D/3-D mesh of
up to 8 devices; value or ``value_and_grad`` mode) and ``fuzzcheck`` compares
``gshard.partition`` with ``jax.jit`` on one device: ints, bools and NaN/inf
positions exactly, floats within the error bound derived in ``fuzzcheck``
from a float64 oracle. A ``PartitionWarning`` (the safe path) is allowed.

Shrinking is off so a failure is reported within the time budget; the message
holds a self-contained repro script. For a longer random search: ``make fuzz``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, Phase, given, settings

import fuzzcheck
import fuzzgen

# each example compiles two to four programs (~1-3 s on 2 cores): two thirds of
# the profile's examples keep the file within a minute
EXAMPLES = max(1, settings().max_examples * 2 // 3)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck))


@FUZZ
@given(fuzzgen.programs())
def test_partitioned_program_matches_one_device(prog):
  r = fuzzcheck.check(prog, gspmd=False)
  assert r.single_error is None, f"generator bug: {r.single_error}\n{prog.repro()}"
  o = r.gshard
  # "reference": jax.jit's one-device program is itself miscompiled, and
  # gshard equals the op-by-op run
  assert o.status in ("pass", "reference"), (
      f"program {prog.seed}: gshard: {o.key} {o.where}\n" + "\n".join(str(m) for m in o.mismatches) +
      f"\n\n{prog.repro()}")


def test_generator_covers_the_issue_list():
  """The generator reaches every dtype, rank, mesh, op family and mode (a blind
  generator would make the property vacuous)."""
  seen = set()

  @settings(max_examples=400, derandomize=True, database=None,
            phases=[Phase.generate], suppress_health_check=list(HealthCheck))
  @given(fuzzgen.programs())
  def collect(prog):
    seen.update(prog.features)
    seen.update(f.split(":")[0] + ":*" for f in prog.features)

  collect()
  want = {f"dtype:{d}" for d in fuzzgen.DTYPES} | {f"rank:{r}" for r in range(5)} | {
      "input:nan", "input:inf", "uneven", "even", "in_specs", "annot:shard", "annot:split",
      "annot:replicate", "mode:value", "mode:grad", "gather:*", "scatter:*", "dslice:*",
      "pad:edge", "sort:top_k", "sort:sort", "control:scan", "control:cond",
      "control:while", "reduce:argmax", "reduce:x_sum", "dot:bool", "dot:i8",
      "ragged_dot:*", "ragged_dot:sizes_input", "ragged_dot:sizes_const", "approx_top_k:*",
      "reduce_variadic:argmax", "reduce_variadic:sum_max", "sort:cumsum", "sort:cumsum_reverse",
      "sort:cumprod", "sort:cummax", "sort:cummin"}
  want |= {f"mesh:{s}" for s, _ in fuzzgen.MESHES}
  assert want <= seen, sorted(want - seen)


# -- the comparison itself ------------------------------------------------------------------

def _prog(lines, outputs, inputs, out_dtypes=("f32",)):
  return fuzzgen.Program((2,), ("x",), [fuzzgen.Input(n, v, d, None) for n, v, d in inputs],
                         lines, outputs, list(out_dtypes), "value")


def test_compare_accepts_a_reordered_sum_and_rejects_a_wrong_one():
  rng = np.random.default_rng(0)
  x = rng.standard_normal(1000).astype(np.float32) * 1000
  prog = _prog(["v = jnp.sum(x0) - jnp.sum(x0[::-1]) + jnp.sum(x0 * 0.5)"], ["v"],
               [("x0", x, "f32")])
  want = np.float32(np.sum(x) - np.sum(x[::-1]) + np.sum(x * 0.5))
  # the same sums in other orders (pairs, halves): rounding, not a wrong value
  reordered = np.float32(np.sum(x[::2]) + np.sum(x[1::2]) -
                         (np.sum(x[:500]) + np.sum(x[500:])) + np.sum(x * 0.5))
  oracle = lambda: fuzzcheck.oracle(prog)   # noqa: E731
  assert fuzzcheck.compare(prog, (reordered,), (want,), oracle) == []
  missing = np.float32(reordered - x[3] * 0.5)     # one term dropped
  mm = fuzzcheck.compare(prog, (missing,), (want,), oracle)
  assert [m.kind for m in mm] == ["float"], mm


def test_compare_is_exact_for_ints_bools_and_nan_positions():
  prog = _prog(["v = x0"], ["v"], [("x0", np.zeros(3, np.float32), "f32")])
  no_oracle = lambda: (_ for _ in ()).throw(AssertionError("oracle not needed"))  # noqa
  f = np.array([1.0, np.nan, np.inf], np.float32)
  assert fuzzcheck.compare(prog, (f,), (f.copy(),), no_oracle) == []
  assert [m.kind for m in fuzzcheck.compare(
      prog, (np.array([1.0, np.inf, np.inf], np.float32),), (f,),
      lambda: ([f.astype(np.float64)], [np.abs(np.nan_to_num(f))]))] == ["nonfinite"]
  assert [m.kind for m in fuzzcheck.compare(prog, (np.array([1, 2], np.int8),),
                                            (np.array([1, 3], np.int8),), no_oracle)] == ["int"]
  assert [m.kind for m in fuzzcheck.compare(prog, (np.array([1, 2], np.int32),),
                                            (np.array([True, False]),), no_oracle)] == ["dtype"]


def test_scale_of_a_cancelling_sum_is_the_sum_of_magnitudes():
  x = np.array([1e8, 1.0, -1e8], np.float32)
  prog = _prog(["v = jnp.sum(x0)", "w = jnp.tanh(x0) @ x0"], ["v", "w"],
               [("x0", x, "f32")], ("f32", "f32"))
  vals, scales = fuzzcheck.oracle(prog)
  assert vals[0] == 1.0 and math.isclose(float(scales[0]), 2e8 + 1)
  assert float(scales[1]) >= float(jnp.abs(jnp.tanh(x.astype(np.float64))) @ np.abs(x))


def test_scale_rules_of_grouped_matmul_and_variadic_reduce():
  """``ragged_dot`` scales like a dot (the same grouped matmul of the scales);
  a ``lax.reduce`` of the program's own computation reduces (value, scale)
  pairs: a sum adds the scales, a selection takes the selected one's. Neither
  falls back to the conservative rule."""
  rng = np.random.default_rng(0)
  a = rng.standard_normal((5, 3)).astype(np.float32)
  b = rng.standard_normal((2, 3, 2)).astype(np.float32)
  x = np.array([[1e8, 1.0, -1e8], [2.0, 5.0, 3.0]], np.float32)
  argmax = ("lambda a, b: (lambda t: (jnp.where(t, b[0], a[0]), jnp.where(t, b[1], a[1])))"
            "((b[0] > a[0]) | ((b[0] == a[0]) & (b[1] < a[1])))")
  prog = _prog(["r = lax.ragged_dot(jnp.tanh(x0), x1, jnp.array([1, 3], i32))",
                f"m, i = lax.reduce((x2, lax.broadcasted_iota(i32, (2, 3), 1)), "
                f"(f32(-inf), i32(2147483647)), {argmax}, (1,))",
                "s, t = lax.reduce((x2, x2), (f32(0), f32(-inf)), "
                "lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1])), (1,))"],
               ["r", "m", "i", "s"], [("x0", a, "f32"), ("x1", b, "f32"), ("x2", x, "f32")],
               ("f32", "f32", "i32", "f32"))
  before = dict(fuzzcheck.SCALE_FALLBACKS)
  vals, scales = fuzzcheck.oracle(prog)
  assert dict(fuzzcheck.SCALE_FALLBACKS) == before
  a64 = a.astype(np.float64)
  t = np.abs(np.tanh(a64)) + np.abs(a64)           # S(tanh(a)) = |tanh(a)| + 1 * S(a)
  want = np.concatenate([t[:1] @ np.abs(b[0]), t[1:4] @ np.abs(b[1]), np.zeros((1, 2))])
  np.testing.assert_allclose(scales[0], want, rtol=1e-12)
  assert vals[1].tolist() == [1e8, 5.0] and vals[2].tolist() == [0, 1]
  assert scales[1].tolist() == [1e8, 5.0]            # the selected element's, not the row's
  assert vals[3].tolist() == [1.0, 10.0] and scales[3].tolist() == [2e8 + 1, 10.0]
