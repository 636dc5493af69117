"""An exchange: each device receives the pieces of its new block it lacks.

The reshard planner (``reshard.py``) chains collectives that each keep a
regular layout in between (an all-to-all, then a ppermute, then another
all-to-all). Between two complete layouts that cross, such a chain can send
twice or three times what each device lacks. On a 2x4 mesh ``(a, b)``, ``f32[32,
64]`` from ``[_, a]`` (columns split over ``a``) to ``[(a, b), _]`` (rows over
both): device ``(i, j)`` keeps 4 rows of its own column half and lacks the other
half of the same rows, which device ``(1-i, j)`` holds::

    [_, a]                        [(a,b), _]
    +--------+--------+           +-----------------+
    | a=0    | a=1    |    ->     | rows of (0,0)   |   (0,0) keeps the left half,
    | (all   | (all   |           | rows of (0,1)   |   receives the right half
    |  rows) |  rows) |           | ...             |   from (1,0): 512 B
    +--------+--------+           +-----------------+

The chain sends 1536 B (an all-to-all and a ppermute); the exchange 512 B, one
ppermute. :func:`plan` cuts each device's new block into pieces, each lying
in one block of the old layout (per dim, the smaller of the two block lengths;
one of them must divide the other), takes the pieces a device holds from its
own block, and schedules the others in rounds: in each round every device sends
at most one piece and receives at most one (a ``ppermute``). Each piece's
sender is the least loaded of the devices holding its old block; the rounds
are a colouring of the (sender, receiver) pairs in which no device appears
twice in one colour, in as many colours as the busiest device sends or
receives pieces (Konig's theorem), which is then the most pieces one device
lacks. A round sends one piece's bytes per device, so the exchange costs
``rounds * piece``. :func:`plan_move`
gives the partitioner the exchange where that is fewer bytes than the chain
(``reshard.plan_reshard``), even were the chain's first collective shared
with another move of the same value (XLA emits a repeated one once). Layouts
and plans are still chosen by the chain's prices: a program's choices are
the same, and only some of its moves get cheaper.
``collectives.apply_plan`` runs it: the held pieces and each round's received
piece are stacked, and each device takes its block's pieces from the stack by a
table of its own index.

Only complete layouts (no pending sum), every dim split evenly under both.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence

from gshard.spmd import reshard
from gshard.spmd.sharding import Axes, MeshSizes, TensorSharding, itemsize

# rounds beyond which an exchange is not planned (each is a ppermute and a
# dynamic slice in the program: the chain's fewer collectives win there)
MAX_ROUNDS = 16

# devices (over the layouts' axes) beyond which it is not planned: its tables
# hold a row per device, and a pod's program would carry them
MAX_DEVICES = 64


@dataclasses.dataclass(frozen=True)
class Exchange:
  """How the devices swap pieces (tables indexed by a device's linear index
  over ``axes``, major first).

  Attributes:
    axes: the mesh axes of either layout, in mesh order.
    piece: the local shape of a piece.
    counts: per dim, how many pieces make the new block.
    held: per slot of pieces a device takes from its own block, each device's
      offset (per dim) in its old block (devices with fewer held pieces repeat
      one).
    rounds: per round, its ``(source, destination)`` pairs and each device's
      offset of the piece it sends.
    take: per device, for each piece of its new block (row-major over
      ``counts``), the slot that has it: ``held`` slots first, then rounds.
    bytes_per_device: ``len(rounds)`` pieces.
  """

  axes: Axes
  piece: tuple[int, ...]
  counts: tuple[int, ...]
  held: tuple[tuple[tuple[int, ...], ...], ...]
  rounds: tuple[tuple[tuple[tuple[int, int], ...], tuple[tuple[int, ...], ...]], ...]
  take: tuple[tuple[int, ...], ...]
  bytes_per_device: int


def plan_move(src: TensorSharding, dst: TensorSharding, global_shape: Sequence[int], dtype,
              mesh_sizes: MeshSizes) -> reshard.ReshardPlan:
  """What the partitioner runs to move a value from ``src`` to ``dst``: the
  exchange where it sends fewer bytes than ``reshard.plan_reshard``'s chain,
  and no more than the chain less its first collective (which another move
  of the value may share), else the chain. Every choice of layout is priced
  with the chain (layouts and plans are decided as without the exchange,
  which only makes some of their moves cheaper)."""
  chain = reshard.plan_reshard(src, dst, global_shape, dtype, mesh_sizes)
  if len(chain.collectives) < 2:             # one collective: at the least a device lacks
    return chain
  return _move(chain, tuple(int(n) for n in global_shape), itemsize(dtype),
               tuple(dict(mesh_sizes).items()))


@functools.lru_cache(maxsize=4096)
def _move(chain: reshard.ReshardPlan, shape: tuple, size: int,
          mesh_items: tuple) -> reshard.ReshardPlan:
  sizes = dict(mesh_items)
  src, dst = (reshard.drop_trivial_axes(s, sizes) for s in (chain.src, chain.dst))
  # no more than the chain's later steps alone: another move of the same
  # value whose chain begins with the same collective shares it (XLA emits
  # one), so the exchange must win even against the chain less its first step
  ex = plan(src, dst, shape, size, sizes,
            chain.bytes_per_device - chain.collectives[0].bytes_per_device + 1)
  if ex is None:
    return chain
  step = reshard.Step("exchange", ex.axes, None, ex.bytes_per_device, exchange=ex)
  return reshard.ReshardPlan(chain.src, chain.dst, (step,), ex.bytes_per_device, False)


def plan(src: TensorSharding, dst: TensorSharding, shape: Sequence[int], item_bytes: int,
         sizes: MeshSizes, budget: float) -> Exchange | None:
  """The exchange from ``src`` to ``dst`` (size-1 axes dropped) sending fewer
  than ``budget`` bytes per device, or None (a pending sum, an uneven split,
  block lengths neither of which divides the other, more than ``MAX_DEVICES``
  devices or ``MAX_ROUNDS`` rounds, nothing to send, or no fewer bytes)."""
  if src.partial or dst.partial or not math.prod(shape):     # (an empty value moves nothing)
    return None
  used = {a for s in (src, dst) for d in s.dims for a in d}
  axes = tuple(a for a in sizes if a in used)
  if math.prod(sizes[a] for a in axes) > MAX_DEVICES:
    return None
  src_len, dst_len, piece = [], [], []
  for dim, n in enumerate(shape):
    ks, kt = src.num_shards(dim, sizes), dst.num_shards(dim, sizes)
    if n % ks or n % kt:
      return None
    ls, lt = n // ks, n // kt
    q = min(ls, lt)
    if ls % q or lt % q:
      return None
    src_len.append(ls)
    dst_len.append(lt)
    piece.append(q)
  piece_bytes = math.prod(piece) * item_bytes
  if piece_bytes >= budget:                # one round already sends no fewer
    return None
  counts = tuple(lt // q for lt, q in zip(dst_len, piece))
  coords = list(itertools.product(*(range(sizes[a]) for a in axes)))

  def position(dims, c) -> list[int]:
    at = dict(zip(axes, c))
    return [reshard.linear_index([at[a] for a in d], [sizes[a] for a in d]) for d in dims]

  holders: dict[tuple, list[int]] = {}
  for i, c in enumerate(coords):
    holders.setdefault(tuple(position(src.dims, c)), []).append(i)
  held: list[list[tuple]] = [[] for _ in coords]        # (offset, piece index)
  wants: list[tuple[int, int, list[int], tuple]] = []   # (device, piece, holders, offset)
  for i, c in enumerate(coords):
    starts = [p * lt for p, lt in zip(position(dst.dims, c), dst_len)]
    for k, p in enumerate(itertools.product(*(range(m) for m in counts))):
      at = [s + j * q for s, j, q in zip(starts, p, piece)]
      block = tuple(g // ls for g, ls in zip(at, src_len))
      offset = tuple(g - b * ls for g, b, ls in zip(at, block, src_len))
      if i in holders[block]:
        held[i].append((offset, k))
      else:
        wants.append((i, k, holders[block], offset))
  if not wants:
    return None
  wants = _senders(wants)
  slots = max(len(h) for h in held)
  colour = _rounds(wants)
  n_rounds = max(colour) + 1
  if n_rounds * piece_bytes >= budget or n_rounds > MAX_ROUNDS:
    return None                            # the chain sends no more
  rounds: list[tuple[dict[int, int], dict[int, tuple]]] = [({}, {}) for _ in range(n_rounds)]
  slot_of: dict[tuple[int, int], int] = {}
  for (i, k, _, offset, j), c in zip(wants, colour):
    rounds[c][0][j], rounds[c][1][j] = i, offset
    slot_of[(i, k)] = slots + c
  for i, h in enumerate(held):
    for s, (_, k) in enumerate(h):
      slot_of[(i, k)] = s
  zero = tuple(0 for _ in shape)
  return Exchange(
      axes, tuple(piece), counts,
      tuple(tuple(h[min(s, len(h) - 1)][0] if h else zero for h in held)
            for s in range(slots)),
      tuple((tuple(sorted(senders.items())),
             tuple(sends.get(j, zero) for j in range(len(coords))))
            for senders, sends in rounds),
      tuple(tuple(slot_of[(i, k)] for k in range(math.prod(counts)))
            for i in range(len(coords))),
      len(rounds) * piece_bytes)


def _senders(wants: list[tuple]) -> list[tuple]:
  """Each wanted piece's sender among the holders of its old block: pieces
  with the fewest holders first, each from the least loaded holder (ties:
  the first from the receiver's own index on, so rounds come out as
  shifts). Returns the wants with their sender appended."""
  load: dict[int, int] = {}
  out = []
  for i, k, who, offset in sorted(wants, key=lambda w: (len(w[2]), w[0], w[1])):
    at = bisect.bisect_left(who, i)
    j = min(who[at:] + who[:at], key=lambda j: load.get(j, 0))
    load[j] = load.get(j, 0) + 1
    out.append((i, k, who, offset, j))
  return out


def _rounds(wants: list[tuple]) -> list[int]:
  """The round of each (receiver, ..., sender) want: a proper edge colouring
  of the bipartite multigraph of senders and receivers in as many rounds
  as the busiest device sends or receives pieces (Konig's theorem; each
  edge coloured with a colour free at its sender, after swapping two
  colours along the alternating path from its receiver where needed)."""
  at: dict[tuple, dict[int, int]] = {}          # (side, device) -> colour -> edge
  ends = [(("s", w[4]), ("r", w[0])) for w in wants]
  colour = [-1] * len(wants)

  def free(v) -> int:
    used = at.setdefault(v, {})
    return next(c for c in range(len(used) + 1) if c not in used)

  for e, (u, v) in enumerate(ends):
    a, b = free(u), free(v)
    if a not in at[v]:
      b = a
    else:
      # the path from v along colours a, b, a, ...: swap them on it
      path, x, c = [], v, a
      while c in at.setdefault(x, {}):
        f = at[x][c]
        path.append(f)
        x = ends[f][1] if ends[f][0] == x else ends[f][0]
        c = b if c == a else a
      for f in path:
        for y in ends[f]:
          del at[y][colour[f]]
      for f in path:
        colour[f] = b if colour[f] == a else a
        for y in ends[f]:
          at[y][colour[f]] = f
      b = a
    colour[e] = b
    at[u][b] = at[v][b] = e
  return colour
