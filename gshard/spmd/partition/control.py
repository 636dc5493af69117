"""Partition rules for calls, loops and branches: the per-device program keeps them.

A nested ``jit``/``custom_jvp_call``/``custom_vjp_call`` is interpreted inline;
``checkpoint`` is re-wrapped in ``jax.checkpoint`` around its partitioned body.

``scan`` stays one ``lax.scan`` whose body is the partitioned body: carries
hold one sharding across iterations (the one propagation settled on for the
body's carry inputs), ``xs``/``ys`` are split like the body's per-step values
with the scanned dim unsplit. ``while`` and ``cond`` likewise. Collectives in
a loop body count once per iteration (``scan``'s length is known; a
``while``'s is not, and is reported per iteration).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import source_info_util
from jax.extend.core import Literal

from gshard.spmd.graph import sub_jaxprs
from gshard.spmd.partition.context import Context, Value
from gshard.spmd.partition.generic import fit, unkeyed
from gshard.spmd.reshard import allreduce_bytes
from gshard.spmd.sharding import TensorSharding, itemsize


def _stacked(s: TensorSharding) -> TensorSharding:
  """The sharding of ``T`` stacked values of sharding ``s``: ``[a,b] -> [_,a,b]``
  (pending over the axes they all are: ys)."""
  return TensorSharding(((),) + s.dims, s.partial)


def _unstacked(v: Value, s: TensorSharding, x) -> Value:
  return Value(x, s, v.shape[1:], v.dtype)


@contextlib.contextmanager
def _repeated(ctx: Context, n: int):
  old = ctx.repeat
  ctx.repeat = old * n
  try:
    yield
  finally:
    ctx.repeat = old


def _y_layout(ctx: Context, scope, sub, inner, outer) -> TensorSharding:
  """How a ys value is stacked: as the body made it, or, where
  ``stacked.stack_as_read`` laid the stacked result out as the loop reading
  it needs, in that layout (the body holds that copy already)."""
  if not hasattr(inner, "aval"):                   # a literal
    return TensorSharding.replicated(len(outer.aval.shape) - 1)
  made = ctx.target(sub, inner)
  t = ctx.graph.tensors.get((scope, outer))
  if t is None or t not in ctx.graph.restacked:
    return made
  return TensorSharding(t.sharding.dims[1:], made.partial)


def scan_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """``scan``: one ``lax.scan`` over the partitioned body; carries keep the body's
  propagated sharding; ``xs``/``ys`` are split like the per-step values."""
  p = eqn.params
  closed = p["jaxpr"]
  jaxpr = closed.jaxpr
  sub = scope + ((idx, ("jaxpr",)),)
  nc, nk = p["num_consts"], p["num_carry"]
  invars, outvars = jaxpr.invars, jaxpr.outvars
  consts = [ctx.reshard(ins[i], ctx.target(sub, invars[i]), eqn, f"operand {i}")
            for i in range(nc)]
  # a carry is pending only as an accumulator (rules.control.accumulators):
  # one psum after the loop instead of one per step
  carry_s = [ctx.target(sub, invars[nc + c]) for c in range(nk)]
  init = [fit(ctx, ins[nc + c], s, eqn, f"carry {c}") for c, s in enumerate(carry_s)]
  x_s = [ctx.target(sub, v).without_partial() for v in invars[nc + nk:]]
  xs = [ctx.reshard(v, _stacked(s), eqn, f"xs {k}")
        for k, (v, s) in enumerate(zip(ins[nc + nk:], x_s))]
  # ys may be pending: stacked, their sum is resolved once, after the loop
  y_s = [_y_layout(ctx, scope, sub, v, o) for v, o in zip(outvars[nk:], eqn.outvars[nk:])]

  def body(carry, x):
    args = consts + [Value(c, s, v.shape, v.dtype) for c, s, v in zip(carry, carry_s, init)]
    args += [_unstacked(v, s, xi) for v, s, xi in zip(xs, x_s, x)]
    outs = ctx.run_jaxpr(jaxpr, sub, closed.consts, args)
    new = [fit(ctx, o, s, eqn, f"carry {c}").x
           for c, (o, s) in enumerate(zip(outs[:nk], carry_s))]
    # a y is stacked as it comes: pending only where its value is (a lookup's
    # plan may give complete rows where propagation left a sum pending)
    ys = [ctx.reshard(o, s, eqn, f"ys {k}") for k, (o, s) in enumerate(zip(outs[nk:], y_s))]
    y_made[:] = [y.sharding for y in ys]
    return new, [y.x for y in ys]

  y_made: list[TensorSharding] = list(y_s)
  with _repeated(ctx, p["length"]):
    carry, ys = lax.scan(body, [v.x for v in init], [v.x for v in xs],
                         length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
  outs = [Value(c, s, v.shape, v.dtype) for c, s, v in zip(carry, carry_s, init)]
  outs += [Value(y, _stacked(s), tuple(o.aval.shape), o.aval.dtype)
           for y, s, o in zip(ys, y_made, eqn.outvars[nk:])]
  return outs


def while_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """``while``: one ``lax.while_loop`` over the partitioned cond and body; the
  predicate is replicated."""
  p = eqn.params
  cond, body = p["cond_jaxpr"], p["body_jaxpr"]
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  csub = scope + ((idx, ("cond_jaxpr",)),)
  bsub = scope + ((idx, ("body_jaxpr",)),)
  cconsts, bconsts, init = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
  # pending only as an accumulator the cond does not read (rules.control)
  carry_s = [ctx.target(bsub, v) for v in body.jaxpr.invars[bn:]]
  init = [fit(ctx, v, s, eqn, f"carry {c}") for c, (v, s) in enumerate(zip(init, carry_s))]

  def values(xs):
    return [Value(x, s, v.shape, v.dtype) for x, s, v in zip(xs, carry_s, init)]

  def predicate(xs) -> Value:
    (pred,) = ctx.run_jaxpr(cond.jaxpr, csub, cond.consts, list(cconsts) + values(xs))
    return pred

  # A batched predicate (vmap of a loop with per-lane trip counts), as jax
  # lowers it: the loop runs while any lane's is true, and a lane whose is
  # false keeps its carry (the predicate's dims lead every carry's).
  lanes = len(cond.out_avals[0].shape)

  def cond_fun(xs):
    pred = predicate(xs)
    whole = ctx.reshard(pred, TensorSharding.replicated(lanes), eqn, "predicate").x
    return jnp.any(whole) if lanes else whole

  def body_fun(xs):
    outs = ctx.run_jaxpr(body.jaxpr, bsub, body.consts, list(bconsts) + values(xs))
    new = [fit(ctx, o, s, eqn, f"carry {c} (per iteration)").x
           for c, (o, s) in enumerate(zip(outs, carry_s))]
    if not lanes:
      return new
    pred = predicate(xs)
    out = []
    for c, (y, x, s) in enumerate(zip(new, xs, carry_s)):
      p = ctx.reshard(pred, TensorSharding(s.dims[:lanes]), eqn, f"predicate (carry {c})").x
      out.append(jnp.where(lax.broadcast_in_dim(p, np.shape(y), tuple(range(lanes))), y, x))
    return out

  out = lax.while_loop(cond_fun, body_fun, [v.x for v in init])
  return values(out)


def cond_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """``cond``: one ``lax.switch`` over the partitioned branches; every branch
  returns its results in the propagated layout, pending over the axes
  propagation left the result pending (``fit``: a branch's zeros, or a
  value the branch made complete, kept on the first device of those axes)."""
  branches = eqn.params["branches"]
  index = ctx.reshard(ins[0], TensorSharding.replicated(0), eqn, "operand 0")
  ops = ins[1:]
  out_s = [ctx.target(scope, v) if hasattr(v, "aval") else
           TensorSharding.replicated(0) for v in eqn.outvars]

  def branch(k):
    br = branches[k]
    sub = scope + ((idx, ("branches", k)),)

    def f(*xs):
      args = [dataclasses.replace(v, x=x) for v, x in zip(ops, xs)]
      outs = ctx.run_jaxpr(br.jaxpr, sub, br.consts, args)
      return [fit(ctx, o, s, eqn, f"result {j}").x
              for j, (o, s) in enumerate(zip(outs, out_s))]
    return f

  outs = lax.switch(index.x, [branch(k) for k in range(len(branches))],
                    *[v.x for v in ops])
  return [Value(x, s, tuple(v.aval.shape), v.aval.dtype)
          for x, s, v in zip(outs, out_s, eqn.outvars)]


def call_rule(ctx: Context, eqn, ins, scope, idx, *, param: str) -> list[Value]:
  """A nested jit / custom_jvp / custom_vjp call: interpret its jaxpr inline."""
  inner = eqn.params[param]
  jaxpr = getattr(inner, "jaxpr", inner)
  consts = getattr(inner, "consts", ())
  # a nested jit's ops are named under jit(NAME), as jax lowers it
  named = (source_info_util.extend_name_stack(f"jit({eqn.params.get('name', 'jit')})")
           if eqn.primitive.name in ("jit", "pjit") else contextlib.nullcontext())
  with named:
    return ctx.run_jaxpr(jaxpr, scope + ((idx, (param,)),), consts, ins)


def solve_operands(const_lengths, n_operands: int) -> list[int]:
  """The operands of ``custom_linear_solve`` its ``solve`` jaxpr reads: that
  jaxpr's consts (after the matvec's and vecmat's), then ``b``."""
  first = const_lengths.matvec + const_lengths.vecmat
  return (list(range(first, first + const_lengths.solve))
          + list(range(sum(const_lengths), n_operands)))


def linear_solve_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """``custom_linear_solve``: its ``solve`` jaxpr interpreted inline on that
  jaxpr's consts and ``b``, as jax evaluates and lowers the primitive."""
  solve = eqn.params["jaxprs"].solve
  args = [ins[k] for k in solve_operands(eqn.params["const_lengths"], len(ins))]
  return ctx.run_jaxpr(solve.jaxpr, scope + ((idx, ("jaxprs", 2)),), solve.consts, args)


def checkpoint_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """``jax.checkpoint``: the per-device program keeps the rematerialisation.

  The recomputation jax's AD made (``differentiated=True``) reads its
  operands through an optimization barrier, as jax lowers it: without one
  XLA merged the recomputed forward back into the forward pass, and the
  residuals the checkpoint meant to drop were kept."""
  inner = eqn.params["jaxpr"]
  sub = scope + ((idx, ("jaxpr",)),)
  meta: list[Value] = []
  live = [i for i, v in enumerate(ins) if not v.literal]
  cse = eqn.params.get("prevent_cse", True)
  cse = cse if isinstance(cse, tuple) else (cse,) * len(ins)
  if eqn.params.get("differentiated") and any(cse[i] for i in live):
    fenced = [i for i in live if cse[i]]
    xs = lax.optimization_barrier([ins[i].x for i in fenced])
    ins = list(ins)
    for i, x in zip(fenced, xs):
      ins[i] = dataclasses.replace(ins[i], x=x)

  def body(*xs):
    args = list(ins)
    for i, x in zip(live, xs):
      args[i] = dataclasses.replace(ins[i], x=x)
    outs = ctx.run_jaxpr(inner, sub, (), args)
    meta[:] = outs
    return [o.x for o in outs]

  xs = jax.checkpoint(body, prevent_cse=eqn.params.get("prevent_cse", True),
                      policy=eqn.params.get("policy"))(*[ins[i].x for i in live])
  return [dataclasses.replace(m, x=x) for m, x in zip(meta, xs)]


def _run_manual(jaxpr, consts, args) -> list:
  """Evaluate a ``shard_map`` body inside gshard's own per-device program.

  The body was traced with jax's varying-axes types (``check_vma``); gshard's
  program runs without them, so their casts (``pvary``) are identities and
  ``psum_invariant`` is a plain ``psum``. Nested jits are entered.
  """
  env = {}

  def read(v):
    return v.val if isinstance(v, Literal) else env[v]

  for v, x in zip(jaxpr.constvars, consts):
    env[v] = x
  for v, x in zip(jaxpr.invars, args):
    env[v] = x
  for eqn in jaxpr.eqns:
    xs = [read(v) for v in eqn.invars]
    name = eqn.primitive.name
    if name in ("pvary", "pcast"):
      outs = xs
    elif name == "psum_invariant":
      outs = [lax.psum(x, eqn.params["axes"]) for x in xs]
    elif name in ("jit", "pjit"):
      inner = eqn.params["jaxpr"]
      outs = _run_manual(inner.jaxpr, inner.consts, xs)
    elif name in _LOOPS:
      outs = _LOOPS[name](eqn.params, xs)
    elif name in ("custom_jvp_call", "custom_vjp_call") and _loops_in(eqn.params):
      # its function, as jax evaluates it forward (the loops inside re-entered;
      # bound as it is, jax refused their carries' types); its own derivative
      # rule is not carried, so differentiating gshard's program through it
      # is an error, not another derivative
      outs = _underivable(_manual_fn(eqn.params["call_jaxpr"]), name)(*xs)
    else:   # as jax.core.eval_jaxpr binds (a custom_jvp's params become functions)
      outs = eqn.primitive.bind(*xs, **eqn.primitive.get_bind_params(unkeyed(eqn.params)))
      outs = outs if eqn.primitive.multiple_results else [outs]
    for v, o in zip(eqn.outvars, outs):
      env[v] = o
  return [read(v) for v in jaxpr.outvars]


def _underivable(fn, name: str):
  """``fn``, with an error where it is differentiated."""
  @jax.custom_jvp
  def f(*xs):
    return fn(*xs)

  @f.defjvp
  def f_jvp(primals, tangents):
    raise NotImplementedError(
        f"gshard: a {name} with a loop inside a jax.shard_map body runs in gshard's "
        "program without its derivative rule, so the partitioned function cannot be "
        "differentiated through it. Differentiate inside instead: "
        "gshard.partition(jax.grad(f), mesh, ...).")
  return f


def _loops_in(params) -> bool:
  """Whether the inner jaxprs of ``params`` run a scan, while or cond."""
  return any(e.primitive.name in _LOOPS or _loops_in(e.params)
             for _, j in sub_jaxprs(params) for e in j.eqns)


def _manual_fn(closed):
  """A closed jaxpr of a shard_map body as a function run by :func:`_run_manual`."""
  return lambda *xs: _run_manual(closed.jaxpr, closed.consts, list(xs))


def _manual_scan(p, xs):
  """A scan of a shard_map body, re-entered: its jaxpr's carries are typed with
  the varying axes, which gshard's values do not carry (binding it as it is,
  jax refused the carry's type)."""
  consts, init, seq = (xs[:p["num_consts"]], xs[p["num_consts"]:][:p["num_carry"]],
                       xs[p["num_consts"] + p["num_carry"]:])
  body = _manual_fn(p["jaxpr"])

  def step(carry, x):
    out = body(*consts, *carry, *x)
    return out[:p["num_carry"]], out[p["num_carry"]:]

  carry, ys = lax.scan(step, init, seq, length=p["length"], reverse=p["reverse"],
                       unroll=p["unroll"])
  return list(carry) + list(ys)


def _manual_while(p, xs):
  cc, bc = p["cond_nconsts"], p["body_nconsts"]
  cond, body = _manual_fn(p["cond_jaxpr"]), _manual_fn(p["body_jaxpr"])
  return list(lax.while_loop(lambda c: cond(*xs[:cc], *c)[0],
                             lambda c: body(*xs[cc:cc + bc], *c), xs[cc + bc:]))


def _manual_cond(p, xs):
  branches = [_manual_fn(b) for b in p["branches"]]
  return list(lax.switch(xs[0], [lambda *a, b=b: b(*a) for b in branches], *xs[1:]))


_LOOPS = {"scan": _manual_scan, "while": _manual_while, "cond": _manual_cond}


def shard_map_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """``jax.shard_map`` over the partition mesh: its operands are brought to its
  ``in_specs``; its body, written for per-device blocks with collectives over
  the mesh axes, runs as written (gshard's program is itself per device)."""
  del scope, idx
  p = eqn.params
  manual = p.get("newly_manual_axes") or frozenset(p["mesh"].axis_names)
  if set(manual) != set(ctx.mesh_sizes):
    raise ValueError(
        f"jax.shard_map at {ctx.source(eqn)}: it is manual over {sorted(manual)} only; "
        f"gshard runs a shard_map inside its program when it is manual over every "
        f"axis of the mesh {sorted(ctx.mesh_sizes)}. Make it manual over all axes, or "
        "replace it with gshard annotations.")
  vals = [ctx.reshard(v, TensorSharding.from_spec(s, len(v.shape)), eqn, f"operand {i}")
          for i, (v, s) in enumerate(zip(ins, p["in_specs"]))]
  outs = _run_manual(p["jaxpr"], (), [v.x for v in vals])
  _record_manual(ctx, p["jaxpr"])
  return [Value(x, TensorSharding.from_spec(s, len(v.aval.shape)), tuple(v.aval.shape),
                v.aval.dtype) for x, s, v in zip(outs, p["out_specs"], eqn.outvars)]


# a shard_map body's collectives: bytes sent per device, of the local operand's
# bytes S over n devices (the ring formulas of spmd/reshard.py)
_MANUAL = {"psum": ("psum", allreduce_bytes),
           "psum_invariant": ("psum", allreduce_bytes),
           "pmax": ("pmax", allreduce_bytes),
           "pmin": ("pmin", allreduce_bytes),
           "all_gather": ("all_gather", lambda S, n: (n - 1) * S),
           "all_to_all": ("all_to_all", lambda S, n: (n - 1) * S / n),
           "reduce_scatter": ("psum_scatter", lambda S, n: (n - 1) * S / n),
           "ppermute": ("ppermute", lambda S, n: S)}


def _record_manual(ctx: Context, jaxpr) -> None:
  """Report the collectives a ``shard_map`` body runs itself, as gshard counts
  its own: per device, a scan's ``length`` times, each branch of a cond, a
  while body once. Their values are per-device blocks (shapes local)."""
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in _MANUAL:
      names = eqn.params.get("axes", eqn.params.get("axis_name", ()))
      names = names if isinstance(names, (tuple, list)) else (names,)
      axes = tuple(a for a in names if a in ctx.mesh_sizes)
      n = ctx.num_shards(axes)
      if n == 1 or (name == "ppermute" and not eqn.params.get("perm")):
        continue
      kind, cost = _MANUAL[name]
      for v in eqn.invars:
        shape = tuple(v.aval.shape)
        whole = TensorSharding.replicated(len(shape))
        src = whole.with_partial(frozenset(axes)) if kind == "psum" else whole
        nbytes = cost(math.prod(shape) * itemsize(v.aval.dtype), n)
        ctx.record(kind, axes, int(nbytes), eqn, "inside jax.shard_map", src,
                   whole, shape, v.aval.dtype)
    for path, inner in sub_jaxprs(eqn.params):
      with _repeated(ctx, eqn.params["length"] if name == "scan" else 1):
        _record_manual(ctx, inner)


def _live_custom_lins(jaxpr, live_out=None) -> set[int]:
  """Ids of the ``custom_lin`` equations whose results reach ``jaxpr``'s
  outputs (``live_out``: which of them are read; all by default). A call's
  unread results are dead inside it too; other inner jaxprs count whole."""
  live = {v for v, on in zip(jaxpr.outvars, live_out or [True] * len(jaxpr.outvars))
          if on and not isinstance(v, Literal)}
  found: set[int] = set()
  for eqn in reversed(jaxpr.eqns):
    outs = [v in live for v in eqn.outvars]
    if not any(outs) and not eqn.effects:
      continue
    if eqn.primitive.name == "custom_lin":
      found.add(id(eqn))
    live.update(v for v in eqn.invars if not isinstance(v, Literal))
    for path, inner in sub_jaxprs(eqn.params):
      call = path == ("jaxpr",) and len(inner.outvars) == len(eqn.outvars)
      found |= _live_custom_lins(inner, outs if call else None)
  return found


def custom_lin_rule(ctx: Context, eqn, ins, scope, idx) -> list[Value]:
  """``jax.jvp`` of a ``jax.custom_vjp`` function stages its tangent as a
  ``custom_lin`` equation that only a transpose removes: nothing lowers it
  (jax raises at compile time). Where its tangent is read, gshard's error at
  the user's line, or the one the function's library attached
  (``bwd.gshard_jvp_error``); where nothing reads it (jax.jit drops it), zeros
  that nothing reads."""
  del ins, scope, idx
  if id(eqn) not in _live_custom_lins(ctx.graph.top):
    return [Value(jnp.zeros(v.aval.shape, v.aval.dtype),
                  TensorSharding.replicated(len(v.aval.shape)), tuple(v.aval.shape),
                  v.aval.dtype) for v in eqn.outvars]
  bwd = getattr(eqn.params.get("bwd"), "f", None)
  message = getattr(bwd, "gshard_jvp_error", None)
  raise TypeError(message or (
      f"forward-mode differentiation (jax.jvp, jacfwd, jax.hessian) reached a "
      f"jax.custom_vjp function at {ctx.source(eqn)}: a custom_vjp has a reverse-mode "
      "rule only (jax: can't apply forward-mode autodiff (jvp) to a custom_vjp function). "
      "Use reverse mode (jax.grad, jax.vjp, jax.jacrev), or define the function's "
      "derivative with jax.custom_jvp."))
