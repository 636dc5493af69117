"""Collective bytes sent per device, read from an optimized HLO module's text.

``collectives(compiled.as_text(), num_devices)`` lists every all-reduce,
all-gather, reduce-scatter, all-to-all and collective-permute (tuple-merged
forms and async ``-start`` forms included; ``-done`` halves are skipped) with
its group size and the bytes one device sends under the ring formulas (a ring
collective of S bytes over n devices):

  all-reduce 2(n-1)/n*S    all-gather (n-1)/n*S_out    reduce-scatter (n-1)/n*S_in
  all-to-all (n-1)/n*S     collective-permute S

Group sizes come from ``replica_groups`` in any of XLA's printed forms:
``{{0,4},{1,5}}`` (explicit), ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)`` (iota),
``mesh['x'=2,'y'=4] {'y'}`` (named mesh axes) and ``{}`` (all devices).
Operand sizes are taken from the defining instruction of each operand, so the
numbers do not depend on how XLA prints async or tuple result types.

A collective inside a loop runs once per iteration: ``executions`` is the
product of the trip counts (``known_trip_count``) of the ``while`` loops around
it (1 where XLA knows none), and ``total`` its bytes over one call of the
program; ``bytes_sent`` (the module's total) sums ``total``.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

_DTYPE_BYTES = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1,
    "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9]\w*)?)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
          "collective-permute")
_OP = re.compile(r"\s(" + "|".join(_KINDS) + r")(-start)?\(")


@dataclasses.dataclass(frozen=True)
class HloCollective:
  """One collective instruction of an optimized HLO module."""

  name: str
  kind: str            # one of _KINDS ("-start" folded in)
  group_size: int      # devices per replica group (n)
  operand_bytes: int   # S_in: all operands together (tuple-merged ones summed)
  bytes_sent: float    # per device, ring formula
  op_name: str         # metadata op_name, if printed
  operands: tuple[str, ...] = ()   # operand shapes, e.g. ("f32[8,128]", ...)
  executions: int = 1  # times it runs per call: the trip counts of the loops around it

  @property
  def total(self) -> float:
    """Bytes one device sends by this instruction over one call of the program."""
    return self.bytes_sent * self.executions


def array_bytes(type_text: str) -> int:
  """Bytes of every array shape in an HLO type (a tuple's elements summed)."""
  total = 0.0
  for dtype, dims in _ARRAY.findall(type_text):
    if dtype.startswith("f8") or dtype.startswith("f4"):
      width = 1 if dtype.startswith("f8") else 0.5
    elif dtype in _DTYPE_BYTES:
      width = _DTYPE_BYTES[dtype]
    else:
      continue   # token[], opaque types
    total += width * math.prod(int(d) for d in dims.split(",") if d)
  return int(total)


def _balanced(text: str, start: int) -> int:
  """Index just past the bracket group opening at ``text[start]``."""
  pairs = {"(": ")", "[": "]", "{": "}"}
  stack = []
  for i in range(start, len(text)):
    c = text[i]
    if c in pairs:
      stack.append(pairs[c])
    elif stack and c == stack[-1]:
      stack.pop()
      if not stack:
        return i + 1
  return len(text)


def _result_type(line: str, m: re.Match) -> str:
  rest = line[m.end():]
  if rest.startswith("("):
    return rest[:_balanced(rest, 0)]
  return rest.split(" ", 1)[0]


def group_size(line: str, num_devices: int) -> int:
  """n for one collective instruction line (see the module docstring): the
  size of its replica groups, all devices where it names none."""
  groups = replica_groups(line, num_devices)
  return len(groups[0]) if groups else num_devices


def _bytes_sent(kind: str, n: int, s_in: int, line: str) -> float:
  if n <= 1 and kind != "collective-permute":
    return 0.0
  if kind == "all-reduce":
    return 2 * (n - 1) / n * s_in
  if kind == "all-gather":
    return (n - 1) / n * (s_in * n)      # S_out = n * S_in
  if kind == "reduce-scatter":
    return (n - 1) / n * s_in
  if kind == "all-to-all":
    return (n - 1) / n * s_in
  # collective-permute: S if any device sends to another one
  pairs = re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=", 1)[-1]
                     .split("}}", 1)[0] + "}")
  return float(s_in) if any(a != b for a, b in pairs) else 0.0


_HEAD = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{$")
_CALLEE = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)"
                     r"=%?([\w.\-]+)|branch_computations=\{([^}]*)\}")


def _executions(lines: list[str]) -> list[int]:
  """Per line, how many times one call of the module runs it: a while body
  its loop's ``known_trip_count`` times (its condition once more), nested
  loops multiplied, any other called computation as often as its caller
  (a conditional's branches each at most once: counted once)."""
  comp_of, calls, entry, cur = [], {}, None, None
  for line in lines:
    head = _HEAD.match(line)
    if head and not line.startswith(" "):
      cur = head.group(2)
      calls[cur] = []
      entry = cur if head.group(1) else entry
    elif cur is not None and line.startswith("  "):
      trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
      n = int(trips.group(1)) if trips and " while(" in line else 1
      for m in _CALLEE.finditer(line):
        if m.group(3) is not None:
          calls[cur] += [(c.strip().lstrip("%"), 1) for c in m.group(3).split(",")]
        else:
          calls[cur].append((m.group(2), n + 1 if m.group(1) == "condition" and n > 1
                             else n if m.group(1) == "body" else 1))
    comp_of.append(cur)
  runs: dict[str, int] = {}

  def visit(comp: str, k: int) -> None:
    runs[comp] = runs.get(comp, 0) + k
    for callee, times in calls.get(comp, ()):
      visit(callee, k * times)
  if entry is not None:
    visit(entry, 1)
  return [runs.get(c, 1) if c is not None else 1 for c in comp_of]


def collectives(hlo_text: str, num_devices: int) -> list[HloCollective]:
  """Every collective of the module, in text order."""
  types: dict[str, str] = {}
  lines = hlo_text.splitlines()
  for line in lines:
    m = _INSTR.match(line)
    if m:
      types[m.group(1)] = _result_type(line, m)
  runs = _executions(lines)
  out = []
  for line, executions in zip(lines, runs):
    m = _INSTR.match(line)
    if not m:
      continue
    op = _OP.search(line, m.end() - 1)
    if op is None:
      continue
    # the opcode must follow the result type directly
    if op.start() > m.end() + len(types[m.group(1)]) + 1:
      continue
    kind = op.group(1)
    args_text = line[op.end() - 1:_balanced(line, op.end() - 1)]
    names = re.findall(r"%([\w.\-]+)", args_text)
    if names:
      s_in = sum(array_bytes(types.get(a, "")) for a in names)
      shapes = tuple(f"{d}[{s}]" for a in names
                     for d, s in _ARRAY.findall(types.get(a, "")))
    else:   # operands printed without names: their types are inline
      s_in = array_bytes(args_text)
      shapes = tuple(f"{d}[{s}]" for d, s in _ARRAY.findall(args_text))
    n = group_size(line, num_devices)
    op_name = re.search(r'op_name="([^"]*)"', line)
    out.append(HloCollective(m.group(1), kind, n, s_in,
                             _bytes_sent(kind, n, s_in, line),
                             op_name.group(1) if op_name else "", shapes, executions))
  return out


def bytes_sent(hlo_text: str, num_devices: int) -> float:
  """Total bytes one device sends over one call of the module (a collective
  in a loop once per iteration)."""
  return sum(c.total for c in collectives(hlo_text, num_devices))


def distinct_kernels(hlo_text: str) -> int:
  """How many different fusions a compiled module holds: XLA:CPU compiles each
  distinct fused computation once (a repeated layer's kernels are shared), and
  that code generation is most of its compile time. Two fusions are the same
  kernel when their computations match with names and metadata removed."""
  comps: dict[str, list[str]] = {}
  cur = None
  for line in hlo_text.split("\n"):
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head and not line.startswith(" "):
      cur = head.group(1)
      comps[cur] = []
    elif cur is not None and line.startswith("  "):
      comps[cur].append(line.strip())
  kinds = set()
  for lines in comps.values():
    for line in lines:
      m = re.match(r"(?:ROOT )?%?[\w.\-]+ = (\S+) fusion\(.*calls=%?([\w.\-]+)", line)
      if m and m.group(2) in comps:
        body = sorted(re.sub(r"%[\w.\-]+", "%", re.sub(r", metadata=\{.*?\}", "", x))
                      .removeprefix("ROOT ") for x in comps[m.group(2)])
        kinds.add(m.group(1) + "\n" + "\n".join(body))
  return len(kinds)


def replica_groups(line: str, num_devices: int) -> tuple[tuple[int, ...], ...] | None:
  """The device groups of one collective instruction line, whichever way XLA
  spells them (explicit, iota ``[G,S]<=[dims]T(perm)``, or
  ``mesh['a'=2,'b'=4] {'b'}``), sorted; None if the line names none."""
  m = re.search(r"replica_groups=", line)
  if m is None:
    return None
  rest = line[m.end():]
  if rest.startswith("{"):
    body = rest[1:_balanced(rest, 0) - 1]
    groups = [tuple(int(t) for t in g.split(",") if t.strip())
              for g in re.findall(r"\{([0-9,\s]*)\}", body)]
    groups = [g for g in groups if g] or [tuple(range(num_devices))]
  elif rest.startswith("["):
    shape = [int(t) for t in rest[1:rest.index("]")].split(",")]
    after = rest[rest.index("<=[") + 3:]
    dims = [int(t) for t in after[:after.index("]")].split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    perm = re.match(r"\]T\(([0-9,]+)\)", after[after.index("]"):])
    if perm:
      ids = ids.transpose([int(t) for t in perm.group(1).split(",")])
    groups = [tuple(g) for g in ids.reshape(shape).tolist()]
  elif rest.startswith("mesh"):
    names_sizes = re.findall(r"'([^']+)'=(\d+)", rest[:rest.index("]") + 1])
    after = rest[rest.index("]") + 1:].lstrip()
    # the mesh's devices in another order: ``, device_ids=([2,2,2]T(1,0,2))``
    # (an iota, transposed) or an explicit list
    devices = None
    d = re.match(r",\s*device_ids=\((?:\[([0-9,]+)\](?:T\(([0-9,]+)\))?|([0-9,\s]+))\)\s*",
                 after)
    if d:
      if d.group(1):
        dims = [int(t) for t in d.group(1).split(",")]
        devices = np.arange(int(np.prod(dims))).reshape(dims)
        if d.group(2):
          devices = devices.transpose([int(t) for t in d.group(2).split(",")])
        devices = devices.reshape(-1)
      else:
        devices = np.array([int(t) for t in d.group(3).split(",") if t.strip()])
      after = after[d.end():]
    chosen = after[1:_balanced(after, 0) - 1] if after.startswith("{") else ""
    # each axis split into (pre, size, post) parts; the chosen parts form a group
    shape, keep = [], []
    picks = {}
    for name, pre, sub in re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", chosen):
      picks.setdefault(name, []).append((int(pre), int(sub)) if sub else None)
    for name, size in names_sizes:
      size = int(size)
      sel = picks.get(name)
      if not sel or sel == [None]:
        shape.append(size)
        keep.append(bool(sel))
        continue
      (pre, sub), = sel
      parts = [pre, sub, size // (pre * sub)]
      shape.extend(parts)
      keep.extend([False, True, False])
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    order = [i for i, k in enumerate(keep) if not k] + [i for i, k in enumerate(keep) if k]
    size = int(np.prod([n for n, k in zip(shape, keep) if k]))
    groups = ids.transpose(order).reshape(-1, size)
    if devices is not None:
      groups = devices[groups]
    groups = [tuple(g) for g in groups.tolist()]
  else:
    return None
  return tuple(sorted(tuple(sorted(g)) for g in groups))


_GROUPS = re.compile(r", replica_groups=(?:\{(?:\{[0-9,\s]*\},?\s*)*\}|\[[0-9,]+\]<=\[[0-9,]+\]"
                     r"(?:T\([0-9,]+\))?|mesh\[[^\]]*\](?:,\s*device_ids=\([^)]*\))?\s*\{[^}]*\})")


def canonical(hlo_text: str, num_devices: int = 0) -> list[str]:
  """Every instruction of a compiled module, names, metadata and channel ids
  removed, sorted:
  two modules with the same list run the same kernels and collectives."""
  out = []
  for line in hlo_text.split("\n"):
    if not line.startswith("  ") or " = " not in line:
      continue
    x = re.sub(r", metadata=\{.*?\}|, channel_id=\d+", "", line.strip()).removeprefix("ROOT ")
    groups = replica_groups(x, num_devices)
    if groups is not None:     # one spelling of the device groups
      x = _GROUPS.sub("", x) + f", groups={groups}"
    out.append(re.sub(r"%[\w.\-]+", "%", x.split(" = ", 1)[1]))
  return sorted(out)


def same_program(a: str, b: str, num_devices: int) -> bool:
  """Whether two compiled modules hold the same instructions (see :func:`canonical`)."""
  return canonical(a, num_devices) == canonical(b, num_devices)
