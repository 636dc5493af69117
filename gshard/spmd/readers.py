"""Values laid out for the op that reads them, after propagation.

Propagation settles a value from the constraints that reach it first. An
elementwise op whose operands disagree takes the layout that moves the fewest
bytes at that op alone, and its reader may then move the result. On a 2x4
mesh, an MLP's ``relu`` gradient with ``w1 [64, 128@(b,a)]`` and
``w2 [128@(a,b), 64]``::

    dh    = dy @ w2.T            [32, 128@a*b]
    mask  = h > 0                [32, 128@b*a]   (the forward's layout)
    g     = select(mask, dh, 0)  [32, 128@a*b]   mask moved       512 B
    dW1   = x.T @ g              [64, 128@b*a]   g moved         2048 B

Here each operand the partitioner's plan for its reader moves (``partition/
plan.py``, the plan the partitioner then runs: memoised) is tried in the
layout that plan reads it in, with the values it is made of back through ops
that pass a layout through (elementwise ops, converts, transposes; calls run
inline, such as ``jnp.where``'s jit and ``jax.nn.relu``'s custom_jvp_call):
above, ``g``, ``mask`` and ``dh`` in ``b*a``, so ``dh`` moves once (2048 B)
and nothing else does. Kept only where the plans of every op making or
reading those values send strictly fewer bytes in all (each value's move to
a layout counted once: the partitioner reuses it); only moves that keep each
value's shard count (never a gather: a value made replicated costs every
device its compute), but for a move to the layout of a value the reader
reads beside it that stays as it is (a weight gradient made in its weight's
layout for the update, as GShard prefers); never a pinned value, a program
input or output, a pending sum, or a loop's or branch's body's input or
output (a loop carries them, branches agree on them: the values inside a
body are laid out as the top program's are, its ops priced per trip).

Where a candidate's chain one way sends no fewer bytes, its region is tried
after the chains have settled: the values its values are made of and those
made of them, both ways, through the same ops. Inside a scan accumulating
an FSDP MLP's gradients, with ``x_k [128@data, 64]`` and ``w_in [64,
128@data]`` tying at their dot, propagation gave the GELU ``w_in``'s
feature split from the bias add; the batch-split annotation after it then
moved the GELU's values there and back, forward and backward, every trip.
The GELU's forward values and the backward ops reading them laid out as one
gather the weights instead. A region is priced as a chain is; regions run
after the chains (one kept first could leave a later chain no longer
cheaper), then the chains run again.

A reshape whose rows the partitioner moves (``relayout.py``: ``[B@A] -> [K,
M@A]`` by ppermute rounds) is priced as those rounds, not as the generic
rule's plan (which gathers what the micro-batch dim cannot hold): an op
pinned to the rows' split reading ``[32@(x,y)] -> [4, 8]`` on a 2x4 mesh
has the reshape made there, 16 B where gathering ``y`` and moving the
result sent 72 B.

A call's link that moves its value (``jax.nn.relu``'s inner operand laid
out otherwise than the value passed in) is tried the other way: the inner
operand in the outer value's layout, carried on to the values made of it
through ops passing a layout on (the relu's result, its mask, the gradient
it selects), priced as above.

A result its maker's plan makes in one layout and then moves (a dot made
``[32, 128@b*a]`` and moved to ``a*b`` for the relu reading it) is tried in
the layout it is made in, carried on the same way: the relu's result and
mask made there, the relu's result moved for the next dot instead of the
dot's, and the mask no longer moved back for the gradient's select.

The plans priced read the copies the partitioner will hold: a layout an
earlier reader's plan moved an operand to is reused, and a layout that only
slices one is cut from it (``Context.reshard``). With ``x [32, 64@a*b]``
gathered for the forward dot, the weight gradient ``x.T @ dy`` reads that
copy: made in ``w1``'s layout, it sends nothing, where priced without the
copy a layout that moved ``dy`` and then the gradient looked as cheap. The
ops priced for a chain include the later readers of what its ops read (a
copy a chain's op no longer makes is gone for them).
"""

from __future__ import annotations

import math

from gshard.spmd import factors, linearity, relayout, reshard
from gshard.spmd.partition import plan
from gshard.spmd.graph import Graph, Tensor, sub_jaxprs
from gshard.spmd.sharding import TensorSharding, is_refinement
from gshard.spmd.updates import passes


# sweeps over the readers: a chain laid out for an earlier reader can leave a
# later one moving what it read as it was (each kept chain sends strictly
# fewer bytes, so they end; this bounds the work)
ROUNDS = 4

# the most values one chain lays out anew (its ops are planned twice to price it)
MAX_CHAIN = 256

# calls the partitioner runs inline (their values flow in and out as they are;
# graph's call list less checkpoint, whose partition reads its operands
# through a barrier)
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "custom_jvp_call",
                    "custom_vjp_call"})

# ops whose bodies the pass lays out, their inputs and outputs as they are
# (a loop carries them, branches agree on them)
_BODIES = frozenset({"scan", "while", "cond"})


def lay_out_for_readers(graph: Graph, touching: dict[int, list[int]]) -> None:
  """Give each operand its reader moves (and the values it is made of) the
  reader's layout where that sends fewer bytes (``touching``: id of a tensor
  -> indices of the bounds naming it). Readers are visited last first, so a
  chain laid out for a later reader is read as such by an earlier one; then
  again, while a sweep kept a chain (at most ``ROUNDS``)."""
  _Pass(graph, touching).run()


def _shards(s: TensorSharding, mesh) -> int:
  return math.prod(mesh[a] for d in s.dims for a in d)


def _moves(a: TensorSharding, z: TensorSharding) -> bool:
  """Whether a value passed from layout ``a`` to ``z`` moves (not a slice)."""
  return a != z and not is_refinement(a, z)


def _link(b) -> bool:
  """Whether ``b`` links a call's operand or result to its inner jaxpr's."""
  return b.eqn.primitive.name in _CALLS


def _agrees(c) -> bool:
  """Whether ``c`` is an elementwise op on operands laid out as its result
  (it moves nothing: no plan needed)."""
  r = c.results[0] if len(c.results) == 1 else None
  return r is not None and all(
      u is None or (dims == c.rule.results[0] and u.sharding.dims == r.sharding.dims)
      for u, dims in zip(c.operands, c.rule.operands))


class _Pass:
  """One run of :func:`lay_out_for_readers` over a graph, with its caches."""

  def __init__(self, graph: Graph, touching: dict[int, list[int]]):
    self.graph, self.touching, self.mesh = graph, touching, graph.mesh_sizes
    # the top scope, loops' and branches' bodies, and the calls run inline in
    # any of them (jnp.where's jit, jax.nn.relu's custom_jvp_call); a body's
    # inputs and outputs stay as they are, as the program's do
    linked = {t.scope for b in graph.bounds if _link(b)
              for t in b.operands + b.results if t is not None}
    self.scopes, self.ends = set(), set()
    self._scopes(graph.top, (), linked)
    self.moves: dict = {}      # _moved's answer per op, rule and layouts
    self.rules: dict = {}      # id(bound) -> its planned factor rule, or None
    self.index = {id(b): k for k, b in enumerate(graph.bounds)}
    # (id(bound), earlier) -> its plan with the layouts as they are (until a
    # chain is kept: then every plan may read other layouts or copies)
    self.current: dict = {}
    # (id(candidate), layout, direction) of chains priced not cheaper with
    # the layouts as they are (until a chain is kept): the region phase and
    # a later sweep do not price them again
    self.failed: set = set()

  def _scopes(self, jaxpr, scope, linked) -> None:
    """Add ``scope`` (its jaxpr ``jaxpr``) and the scopes nested in it that
    the pass lays out; a loop's or branch's body (not a call run inline) with
    its inputs and outputs as ends."""
    self.scopes.add(scope)
    if scope == () or scope not in linked:
      self.ends.update(id(t) for v in list(jaxpr.constvars) + list(jaxpr.invars)
                       + list(jaxpr.outvars) if (t := self.graph.tensor(scope, v)) is not None)
    for idx, eqn in enumerate(jaxpr.eqns):
      name = eqn.primitive.name
      if name not in _BODIES and name not in _CALLS:
        continue
      for path, inner in sub_jaxprs(eqn.params):
        sub = scope + ((idx, path),)
        if name in _BODIES or sub in linked:
          self._scopes(inner, sub, linked)

  def run(self) -> None:
    # chains one way first; then regions, on the layouts those left (a region
    # kept first can leave a later reader's chain no longer cheaper); then
    # chains again on what the regions left
    self._sweeps(False)
    if self._sweeps(True):
      self._sweeps(False)

  def _sweeps(self, regions: bool) -> bool:
    """Sweeps over the readers, last first, while one kept a chain (at most
    ``ROUNDS``); ``regions``: each candidate's region (:meth:`chain` both
    ways) where its chain alone sends no fewer bytes. Whether any was kept."""
    kept = False
    for _ in range(ROUNDS):
      changed = False
      for k in range(len(self.graph.bounds) - 1, -1, -1):
        c = self.graph.bounds[k]
        if (c.scope not in self.scopes or _agrees(c)
            or not any(map(self.free, list(c.operands) + list(c.results)))):
          continue
        for u, want, forward in ([(u, w, False) for u, w in self.moved(c)]
                                 + [(u, w, True) for u, w in self.pushed(c) + self.made(c)]):
          if not self.free(u) or (_shards(want, self.mesh) < _shards(u.sharding, self.mesh)
                                  and not self.aligns(c, u, want)):
            continue
          chain = self.chain(u, want, forward)
          if not chain:
            continue
          if regions:
            if self.cheaper(chain, (id(u), want, forward)):
              continue              # (one way, a later sweep of chains keeps it)
            wide = self.chain(u, want, None)
            if len(wide) <= len(chain) or not self.cheaper(wide, (id(u), want, None)):
              continue
            chain = wide
          elif not self.cheaper(chain, (id(u), want, forward)):
            continue
          for t, layout in chain.values():
            t.sharding = layout
          self.current.clear()
          self.failed.clear()
          changed = kept = True
      if not changed:
        break
    return kept

  def aligns(self, c, u: Tensor, want: TensorSharding) -> bool:
    """Whether ``c`` reads, beside ``u``, a value of its shape that stays as
    it is (a program input or output, pinned) laid out as ``want``: a weight
    gradient moved to its weight's layout for the update."""
    return any(v is not None and v is not u and not self.free(v) and v.shape == u.shape
               and v.sharding.without_partial() == want for v in c.operands)

  def free(self, t: Tensor | None) -> bool:
    """Whether ``t`` may be laid out anew: made in the top program or a call
    run inline, unpinned, no program input or output, no sum pending."""
    return (t is not None and t.scope in self.scopes and not t.fixed
            and id(t) not in self.ends and not t.sharding.partial)

  def moved(self, c) -> list[tuple[Tensor, TensorSharding]]:
    """The operands the partitioner's plan for ``c`` moves (not a free
    slice), each with the layout the plan reads it in (memoised per op, rule
    and layouts: a model's repeated layers are planned once)."""
    g = self.graph
    try:
      key = (c.eqn.primitive, c.rule, tuple(map(factors.view, c.operands)),
             tuple(map(factors.view, c.results)), c.marks,
             tuple(t in g.zeros for t in c.operands if t is not None),
             tuple(g.released.get(t, 0.0) for t in c.results if t is not None))
      found = self.moves.get(key)
    except TypeError:          # a dtype jax cannot hash
      key, found = None, None
    if found is None:
      found, proposed = [], {}     # (operand index, layout); id(operand) -> layout
      # the plan with the copies earlier readers leave, then the plan without
      # them for an operand the first does not move (a copy the plan reads
      # can make a gather look cheapest at this op, where the operand laid
      # out anew sends less in all: cheaper() prices that); an operand is
      # proposed in one layout
      for planned in (self.plan(c, {}), self.plan(c, {}, earlier=False)):
        for n, (u, s, v) in enumerate(zip(c.operands, planned[0].operands if planned else (),
                                           planned[1] if planned else ())):
          if u is None or s is None or plan.copied(v, s, self.mesh):
            continue
          want, cur = s.without_partial(), u.sharding.without_partial()
          if want == cur or is_refinement(cur, want) or proposed.get(id(u), want) != want:
            continue
          if (n, want) not in found:
            found.append((n, want))
            proposed[id(u)] = want
      if key is not None:
        self.moves[key] = found
    return [(c.operands[n], want) for n, want in found]

  def pushed(self, c) -> list[tuple[Tensor, TensorSharding]]:
    """A call's link that moves its value (the call's inner operand laid out
    otherwise than the value it is passed): the inner side in the outer
    side's layout (:meth:`chain` then carries it on to what the call makes
    of it)."""
    if not _link(c) or len(c.operands) != 1 or len(c.results) != 1:
      return []
    (src,), (dst,) = c.operands, c.results
    if src is None or dst is None or src.sharding.partial:
      return []
    a, z = src.sharding.without_partial(), dst.sharding.without_partial()
    return [(dst, a)] if _moves(a, z) else []

  def made(self, c) -> list[tuple[Tensor, TensorSharding]]:
    """The results the partitioner's plan for ``c`` makes in another layout
    and then moves: each in the layout it is made in (:meth:`chain` carries
    it on to the values made of it)."""
    if _link(c) or not any(map(self.free, c.results)):
      return []
    planned = self.plan(c, {})
    if planned is None:
      return []
    out = []
    for r, s in zip(c.results, planned[0].results):
      if r is None or s is None or s.partial or r.sharding.partial:
        continue
      if _moves(r.sharding.without_partial(), s):
        out.append((r, s))
    return out

  def chain(self, u: Tensor, want: TensorSharding, forward: bool | None = False) -> dict:
    """id -> (tensor, layout): ``u`` in ``want`` and the values it is made of
    (``forward``: the values made of it; None: both, and theirs both ways,
    its region) through ops passing a layout through (their other readers
    are priced with them); empty past ``MAX_CHAIN`` values."""
    g = self.graph
    if forward is None:
      def step(b, t, layout):
        yield from self._made_of(b, t, layout)
        yield from self._made_from(b, t, layout)
    else:
      step = self._made_from if forward else self._made_of
    chain, stack = {id(u): (u, want)}, [u]
    while stack:
      t = stack.pop()
      layout = chain[id(t)][1]
      for k in self.touching.get(id(t), ()):
        b = g.bounds[k]
        if b.scope not in self.scopes:
          continue
        for v, dims in step(b, t, layout):
          if self.free(v) and id(v) not in chain:
            chain[id(v)] = (v, TensorSharding(tuple(dims)))
            stack.append(v)
            if len(chain) > MAX_CHAIN:
              return {}        # priced op by op, a longer chain costs more than it saves
    return chain

  def _made_of(self, b, t: Tensor, layout: TensorSharding):
    """Where ``b`` makes ``t`` laid out as ``layout``: each operand that
    passes its layout to ``t``, with the dims it then has."""
    if not any(r is t for r in b.results):
      return
    choice = factors.project(b.rule.results[0], layout.dims, b.rule.size_of, self.mesh)
    for n, v in enumerate(b.operands):
      if v is not None and passes(b.rule, n):
        yield v, factors.unproject(b.rule.operands[n], choice, b.rule.size_of, self.mesh)

  def _made_from(self, b, t: Tensor, layout: TensorSharding):
    """Where ``b`` reads ``t`` laid out as ``layout`` and passes its layout
    on: ``b``'s result, with the dims it then has."""
    n = next((n for n, v in enumerate(b.operands) if v is t), None)
    if n is None or any(r is t for r in b.results) or not passes(b.rule, n):
      return
    choice = factors.project(b.rule.operands[n], layout.dims, b.rule.size_of, self.mesh)
    yield b.results[0], factors.unproject(b.rule.results[0], choice, b.rule.size_of,
                                          self.mesh)

  def cheaper(self, chain: dict, key=None) -> bool:
    """Whether every op making or reading ``chain``'s values sends strictly
    fewer bytes, as the partitioner plans them, with those values laid out
    as ``chain`` says than as propagated (False where an op is not planned
    from its one factor rule); ``key`` names the chain where its answer is
    remembered (a chain found not cheaper is not priced again until one is
    kept)."""
    if key in self.failed:
      return False
    if (not all(layout.fits(t.shape, self.mesh) for t, layout in chain.values())
        or not self._cheaper(chain)):
      if key is not None:
        self.failed.add(key)
      return False
    return True

  def _cheaper(self, chain: dict) -> bool:
    g = self.graph
    near = {k for t, _ in chain.values() for k in self.touching.get(id(t), ())}
    # and the later readers of what those ops read: a copy an op moved an
    # operand to is reused by them (or, no longer moved, not there for them)
    later = {j for k in near for u in g.bounds[k].operands if u is not None
             for j in self.touching.get(id(u), ()) if j > k
             and any(v is u for v in g.bounds[j].operands)}
    ops = [g.bounds[k] for k in sorted(near | later)]
    old = self.bytes(ops, {})
    return old is not None and self.bytes(
        ops, {id(t): layout for t, layout in chain.values()}) < old

  def bytes(self, ops, layouts: dict) -> float | None:
    """Bytes per device of ``ops`` as the partitioner plans them, with the
    tensors of ``layouts`` in theirs: each operand's move to a layout counted
    once (the partitioner reuses a reshard for every op reading that
    layout); a call's link, which its value passes as it is, counted as the
    move from the one side's layout to the other's (what the ops on the far
    side then move, at most). None where an op is not planned from its
    factor rule."""
    mesh = self.mesh
    moves: dict[tuple, float] = {}
    total = 0.0
    for b in ops:
      if _link(b):
        (src,), (dst,) = b.operands, b.results
        if src is not None and dst is not None:
          a, z = (layouts.get(id(t), t.sharding).without_partial() for t in (src, dst))
          if _moves(a, z):
            moves[(id(src), z)] = reshard.plan_reshard(
                a, z, tuple(dst.shape), dst.dtype, mesh).bytes_per_device
        continue
      rows = relayout.moved_bytes(b, lambda t: layouts.get(id(t), t.sharding), mesh)
      if rows is not None:      # the partitioner moves the rows (relayout.py)
        total += rows
        continue
      p = self.plan(b, layouts)
      if p is None:
        return None
      local, ins, outs = p
      for t, v, s in zip(b.operands, ins, local.operands):
        if s is not None and v.sharding != s:
          s = s.with_partial(s.partial & v.sharding.partial)
          if not plan.copied(v, s, mesh):      # (a copy: its maker's move is priced)
            moves[(id(t), s)] = reshard.plan_reshard(v.sharding, s, v.shape, v.dtype,
                                                     mesh).bytes_per_device
      total += plan.plan_cost(mesh, (), outs, local)     # its results' moves
    return total + sum(moves.values())

  def held(self, b, layouts: dict) -> tuple:
    """Per operand of ``b``, the layouts the plans of its readers before
    ``b`` (in program order, in ``b``'s scope) move it to: the copies the
    partitioner holds when it reaches ``b`` and reuses (a forward pass's
    gathered activation, read again by a weight gradient's dot). Those
    readers are planned without the copies before them (one level)."""
    k, out = self.index[id(b)], []
    for t in b.operands:
      got = set()
      if t is not None and t.shape and not layouts.get(id(t), t.sharding).partial:
        for j in self.touching.get(id(t), ()):
          r = self.graph.bounds[j]
          if j >= k or r.scope != b.scope or _link(r) or all(u is not t for u in r.operands):
            continue
          p = self.plan(r, layouts, earlier=False)
          if p is None:
            continue
          for u, s, v in zip(r.operands, p[0].operands, p[1]):
            if u is t and s is not None and not s.partial and s != v.sharding:
              got.add(s)
      out.append(frozenset(got))
    return tuple(out)

  def plan(self, b, layouts: dict, earlier: bool = True):
    """The partitioner's local plan for ``b``'s op (``plan.plan_of``:
    memoised, so the partitioner reuses it), with the tensors of ``layouts``
    in theirs and (``earlier``) the copies earlier readers leave of its
    operands (``held``), and what it reads; None for an op not planned from its one
    factor rule (a call, an op of several constraints)."""
    if not layouts:
      key = (id(b), earlier)
      if key not in self.current:
        self.current[key] = self._plan(b, layouts, earlier)
      return self.current[key]
    return self._plan(b, layouts, earlier)

  def _plan(self, b, layouts: dict, earlier: bool):
    rule = self.rules.get(id(b), False)
    if rule is False:
      try:
        rule = plan.factor_rule_of(b.eqn)
      except TypeError:
        rule = None
      if rule is not None and rule is not b.rule and rule != b.rule:
        rule = None
      self.rules[id(b)] = rule
    if rule is None:
      return None

    def seen(t):
      if t is None or id(t) not in layouts:
        return factors.view(t)
      return factors.view_as(t, layouts[id(t)], t.fixed)
    g = self.graph
    marks = ([g.mark_of(b.scope, v) for v in b.eqn.invars]
             if rule.linear in linearity.READS_LITERALS else [None] * len(b.operands))
    released = [0.0 if t is None else g.released.get(t, 0.0) for t in b.results]
    return plan.plan_of(rule, b.eqn, [seen(t) for t in b.operands],
                        [seen(t) for t in b.results], marks, released, self.mesh,
                        self.held(b, layouts) if earlier else None)
