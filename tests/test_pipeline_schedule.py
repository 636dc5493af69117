"""gshard.pipeline schedules: validity, exact bubble and peak numbers, user tables, charts.

The table checks here are written independently of ``Schedule.validate`` (which
runs on construction anyway), so a validator that let a bad table through would
still fail these tests.
"""

import dataclasses
import re
import sys
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gshard import pipeline
from gshard.pipeline import Action, Schedule, placement, schedule, virtual_stage
from gshard.pipeline import Costs
from gshard.pipeline.tables import SCHEDULES


def _requirement(name, k, m, v):
  """Why (name, K, M, v) is refused, or None if it must build."""
  if name in ("1f1b", "zero_bubble") and v != 1:
    return "repeats must be 1"
  if name in ("gpipe", "interleaved") and v > 1 and m % k:
    return "must be a multiple of num_stages"
  return None


def _independent_check(s: Schedule):
  """Re-derive the tick rules from the table alone."""
  k, m_total, v = s.num_stages, s.num_microbatches, s.repeats
  num_virtual = k * v
  tick = {}
  for t, row in enumerate(s.table):
    assert len(row) == k
    for stage, a in enumerate(row):
      if a is None:
        continue
      u = a.chunk * k + stage
      key = (a.kind, a.microbatch, u)
      assert key not in tick, key
      tick[key] = t
  kinds = ("F", "B", "W") if s.split else ("F", "B")
  assert len(tick) == len(kinds) * m_total * num_virtual
  for m in range(m_total):
    for u in range(num_virtual):
      if u > 0:
        assert tick["F", m, u] > tick["F", m, u - 1]
      assert tick["B", m, u] > tick["F", m, u]
      if u < num_virtual - 1:
        assert tick["B", m, u] > tick["B", m, u + 1]
      if s.split:
        assert tick["W", m, u] > tick["B", m, u]
  for stage in range(k):
    column = [row[stage] for row in s.table if row[stage] is not None]
    assert sum(a.kind == "F" for a in column) == m_total * v
    assert sum(a.kind == "B" for a in column) == m_total * v


def _expected_ticks(name, k, m, v):
  if name == "zero_bubble":
    return 3 * m + k - 1 if m >= k else 2 * (m + k) - 1
  return 2 * (v * m + k - 1)


def _expected_in_flight(name, k, m, v):
  if name == "gpipe":
    return tuple([m * v] * k)
  if name == "1f1b" or (name == "interleaved" and v == 1):
    return tuple(min(k - s, m) for s in range(k))
  if name == "interleaved":
    return tuple(min(v * k + k - 1 - 2 * s, v * m) for s in range(k))
  return tuple([min(k, m)] * k)


names = st.sampled_from(SCHEDULES)


@settings(max_examples=300)
@given(names, st.integers(1, 8), st.integers(1, 16), st.integers(1, 3))
def test_every_builtin_schedule_is_valid_and_exact(name, k, m, v):
  why = _requirement(name, k, m, v)
  if why is not None:
    with pytest.raises(ValueError, match=why):
      schedule(name, num_stages=k, num_microbatches=m, repeats=v)
    return
  s = schedule(name, num_stages=k, num_microbatches=m, repeats=v)
  _independent_check(s)
  assert s.split == (name == "zero_bubble")
  assert s.num_ticks == _expected_ticks(name, k, m, v)
  assert s.in_flight == _expected_in_flight(name, k, m, v)
  actions = (3 if s.split else 2) * m * v * k
  assert s.bubble_fraction == pytest.approx(1 - actions / (k * s.num_ticks), abs=1e-12)
  # The event replay under unit costs puts every action exactly at its tick.
  unit = dict(F=1, B=1, W=1) if s.split else dict(F=1, B=1)
  events = s.timeline(unit).events
  assert all(e.start == e.tick and e.end == e.tick + 1 for e in events)
  assert s.timeline(unit).bubble_fraction == pytest.approx(s.bubble_fraction, abs=1e-12)


def test_bubble_formulas_exact_k4():
  # (K-1)/(vM+K-1) for gpipe, 1f1b, interleaved; (K-1)/(3M+K-1) for ZB-H1 (M >= K).
  k = 4
  for m in (4, 8, 12, 16):
    for name, v, formula in (("gpipe", 1, Fraction(k - 1, m + k - 1)),
                             ("1f1b", 1, Fraction(k - 1, m + k - 1)),
                             ("gpipe", 2, Fraction(k - 1, 2 * m + k - 1)),
                             ("interleaved", 2, Fraction(k - 1, 2 * m + k - 1)),
                             ("interleaved", 3, Fraction(k - 1, 3 * m + k - 1)),
                             ("zero_bubble", 1, Fraction(k - 1, 3 * m + k - 1))):
      s = schedule(name, num_stages=k, num_microbatches=m, repeats=v)
      assert s.bubble_fraction == pytest.approx(float(formula), abs=1e-12), (name, m, v)


def test_reported_numbers_k4_m8():
  got = {}
  for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1)):
    s = schedule(name, num_stages=4, num_microbatches=8, repeats=v)
    got[name] = (s.num_ticks, round(s.bubble_fraction, 4), s.peak_in_flight)
  assert got == {"gpipe": (22, 0.2727, 8), "1f1b": (22, 0.2727, 4),
                 "interleaved": (38, 0.1579, 11), "zero_bubble": (27, 0.1111, 4)}


def test_1f1b_peak_at_most_k_and_gpipe_peak_m():
  for k in range(1, 9):
    for m in range(1, 17):
      assert schedule("1f1b", num_stages=k, num_microbatches=m).peak_in_flight == min(k, m)
      assert schedule("gpipe", num_stages=k, num_microbatches=m).peak_in_flight == m


def test_1f1b_warmup_is_k_minus_1_minus_s():
  s = schedule("1f1b", num_stages=4, num_microbatches=8)
  for stage in range(4):
    kinds = "".join(a.kind for _, a in s.stage_actions(stage))
    warmup = 4 - 1 - stage
    assert kinds == "F" * warmup + "FB" * (8 - warmup) + "B" * warmup


def test_zero_bubble_holds_back_s_weight_gradients():
  s = schedule("zero_bubble", num_stages=4, num_microbatches=8)
  for stage in range(4):
    actions = [a for _, a in s.stage_actions(stage)]
    b_done = w_done = 0
    lag = 0
    for a in actions:
      b_done += a.kind == "B"
      w_done += a.kind == "W"
      lag = max(lag, b_done - w_done)
    # Right after a B, stage s holds s W's back (the B's own W runs next).
    assert lag == stage + 1
    tail = "".join(a.kind for a in actions[-(stage + 1):])
    assert tail == "W" * (stage + 1)


# ----------------------------------------------------------------------------
# Costs and the event replay


def test_uniform_costs_keep_gpipe_1f1b_interleaved_bubble():
  for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("gpipe", 2)):
    s = schedule(name, num_stages=4, num_microbatches=8, repeats=v)
    for f, b in ((1, 2), (0.5, 1.5), (2, 1)):
      tl = s.timeline(dict(F=f, B=b))
      assert tl.makespan == pytest.approx((v * 8 + 3) * (f + b))
      assert tl.bubble_fraction == pytest.approx(3 / (v * 8 + 3))


def test_zero_bubble_matches_paper_formula_when_w_is_cheapest():
  for k, m in ((4, 8), (3, 5), (6, 6)):
    s = schedule("zero_bubble", num_stages=k, num_microbatches=m)
    for f, b, w in ((1, 1, 1), (1, 1, 0.5), (2, 1.5, 1), (1, 2, 0.25)):
      tl = s.timeline(dict(F=f, B=b, W=w))
      assert tl.makespan == pytest.approx(m * (f + b + w) + (k - 1) * (f + b - w))
  # With W dearer than F and B the formula no longer holds; the replay says 35.
  s = schedule("zero_bubble", num_stages=4, num_microbatches=8, costs=dict(F=1, B=1, W=2))
  assert s.timeline().makespan == 35
  assert s.bubble_fraction == pytest.approx(1 - 32 / 35)


def test_full_backward_is_b_plus_w_for_unsplit_schedules():
  one = schedule("1f1b", num_stages=4, num_microbatches=8, costs=dict(F=1, B=1, W=1))
  assert one.costs.B == (2.0,) * 4
  assert one.timeline().makespan == 33  # (M + K - 1) * (F + B + W)
  zb = schedule("zero_bubble", num_stages=4, num_microbatches=8, costs=dict(F=1, B=1, W=1))
  assert zb.timeline().makespan == 27  # 3M + K - 1
  assert zb.bubble_fraction == pytest.approx(3 / 27)
  assert "(given costs)" in zb.header()


def test_comm_latency_and_per_stage_costs_by_hand():
  s = schedule("gpipe", num_stages=2, num_microbatches=1)
  tl = s.timeline(dict(F=1, B=1, comm=0.5))
  # F0 s0 [0,1]; F0 s1 [1.5,2.5]; B0 s1 [2.5,3.5]; B0 s0 [4,5].
  assert [(e.stage, e.start, e.end) for e in tl.events] == [
      (0, 0, 1), (1, 1.5, 2.5), (1, 2.5, 3.5), (0, 4, 5)]
  assert tl.bubble_fraction == pytest.approx(1 - 4 / 10)
  s = schedule("gpipe", num_stages=2, num_microbatches=2, costs=dict(F=[1, 2], B=[1, 2]))
  # s1 runs F0 [1,3], F1 [3,5], B1 [5,7], B0 [7,9]; s0 B1 [7,8], B0 [9,10].
  assert s.timeline().makespan == 10
  assert s.timeline().busy == (4, 8)
  assert s.bubble_fraction == pytest.approx(0.4)


def test_per_virtual_stage_costs():
  s = schedule("interleaved", num_stages=2, num_microbatches=2, repeats=2)
  c = Costs.of(dict(F=[1, 2, 3, 4], B=[1, 1, 1, 1]), 2, 2, split=False)
  assert c.F == (1, 2, 3, 4)
  per_device = Costs.of(dict(F=[1, 2], B=1), 2, 2, split=False)
  assert per_device.F == (1, 2, 1, 2)
  assert s.timeline(c).busy == (2 * (1 + 3) + 4, 2 * (2 + 4) + 4)


@pytest.mark.parametrize("costs, match", [
    (dict(F=1), "needs an 'B' entry"),
    (dict(F=1, B=1, X=2), "unknown keys"),
    (dict(F=[1, 2, 3], B=1), r"costs\['F'\] must be a number, or a list of num_stages=4"),
    (dict(F=-1, B=1), r"costs\['F'\]: durations must be finite numbers >= 0"),
    (dict(F=1, B=1, comm=-1), r"costs\['comm'\] must be a number >= 0"),
    ([1, 2], "costs must be a dict"),
])
def test_bad_costs_name_the_entry(costs, match):
  with pytest.raises(ValueError, match=match):
    schedule("1f1b", num_stages=4, num_microbatches=4, costs=costs)


def test_split_schedule_needs_w_cost():
  with pytest.raises(ValueError, match="give costs a 'W' entry"):
    schedule("zero_bubble", num_stages=2, num_microbatches=2, costs=dict(F=1, B=1))


# ----------------------------------------------------------------------------
# Requirements and user tables


def test_requirements_are_clear_errors():
  with pytest.raises(ValueError, match=r"num_microbatches=6 must be a multiple of num_stages=4"
                                       r".*use num_microbatches=8"):
    schedule("interleaved", num_stages=4, num_microbatches=6, repeats=2)
  with pytest.raises(ValueError, match=r"use schedule\('interleaved', repeats=...\)"):
    schedule("1f1b", num_stages=4, num_microbatches=8, repeats=2)
  with pytest.raises(ValueError, match="name must be one of 'gpipe', '1f1b'"):
    schedule("pipedream", num_stages=4, num_microbatches=8)
  with pytest.raises(ValueError, match="num_stages must be an int >= 1, got 0"):
    schedule("gpipe", num_stages=0, num_microbatches=8)


def test_interleaved_with_one_repeat_is_1f1b():
  a = schedule("interleaved", num_stages=4, num_microbatches=6)
  b = schedule("1f1b", num_stages=4, num_microbatches=6)
  assert a.table == b.table


def test_builtin_tables_round_trip_as_user_tables():
  for name, v in (("gpipe", 2), ("1f1b", 1), ("interleaved", 3), ("zero_bubble", 1)):
    s = schedule(name, num_stages=3, num_microbatches=6, repeats=v)
    user = schedule(table=[list(row) for row in s.table], num_stages=3, num_microbatches=6,
                    repeats=v)
    assert user.name == "custom"
    assert user.table == s.table
    assert user.bubble_fraction == s.bubble_fraction
    assert user.peak_in_flight == s.peak_in_flight


def test_user_table_with_tuples_and_idle_ticks():
  table = [[("F", 0), None],
           [None, ("F", 0)],
           [None, None],           # an idle tick the user chose: kept under unit ticks
           [None, ("B", 0)],
           [("B", 0), None]]
  s = schedule(table=table, num_stages=2, num_microbatches=1)
  assert s.table[0][0] == Action("F", 0, 0)
  assert s.num_ticks == 5
  assert s.bubble_fraction == pytest.approx(1 - 4 / 10)
  # The event replay runs each action as early as it can: the idle tick disappears.
  assert s.timeline(dict(F=1, B=1)).makespan == 4


F, B, W = (lambda m, c=0, k=kind: Action(k, m, c) for kind in "FBW")


@pytest.mark.parametrize("table, k, m, v, match", [
    ([[F(0)]], 2, 1, 1, r"tick 0 must have num_stages=2 entries"),
    ([[F(1)], [B(1)]], 1, 1, 1, r"tick 0, stage 0: F1 has microbatch 1, but num_microbatches=1"),
    ([[F(0, 1)], [B(0, 1)]], 1, 1, 1, r"tick 0, stage 0: F0c1 has chunk 1, but repeats=1"),
    ([[F(0)], [F(0)], [B(0)]], 1, 1, 1,
     r"tick 1, stage 0: F\(microbatch=0, chunk=0\) of virtual stage 0 on stage 0 appears a "
     r"second time \(first at tick 0\); rule: each \(microbatch, virtual stage\) has exactly "
     r"one F"),
    ([[F(0), None], [None, F(0)], [None, B(0)]], 2, 1, 1,
     r"B\(microbatch=0, chunk=0\) of virtual stage 0 on stage 0 is missing; .* Add it to "
     r"column 0 with chunk 0"),
    ([[F(0), None], [None, F(0)], [None, B(0)], [B(0), W(0)]], 2, 1, 1,
     r"W\(microbatch=0, chunk=0\) of virtual stage 0 on stage 0 is missing \(the table has W "
     r"actions, so every B needs its W\)"),
    ([[F(0), F(0)], [None, B(0)], [B(0), None]], 2, 1, 1,
     r"tick 0, stage 1: F\(microbatch=0, chunk=0\) of virtual stage 1 on stage 1 runs at tick "
     r"0, but F\(microbatch=0, chunk=0\) of virtual stage 0 on stage 0 runs at tick 0; rule: "
     r"F\(m, u\) must run at a strictly later tick than F\(m, u-1\).*Move it to tick >= 1"),
    ([[F(0), None], [None, B(0)], [None, F(0)], [B(0), None]], 2, 1, 1,
     r"tick 1, stage 1: B\(microbatch=0, chunk=0\) of virtual stage 1 .* rule: B\(m, u\) "
     r"must run at a strictly later tick than F\(m, u\)"),
    ([[F(0), None], [None, F(0)], [B(0), None], [None, B(0)]], 2, 1, 1,
     r"tick 2, stage 0: B\(microbatch=0, chunk=0\) of virtual stage 0 .* rule: B\(m, u\) must "
     r"run at a strictly later tick than B\(m, u\+1\)"),
    ([[F(0)], [W(0)], [B(0)]], 1, 1, 1,
     r"tick 1, stage 0: W\(microbatch=0, chunk=0\) .* rule: W\(m, u\) must run at a strictly "
     r"later tick than B\(m, u\)"),
    # Chunks: F of virtual stage 2 (stage 0, chunk 1) before that of virtual stage 1.
    ([[F(0), None], [F(0, 1), F(0)], [None, F(0, 1)], [None, B(0, 1)], [B(0, 1), None],
      [None, B(0)], [B(0), None]], 2, 1, 2,
     r"tick 1, stage 0: F\(microbatch=0, chunk=1\) of virtual stage 2 on stage 0 runs at tick "
     r"1, but F\(microbatch=0, chunk=0\) of virtual stage 1 on stage 1 runs at tick 1"),
    ([["X", None]], 2, 1, 1, r"tick 0, stage 0: entries must be Action, None"),
    ([[("Q", 0), None]], 2, 1, 1, r"tick 0, stage 0: \('Q', 0\) is not an action: Action: "
                                  r"kind must be 'F', 'B' or 'W'"),
])
def test_bad_user_tables_name_tick_stage_and_rule(table, k, m, v, match):
  with pytest.raises(ValueError, match=match):
    schedule(table=table, num_stages=k, num_microbatches=m, repeats=v)


def test_action_and_virtual_stage_conventions():
  assert str(Action("F", 3, 1)) == "F3c1" and str(Action("B", 2)) == "B2"
  assert Action("W", 5, 2).label(show_chunk=False) == "W5"
  with pytest.raises(ValueError, match="microbatch must be an int >= 0, got -1"):
    Action("F", -1)
  with pytest.raises(dataclasses.FrozenInstanceError):
    Action("F", 0).kind = "B"
  for k in range(1, 6):
    for u in range(3 * k):
      s, c = placement(u, k)
      assert virtual_stage(s, c, k) == u and 0 <= s < k
  assert virtual_stage(1, 2, 4) == 9
  s = schedule("interleaved", num_stages=2, num_microbatches=2, repeats=2)
  assert s.virtual_stage(1, 1) == 3 and s.num_virtual_stages == 4


def test_schedule_is_hashable_and_reprs_short():
  s = schedule("1f1b", num_stages=2, num_microbatches=2)
  assert s == schedule("1f1b", num_stages=2, num_microbatches=2)
  assert hash(s) == hash(schedule("1f1b", num_stages=2, num_microbatches=2))
  assert repr(s) == "Schedule('1f1b', num_stages=2, num_microbatches=2, repeats=1, ticks=6)"


# ----------------------------------------------------------------------------
# Charts


def test_text_chart_snapshot_1f1b():
  s = schedule("1f1b", num_stages=3, num_microbatches=4)
  assert str(s) == (
      "1f1b: K=3 M=4 v=1 ticks=12 bubble=33.3% peak_in_flight=3\n"
      "stage 0 | F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3\n"
      "stage 1 | .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .\n"
      "stage 2 | .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .")


def test_text_chart_snapshot_gpipe_and_chunks():
  assert str(schedule("gpipe", num_stages=2, num_microbatches=3)) == (
      "gpipe: K=2 M=3 v=1 ticks=8 bubble=25.0% peak_in_flight=3\n"
      "stage 0 | F0 F1 F2 .  .  B2 B1 B0\n"
      "stage 1 | .  F0 F1 F2 B2 B1 B0 .")
  assert str(schedule("interleaved", num_stages=2, num_microbatches=2, repeats=2)) == (
      "interleaved: K=2 M=2 v=2 ticks=10 bubble=20.0% peak_in_flight=4\n"
      "stage 0 | F0   F1   F0c1 F1c1 .    B0c1 .    B1c1 B0   B1\n"
      "stage 1 | .    F0   F1   F0c1 B0c1 F1c1 B1c1 B0   B1   .")


def test_text_chart_fits_width_by_wrapping():
  s = schedule("zero_bubble", num_stages=4, num_microbatches=8)
  chart = s.chart(width=80)
  lines = chart.splitlines()
  assert all(len(line) <= 80 for line in lines)
  assert [line for line in lines if line.startswith("ticks")] == ["ticks 0-22", "ticks 23-26"]
  assert len(s.chart(width=None).splitlines()) == 5
  # Every action appears exactly once in the wrapped chart.
  cells = re.findall(r"\b[FBW]\d+\b", "\n".join(lines[1:]))
  assert len(cells) == 3 * 8 * 4


def test_plot_writes_png(tmp_path):
  import matplotlib  # noqa: F401  (in the [test] extra: missing is a failure, not a skip)
  for name, v in (("zero_bubble", 1), ("interleaved", 2)):
    s = schedule(name, num_stages=4, num_microbatches=8, repeats=v)
    path = tmp_path / f"{name}.png"
    assert s.plot(path) == str(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000
  costed = tmp_path / "costed.png"
  schedule("1f1b", num_stages=2, num_microbatches=3).plot(costed, costs=dict(F=1, B=2))
  assert costed.read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
  for mod in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
    monkeypatch.delitem(sys.modules, mod)
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  s = schedule("gpipe", num_stages=2, num_microbatches=2)
  with pytest.raises(ImportError, match=r"pip install 'gshard\[plot\]'"):
    s.plot(tmp_path / "x.png")
  assert not (tmp_path / "x.png").exists()


def test_public_names():
  for name in ("schedule", "Schedule", "Action", "balance", "layer_costs"):
    assert name in pipeline.__all__ and hasattr(pipeline, name)
  assert pipeline.schedule is schedule
