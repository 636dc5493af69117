"""gshard.pipeline.balance against brute force."""

import itertools
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gshard.pipeline import balance


def _compositions(n, k):
  """All splits of n layers into k stages of >= 1, in lexicographic order of counts."""
  for cuts in itertools.combinations(range(1, n), k - 1):
    bounds = (0, *cuts, n)
    yield [bounds[i + 1] - bounds[i] for i in range(k)]


def _stage_sums(values, counts):
  out, i = [], 0
  for c in counts:
    out.append(sum(Fraction(x) for x in values[i:i + c]))
    i += c
  return out


def _brute(costs, k, *, key=max, memory=None, limit=None):
  best = None
  for counts in _compositions(len(costs), k):
    if memory is not None and max(_stage_sums(memory, counts)) > Fraction(limit):
      continue
    value = key(_stage_sums(costs, counts))
    if best is None or value < best[0]:  # strict: the first (lexicographic) optimum wins
      best = (value, counts)
  return best


layers = st.lists(st.integers(0, 20), min_size=1, max_size=9)
float_layers = st.lists(st.floats(0, 10, allow_nan=False, width=32), min_size=1, max_size=8)


@settings(max_examples=300)
@given(layers, st.data())
def test_min_max_matches_brute_force(costs, data):
  k = data.draw(st.integers(1, len(costs)))
  counts = balance(costs, num_stages=k)
  assert len(counts) == k and all(c >= 1 for c in counts) and sum(counts) == len(costs)
  assert counts == _brute(costs, k)[1]


@settings(max_examples=300)
@given(float_layers, st.data())
def test_min_max_exact_on_floats(costs, data):
  k = data.draw(st.integers(1, len(costs)))
  assert balance(costs, num_stages=k) == _brute(costs, k)[1]


@settings(max_examples=300)
@given(layers, st.integers(1, 16), st.data())
def test_alpa_matches_brute_force(costs, m, data):
  k = data.draw(st.integers(1, len(costs)))
  # Ties in sum + (M-1)*max are broken by the smaller max, then lexicographically.
  alpa = lambda sums: (sum(sums) + (m - 1) * max(sums), max(sums))
  counts = balance(costs, num_stages=k, objective="alpa", num_microbatches=m)
  assert counts == _brute(costs, k, key=alpa)[1]
  # With equal devices per stage the sum is fixed, so Alpa's optimum is the min-max one.
  assert counts == balance(costs, num_stages=k)


@settings(max_examples=300)
@given(layers, st.data())
def test_memory_cap_matches_brute_force(costs, data):
  k = data.draw(st.integers(1, len(costs)))
  memory = data.draw(st.lists(st.integers(0, 9), min_size=len(costs), max_size=len(costs)))
  limit = data.draw(st.integers(0, 30))
  brute = _brute(costs, k, memory=memory, limit=limit)
  if brute is None:
    with pytest.raises(ValueError, match=r"memory_limit=\d+ is infeasible"):
      balance(costs, num_stages=k, memory=memory, memory_limit=limit)
    return
  got = balance(costs, num_stages=k, memory=memory, memory_limit=limit)
  assert got == brute[1]
  assert max(_stage_sums(memory, got)) <= limit


def test_infeasible_memory_names_the_smallest_limit():
  with pytest.raises(ValueError, match=r"memory_limit=2 is infeasible: layer 0 alone needs "
                                       r"memory 3\. Raise memory_limit to at least 3"):
    balance([1, 1, 1, 1], num_stages=2, memory=[3, 1, 1, 1], memory_limit=2)
  with pytest.raises(ValueError, match=r"memory_limit=1.5 is infeasible for num_stages=2: the "
                                       r"best split needs a stage with memory 2.5\. Raise "
                                       r"memory_limit to at least 2.5, or use num_stages >= 4"):
    balance([1, 1, 1, 1], num_stages=2, memory=[1.5, 1, 1, 1], memory_limit=1.5)


def test_documented_examples():
  assert balance([1, 2, 3, 4, 5], num_stages=2) == [3, 2]
  assert balance([1, 1, 1, 1], num_stages=2, memory=[3, 1, 1, 1], memory_limit=3) == [1, 3]
  assert balance([4, 1, 1, 1, 1, 4], num_stages=3) == [1, 4, 1]
  assert balance([4, 1, 1, 1, 1, 4], 3, objective="alpa", num_microbatches=8) == [1, 4, 1]
  # Ties go to the lexicographically smallest split.
  assert balance([1, 1, 1], num_stages=2) == [1, 2]
  assert balance([0, 0, 0, 0], num_stages=3) == [1, 1, 2]


def test_large_uniform_and_float_noise():
  assert balance([1.0] * 64, num_stages=16) == [4] * 16
  # 0.1 + 0.2 != 0.3 in floats; exact sums still see [0.1, 0.2] and [0.3] as a tie.
  assert balance([0.1, 0.2, 0.3], num_stages=2) == [2, 1]


@pytest.mark.parametrize("kwargs, match", [
    (dict(costs=[1, 2], num_stages=3), r"num_stages=3 but costs has 2 layers.*num_stages <= 2"),
    (dict(costs=[1, -2], num_stages=1), r"costs\[1\] must be a finite number >= 0, got -2"),
    (dict(costs=[1, math.nan], num_stages=1), r"costs\[1\] must be a finite number >= 0"),
    (dict(costs=[1, math.inf], num_stages=1), r"costs\[1\] must be a finite number >= 0"),
    (dict(costs=[True], num_stages=1), r"costs\[0\] must be a finite number >= 0, got True"),
    (dict(costs=5, num_stages=1), r"costs must be a list of per-layer numbers, got int 5"),
    (dict(costs=[1], num_stages=0), r"num_stages must be an int >= 1, got 0"),
    (dict(costs=[1], num_stages=1, objective="sum"), r"objective must be 'max' or 'alpa'"),
    (dict(costs=[1], num_stages=1, objective="alpa"), r"objective='alpa' needs num_microbatches"),
    (dict(costs=[1], num_stages=1, memory=[1]), r"pass memory .* and memory_limit .* together"),
    (dict(costs=[1, 1], num_stages=1, memory=[1], memory_limit=2),
     r"memory has 1 entries, costs has 2"),
    (dict(costs=[1], num_stages=1, memory=[1], memory_limit=-1),
     r"memory_limit must be a finite number >= 0, got -1"),
])
def test_bad_arguments_name_the_argument(kwargs, match):
  with pytest.raises(ValueError, match=match):
    balance(**kwargs)

