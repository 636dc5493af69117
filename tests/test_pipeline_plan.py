"""The tables ``pipeline.run`` executes, and the executor's slot plan of them.

``run(..., loss_fn=...)`` executes a schedule's table (a name's published
one, or a lockstep form ``pipeline.schedule(name, ..., lockstep=True)``, or a
user's) through the static arrays of ``gshard.pipeline.plan``. Checked here
without jax, by property tests over random (K, M, v):

- the lockstep tables are valid by rules re-derived here from the table alone
  (``_independent_check`` of test_pipeline_schedule), hold exactly M*v
  forwards and backwards per stage, one kind of action per tick, and their
  tick counts, bubbles and peaks in flight are the documented formulas;
- the plan, replayed on the host slot by slot in the executor's phase order,
  hands every action exactly the value it needs (the activation, cotangent,
  stash or kept input of its own micro-batch and virtual stage), never
  overwrites a value still waiting, and sizes each pool to the most values
  that ever wait in it at once on one device, for the published tables (what
  ``run`` executes) and their lockstep forms.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gshard import pipeline
from gshard.pipeline.plan import plan
from test_pipeline_schedule import _independent_check

LOCKSTEP = ("gpipe", "1f1b", "interleaved", "zero_bubble")


def _args(name, k, m, v):
  """(K, M, v) the built-in ``name`` accepts, from drawn ones."""
  if name in ("1f1b", "zero_bubble"):
    v = 1
  if v > 1:
    m = k * -(-m // k)
  return k, m, v


def _expected(name, k, m, v):
  """(ticks, bubble, per-stage peak in flight) of the lockstep table."""
  if name == "gpipe":
    return 2 * (v * m + k - 1), Fraction(k - 1, v * m + k - 1), [v * m] * k
  if name == "zero_bubble":
    ticks = 3 * m + 2 * k - 2
    return ticks, 1 - Fraction(3 * m * k, k * ticks), [min(2 * k - 1 - s, m) for s in range(k)]
  peaks = [min(v * k + k - 1 - 2 * s, v * m) for s in range(k)]
  return 2 * (v * m + k - 1), Fraction(k - 1, v * m + k - 1), peaks


@given(st.sampled_from(LOCKSTEP), st.integers(1, 6), st.integers(1, 12), st.integers(1, 3))
def test_lockstep_tables_are_valid_and_match_the_formulas(name, k, m, v):
  k, m, v = _args(name, k, m, v)
  s = pipeline.schedule(name, num_stages=k, num_microbatches=m, repeats=v, lockstep=True)
  _independent_check(s)
  for row in s.table:
    assert len({a.kind for a in row if a is not None}) == 1, (name, row)
  ticks, bubble, peaks = _expected(name, k, m, v)
  assert s.num_ticks == ticks
  assert s.bubble_fraction == pytest.approx(float(bubble), abs=1e-12)
  assert list(s.in_flight) == peaks
  if name == "1f1b":
    # lockstep 1F1B keeps at most 2K-1 whatever M (the asynchronous table: K)
    assert s.peak_in_flight <= 2 * k - 1
    assert pipeline.schedule(name, num_stages=k, num_microbatches=m).peak_in_flight <= k


class _Slots:
  """Per stage, per pool: slot -> the value (kind, microbatch, virtual stage) waiting."""

  def __init__(self, p):
    self.p = p
    self.held = {}
    self.most = {}

  def write(self, pool, stage, slot, value):
    assert 0 <= slot < self.p.slots[pool], (pool, stage, slot, value)
    key = (pool, stage, slot)
    assert key not in self.held, f"{value} overwrites {self.held[key]} still waiting in {key}"
    self.held[key] = value
    live = sum(1 for q, s, _ in self.held if (q, s) == (pool, stage))
    self.most[pool] = max(self.most.get(pool, 0), live)

  def read(self, pool, stage, slot, value):
    assert self.held.pop((pool, stage, slot), None) == value, (pool, stage, slot, value)


def _replay(sched):
  """Run the plan's arrays on the host; returns the most values each pool held."""
  p = plan(sched)
  k, nv = sched.num_stages, sched.num_stages * sched.repeats
  slots = _Slots(p)
  for t, row in enumerate(sched.table):
    acts = {s: (a.kind, a.microbatch, a.chunk * k + s) for s, a in enumerate(row) if a}
    for kind in ("F", "B", "W"):
      for s, (kd, mb, u) in acts.items():
        assert getattr(p, f"{kind.lower()}_on")[t, s] == (kd == kind)
    fs = {s: (mb, u) for s, (kd, mb, u) in acts.items() if kd == "F"}
    for s, (mb, u) in fs.items():                                      # F reads
      assert p.f_chunk[t, s] == u // k and p.f_first[t, s] == (u == 0)
      if u == 0:
        assert p.m_x[t] == mb
      else:
        slots.read("act", s, p.f_read[t, s], (mb, u))
    for s, (mb, u) in fs.items():                                      # F writes
      slots.write("stash", s, p.f_stash[t, s], (mb, u))
      if u + 1 < nv:
        assert p.f_into[t, (u + 1) % k]
        slots.write("act", (u + 1) % k, p.f_arrive[t, (u + 1) % k], (mb, u + 1))
      else:                                                            # H
        assert s == k - 1 and p.m_head[t] == mb
        slots.write("grad", s, p.h_slot[t, s], (mb, u))
    assert p.f_into[t].sum() == sum(u + 1 < nv for _, u in fs.values())
    bs = {s: (mb, u) for s, (kd, mb, u) in acts.items() if kd == "B"}
    for s, (mb, u) in bs.items():                                      # B reads
      assert p.b_chunk[t, s] == u // k and p.b_first[t, s] == (u == 0)
      slots.read("grad", s, p.b_read[t, s], (mb, u))
      slots.read("stash", s, p.b_stash[t, s], (mb, u))
      if u == 0:
        assert p.m_dx[t] == mb
    for s, (mb, u) in bs.items():                                      # B writes
      if sched.split:
        slots.write("keep", s, p.b_keep[t, s], (mb, u))
      if u > 0:
        assert p.b_into[t, (u - 1) % k]
        slots.write("grad", (u - 1) % k, p.b_arrive[t, (u - 1) % k], (mb, u - 1))
    assert p.b_into[t].sum() == sum(u > 0 for _, u in bs.values())
    for s, (kd, mb, u) in acts.items():                                # W reads
      if kd == "W":
        assert p.w_chunk[t, s] == u // k
        slots.read("keep", s, p.w_read[t, s], (mb, u))
  assert not slots.held, f"values never read: {sorted(slots.held)[:4]}"
  return p, slots.most


@given(st.sampled_from(LOCKSTEP), st.integers(1, 6), st.integers(1, 12), st.integers(1, 3),
       st.booleans())
def test_plan_hands_every_action_its_own_values(name, k, m, v, lockstep):
  # the tables run executes (a name's published table) and their lockstep forms
  k, m, v = _args(name, k, m, v)
  sched = pipeline.schedule(name, num_stages=k, num_microbatches=m, repeats=v,
                            lockstep=lockstep)
  p, most = _replay(sched)
  for pool in ("act", "grad", "stash") + (("keep",) if sched.split else ()):
    assert p.slots[pool] == most.get(pool, 0), (pool, p.slots, most)
  # the stash holds exactly the activations in flight (split: until W, the
  # stash is read by B already)
  assert p.slots["stash"] == sched.peak_in_flight if not sched.split else \
      p.slots["stash"] <= sched.peak_in_flight
  if name == "1f1b" and not lockstep:
    assert p.slots["stash"] == min(k, m)


def test_a_pool_shares_its_slot_numbers_only_where_that_costs_nothing():
  # the published 1F1B (K=4, M=32): one slot number per write event would
  # need 5 stash slots; numbered per stage, 4 = K
  sched = pipeline.schedule("1f1b", num_stages=4, num_microbatches=32)
  p = plan(sched)
  assert not p.shared["stash"] and p.slots["stash"] == 4
  lock = plan(pipeline.schedule("1f1b", num_stages=4, num_microbatches=32, lockstep=True))
  assert all(lock.shared.values()) and lock.slots["stash"] == 7
