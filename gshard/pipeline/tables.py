"""The built-in schedules (GPipe, 1F1B, interleaved 1F1B, ZB-H1) and ``schedule()``.

Each is a per-device order of actions, placed on ticks as early as the tick
rules allow (:func:`place`): the tables ``pipeline.run`` executes. With
``lockstep=True`` each is laid out in *rounds* instead (:func:`lockstep_table`),
every tick one kind of action on every stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gshard.pipeline.actions import Action, Key, dependencies, virtual_stage
from gshard.pipeline.schedules import Schedule

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")


def place(orders: list[list[Action]], num_stages: int, repeats: int, name: str):
  """Place each device's ordered actions at the earliest tick its inputs allow."""
  num_virtual = num_stages * repeats
  done: dict[Key, int] = {}
  pos = [0] * num_stages
  remaining = sum(len(o) for o in orders)
  table = []
  while remaining:
    t = len(table)
    row: list[Action | None] = [None] * num_stages
    for s, order in enumerate(orders):
      if pos[s] == len(order):
        continue
      a = order[pos[s]]
      deps = dependencies(a.kind, a.microbatch, virtual_stage(s, a.chunk, num_stages),
                           num_virtual)
      if all(done.get(d, t) < t for d in deps):
        row[s] = a
    if not any(row):
      raise AssertionError(f"{name}: the per-device orders deadlock at tick {t}; this is a "
                           "bug in gshard.pipeline.tables, please report it.")
    for s, a in enumerate(row):
      if a is not None:
        done[(a.kind, a.microbatch, virtual_stage(s, a.chunk, num_stages))] = t
        pos[s] += 1
        remaining -= 1
    table.append(tuple(row))
  return tuple(table)


def _grouped(num_stages: int, num_microbatches: int, repeats: int, backward: bool):
  """(microbatch, chunk) in Megatron's interleaved order: K micro-batches per chunk."""
  pairs = [(m, c) for m in range(num_microbatches) for c in range(repeats)]
  if backward:
    key = lambda p: (p[0] // num_stages, repeats - 1 - p[1], p[0] % num_stages)
  else:
    key = lambda p: (p[0] // num_stages, p[1], p[0] % num_stages)
  return sorted(pairs, key=key)


def _gpipe_orders(k: int, m: int, v: int) -> list[list[Action]]:
  """All forwards (grouped order), then all backwards in the exact reverse order."""
  fwd = _grouped(k, m, v, backward=False)
  order = [Action("F", mb, c) for mb, c in fwd] + [Action("B", mb, c) for mb, c in reversed(fwd)]
  return [list(order) for _ in range(k)]


def _interleaved_orders(k: int, m: int, v: int) -> list[list[Action]]:
  """Megatron's (interleaved) 1F1B: warm-up forwards, then F/B pairs, then backwards.

  Device s warms up with ``K-1-s`` forwards when ``v = 1`` (PipeDream-flush),
  and with ``2(K-1-s) + (v-1)K`` when ``v > 1`` (Megatron-LM's count), capped
  at ``M * v``.
  """
  fwd = _grouped(k, m, v, backward=False)
  bwd = _grouped(k, m, v, backward=True)
  total = m * v
  orders = []
  for s in range(k):
    warmup = k - 1 - s if v == 1 else 2 * (k - 1 - s) + (v - 1) * k
    warmup = min(warmup, total)
    order = [Action("F", *fwd[i]) for i in range(warmup)]
    for i in range(total - warmup):
      order += [Action("F", *fwd[warmup + i]), Action("B", *bwd[i])]
    order += [Action("B", *bwd[i]) for i in range(total - warmup, total)]
    orders.append(order)
  return orders


def _zb_h1_orders(k: int, m: int) -> list[list[Action]]:
  """ZB-H1: 1F1B's warm-up, B split from W, device s holding back ``s`` W actions.

  After ``K-1-s`` warm-up forwards, device s repeats F, B, W; its W actions
  lag its B actions by ``s`` micro-batches (the last device's W trail furthest),
  and the held-back W fill the cool-down where 1F1B idles. Peak activations:
  ``(K-1-s) + 1 + s = K`` on every device, 1F1B's peak (that of device 0).
  """
  orders = []
  for s in range(k):
    warmup = min(k - 1 - s, m)
    order = [Action("F", i) for i in range(warmup)]
    next_f, pending = warmup, []
    for b in range(m):
      if next_f < m:
        order.append(Action("F", next_f))
        next_f += 1
      order.append(Action("B", b))
      pending.append(b)
      if len(pending) > s:
        order.append(Action("W", pending.pop(0)))
    order += [Action("W", w) for w in pending]
    orders.append(order)
  return orders


def lockstep_table(name: str, k: int, m: int, v: int):
  """``name`` laid out in rounds, every tick one kind of action on every stage.

  For a program that runs a tick's work on every device at once without
  per-device branches (a device could not run a forward while its neighbour
  runs a backward without computing both; ``pipeline.run`` has per-device
  branches and runs the published tables). The table is built from rounds, each an F tick, then a B tick, then (split
  schedules) a W tick, empty ticks dropped. Device s runs its i-th forward (the
  grouped order: K micro-batches per chunk) in round ``i + s``, its j-th
  backward in round ``j + vK + K - 2 - s`` and its j-th W in round
  ``j + vK + K - 2``: every backward as early as the forward chain allows, every
  W tick full. ``gpipe`` is its own lockstep form.
  """
  if name == "gpipe":
    return place(_gpipe_orders(k, m, v), k, v, name)
  fwd = _grouped(k, m, v, backward=False)
  bwd = _grouped(k, m, v, backward=True)
  late = v * k + k - 2
  cells: dict[tuple[int, int], list] = {}
  for s in range(k):
    for i, (mb, c) in enumerate(fwd):
      cells.setdefault((i + s, 0), [None] * k)[s] = Action("F", mb, c)
    for j, (mb, c) in enumerate(bwd):
      cells.setdefault((j + late - s, 1), [None] * k)[s] = Action("B", mb, c)
      if name == "zero_bubble":
        cells.setdefault((j + late, 2), [None] * k)[s] = Action("W", mb, c)
  return tuple(tuple(cells[key]) for key in sorted(cells))


def schedule(name: str | None = None, *, num_stages: int, num_microbatches: int,
             repeats: int = 1, costs: Mapping[str, object] | None = None,
             table: Sequence[Sequence[object]] | None = None,
             lockstep: bool = False) -> Schedule:
  """A pipeline schedule by name, or a user's own ``table``, validated.

  Args:
    name: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or ``"zero_bubble"``;
      with ``table``, any label (default ``"custom"``).
    num_stages: K, devices along the pipeline axis.
    num_microbatches: M.
    repeats: v, chunks per device (virtual stage of (s, c) is ``c*K + s``).
    costs: ``dict(F=..., B=..., W=..., comm=...)`` for ``bubble_fraction``
      (see :class:`Costs`); None means every action takes one tick.
    table: a user's schedule, ``table[tick][stage]`` of Action, None or
      ``(kind, microbatch[, chunk])``.
    lockstep: False: the schedule as the literature (and asynchronous
      runtimes such as ``torch.distributed.pipelining``) defines it, each
      device starting an action as soon as its inputs arrive; what
      ``pipeline.run`` executes. True: laid out in rounds where all stages
      run one kind of action per tick (:func:`lockstep_table`), for a
      runtime without per-device branches; its metrics replay it that way
      (:meth:`Schedule.timeline`).

  The built-in schedules. Numbers are exact (the tests check them) in the
  table's ticks, i.e. every action, a chunk's F, B or W, lasts one tick; they
  also hold under uniform ``costs`` where noted (``F``, ``B``, ``W`` the
  durations of one chunk's actions, ``comm=0``):

  - ``gpipe``: every forward, then every backward in the exact reverse order
    (the mirror image, what autodiff of a forward loop gives). ``repeats > 1``
    is the circular pipeline, forwards grouped K micro-batches per chunk;
    needs K to divide M. Bubble ``(K-1)/(vM+K-1)``, also under any uniform
    F, B (makespan ``(vM+K-1)(F+B)``). Peak in flight ``vM``: all of them.
  - ``1f1b``: PipeDream-flush / Megatron non-interleaved: device s runs
    ``min(K-1-s, M)`` warm-up forwards, then one F / one B alternately, then
    the remaining backwards. Bubble ``(K-1)/(M+K-1)``, as GPipe, also under
    uniform F, B. Peak in flight ``min(K, M)`` (device s: ``min(K-s, M)``).
    Needs ``repeats=1`` (use ``interleaved``).
  - ``interleaved``: Megatron-LM's interleaved 1F1B, forwards grouped K
    micro-batches per chunk, warm-up ``2(K-1-s) + (v-1)K`` on device s; needs
    K to divide M when ``repeats > 1``. Bubble ``(K-1)/(vM+K-1)``, also under
    uniform per-chunk F, B: Megatron's "bubble / ideal = (K-1)/(vM)" written as a
    share of the total. Peak in flight on device s ``min(vK+K-1-2s, vM)``
    (per chunk), so ``vK+K-1`` once ``M >= 2K``. ``repeats=1`` is ``1f1b``.
  - ``zero_bubble``: ZB-H1 of Qi et al. (arXiv 2401.10241); B is the input
    gradient, W the weight gradient, device s keeps ``s`` W actions back to
    fill the cool-down. For ``M >= K``: ``3M+K-1`` ticks, bubble
    ``(K-1)/(3M+K-1)`` (1F1B's is ``(K-1)/(M+K-1)`` with its B lasting 2); for
    ``M < K``: ``2(M+K)-1`` ticks. Under uniform costs with ``W <= F`` and
    ``W <= B`` (and ``M >= K``) the makespan is the paper's
    ``M(F+B+W) + (K-1)(F+B-W)``. Peak in flight ``min(K, M)``, as 1F1B.
    Needs ``repeats=1``.

  ``pipeline.run`` executes these tables as they are: in a tick where stages
  run different actions each device runs only its own (its FLOPs per step
  are its M*v actions, whatever the bubble). Their lockstep forms
  (``lockstep=True``, a user may pass one to ``run``): every tick
  one kind of action on all stages, so a step costs ``#F ticks * F + #B ticks
  * B + #W ticks * W`` on every device. ``gpipe`` is unchanged. ``1f1b``:
  device s warms up with ``2(K-1-s)`` forwards (a forward reaches the next
  stage one round later, not one tick), ``2(M+K-1)`` ticks, bubble
  ``(K-1)/(M+K-1)`` as above, peak in flight ``min(2K-1-2s, M)`` on device
  s: ``2K-1`` at most, whatever M. ``interleaved``: ``2(vM+K-1)`` ticks, bubble
  ``(K-1)/(vM+K-1)``, peak ``min(vK+K-1-2s, vM)`` chunks (Megatron-LM's
  interleaved schedule is this one). ``zero_bubble``: 1F1B's rounds plus one
  full W tick per round from round ``2K-2``: ``3M+2K-2`` ticks; the bubble is
  the forward and input-gradient fill only, ``(K-1)(F+B) / ((M+K-1)(F+B) +
  M W)`` (``2(K-1)/(3M+2K-2)`` at unit costs), where ``1f1b``'s is ``(K-1)(F+B+W)
  / ((M+K-1)(F+B+W))``; peak ``min(2K-1-s, M)`` on device s, 1F1B's ``2K-1``.

  Raises:
    ValueError: unknown name, a requirement not met (message names the fix),
      or an invalid ``table`` (message names tick, stage, action and rule).
  """
  if not isinstance(lockstep, bool):
    raise ValueError(f"schedule: lockstep must be True or False, got {lockstep!r}.")
  for field, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                       ("repeats", repeats)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"schedule: {field} must be an int >= 1, got {value!r}.")
  if table is not None:
    return Schedule(name or "custom", num_stages, num_microbatches, repeats, table, costs,
                    lockstep)
  if name not in SCHEDULES:
    raise ValueError(f"schedule: name must be one of {', '.join(map(repr, SCHEDULES))} (or pass "
                     f"table=...), got {name!r}.")
  k, m, v = num_stages, num_microbatches, repeats
  if v > 1 and m % k and name in ("gpipe", "interleaved"):
    raise ValueError(
        f"schedule({name!r}): num_microbatches={m} must be a multiple of num_stages={k} when "
        f"repeats={v} > 1 (chunks run K micro-batches at a time; a partial group would stall "
        f"every device); use num_microbatches={k * -(-m // k)}, or repeats=1.")
  if name == "gpipe":
    orders = _gpipe_orders(k, m, v)
  elif name == "1f1b":
    if v != 1:
      raise ValueError(f"schedule('1f1b'): repeats must be 1, got repeats={v}; for several "
                       "chunks per device use schedule('interleaved', repeats=...).")
    orders = _interleaved_orders(k, m, 1)
  elif name == "interleaved":
    orders = _interleaved_orders(k, m, v)
  else:
    if v != 1:
      raise ValueError(f"schedule('zero_bubble'): repeats must be 1 (ZB-H1), got repeats={v}.")
    orders = _zb_h1_orders(k, m)
  if lockstep:
    return Schedule(name, k, m, v, lockstep_table(name, k, m, v), costs, True)
  return Schedule(name, k, m, v, place(orders, k, v, name), costs)
