"""``make demo``: gshard's propagation report for a GPT-style Transformer train step.

The train step (forward, backward and an optax Adam update) is plain JAX with a
few annotations (see ``examples/models.py``). On a 2x4 mesh of simulated CPU
devices, ``gshard.infer_shardings`` gives every variable of its jaxpr a
sharding; this script prints a summary, the parameter / gradient / update
shardings, and a few key lines of the annotated jaxpr.

Run from the repository root::

  make demo                        # or: .venv/bin/python examples/demo.py
"""

from __future__ import annotations

import os
import re
import sys

_DEVICES = 8


def _use_simulated_devices(n: int = _DEVICES) -> None:
  """Ask XLA for ``n`` host devices; must run before jax is imported."""
  flag = f"--xla_force_host_platform_device_count={n}"
  kept = re.sub(r"--xla_force_host_platform_device_count=\S*", "",
                os.environ.get("XLA_FLAGS", "")).split()
  os.environ["XLA_FLAGS"] = " ".join([*kept, flag])
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


_use_simulated_devices()
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:        # `python examples/demo.py` puts examples/ first
  sys.path.insert(0, _ROOT)

import time  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import gshard  # noqa: E402
from examples.models import gpt_init, gpt_loss, gpt_specs  # noqa: E402

MESH_SHAPE, MESH_AXES = (2, 4), ("data", "model")
CONFIG = dict(vocab=128, d_model=64, n_heads=4, n_layers=2, d_ff=256)
BATCH, SEQ = 8, 16


# -- the program ---------------------------------------------------------------

def make_train_step(optimizer):
  """``step(params, opt_state, tokens, targets) -> (params, opt_state, loss)``.

  The loss and gradients are one nested ``jit`` named ``loss_and_grads`` so that
  the report can find the gradients by name in the jaxpr.
  """
  @jax.jit
  def loss_and_grads(params, tokens, targets):
    return jax.value_and_grad(gpt_loss)(params, tokens, targets)

  def step(params, opt_state, tokens, targets):
    loss, grads = loss_and_grads(params, tokens, targets)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def make_problem(seed: int = 0):
  """Mesh, initial state, a synthetic batch, the step and its ``in_specs``."""
  mesh = gshard.make_mesh(MESH_SHAPE, MESH_AXES)
  k_params, k_tokens = jax.random.split(jax.random.key(seed))
  params = gpt_init(k_params, **CONFIG)
  optimizer = optax.adam(1e-3)
  opt_state = optimizer.init(params)
  tokens = jax.random.randint(k_tokens, (BATCH, SEQ + 1), 0, CONFIG["vocab"])
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  # Parameters as gpt_specs says; optimizer state left to propagation (None).
  in_specs = (gpt_specs(params), None, P("data"), P("data"))
  return mesh, make_train_step(optimizer), (params, opt_state, inputs, targets), in_specs


# -- the report ------------------------------------------------------------------

def _fmt(sharding, aval) -> str:
  return sharding.format(aval.shape, aval.dtype)


def _grad_call(res):
  """(index, eqn) of the ``loss_and_grads`` call in the top-level jaxpr."""
  for i, eqn in enumerate(res.jaxpr.jaxpr.eqns):
    if eqn.primitive.name in ("jit", "pjit") and eqn.params.get("name") == "loss_and_grads":
      return i, eqn
  raise LookupError("no `loss_and_grads` call in the jaxpr")


def parameter_rows(res, params) -> list[tuple[str, str, str, str]]:
  """(name, param sharding, gradient where produced, updated param) per leaf.

  The gradient column is the ``loss_and_grads`` output as produced inside the
  call, so a pending partial sum (``+data``: the data-parallel reduction) shows.
  Layers whose rows are all equal are folded into one ``layers[*]`` row.
  """
  top = res.jaxpr.jaxpr
  idx, eqn = _grad_call(res)
  inner = eqn.params["jaxpr"].jaxpr
  scope = ((idx, ("jaxpr",)),)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
  rows = []
  for k, path in enumerate(paths):
    p_in, g_in, p_out = top.invars[k], inner.outvars[1 + k], top.outvars[k]
    rows.append((path,
                 _fmt(res.sharding(p_in), p_in.aval),
                 _fmt(res.sharding(g_in, scope), g_in.aval),
                 _fmt(res.sharding(p_out), p_out.aval)))
  return _fold_layers(rows)


def _short_path(keystr: str) -> str:
  """``"['layers'][0]['wq']"`` -> ``"layers[0].wq"``."""
  return re.sub(r"\['(\w+)'\]", r".\1", keystr).lstrip(".")


def _fold_layers(rows):
  groups: dict[str, list] = {}
  for path, *cols in rows:
    name = _short_path(path)
    groups.setdefault(re.sub(r"^layers\[\d+\]", "layers[*]", name), []).append(
        (name, tuple(cols)))
  out = []
  for folded, items in groups.items():
    if len({cols for _, cols in items}) == 1:
      out.append((folded, *items[0][1]))
    else:
      out += [(name, *cols) for name, cols in items]
  return out


def optimizer_state_summary(res, params, opt_state) -> str:
  """How many optimizer-state leaves (in_specs None) got their parameter's sharding."""
  top = res.jaxpr.jaxpr
  n = len(jax.tree_util.tree_leaves(params))
  param_of = {jax.tree_util.keystr(p): res.sharding(v) for (p, _), v in
              zip(jax.tree_util.tree_leaves_with_path(params), top.invars[:n])}
  state = jax.tree_util.tree_leaves_with_path(opt_state)
  matched = total = 0
  for (path, _), var in zip(state, top.invars[n:n + len(state)]):
    key = jax.tree_util.keystr(path)
    owner = next((s for p, s in param_of.items() if key.endswith(p)), None)
    if owner is not None:
      total += 1
      matched += res.sharding(var).dims == owner.dims
  return (f"Adam moments (in_specs None): {matched}/{total} leaves got their "
          "parameter's sharding")


_LINE = re.compile(r"^(\s*)(.*?) = (\S+?)(\[.*\])? ([^\[\]]*?)(?:\s+#\s*(.*))?$")
_FORWARD = {"dot_general", "gather"}
_BACKWARD = {"dot_general", "gather", "scatter-add"}


def key_lines(res, limit: int = 40) -> list[str]:
  """Key equations of ``res.pretty()``: dots, gathers/scatters and partial sums.

  Forward: dots, gathers and the loss. Backward (after the loss): dots,
  scatters and sums of pending partial sums. One line per (primitive, place,
  result type), so the other layer's copies are dropped. Equations inside a
  nested call of jnp (``take_along_axis``) are placed by the call's name.
  """
  out, seen, backward = [], set(), False
  calls: list[tuple[int, str]] = []       # (indent, name) of enclosing calls
  for line in res.pretty().splitlines():
    m = _LINE.match(line)
    if not m:
      continue
    indent, outs, prim, params, args, src = m.groups()
    while calls and calls[-1][0] >= len(indent):
      calls.pop()
    if prim in ("jit", "pjit"):
      name = re.search(r"name=(\w+)", params or "")
      calls.append((len(indent), name.group(1) if name else prim))
      continue
    src_m = re.search(r"([\w.]+\.py):(\d+)(?::\d+)? \((\w+)", src or "")
    if src_m and src_m.group(1) == "models.py":
      where = f"{src_m.group(1)}:{src_m.group(2)} {src_m.group(3)}"
    elif calls and calls[-1][1] != "loss_and_grads":
      where = f"inside jnp's {calls[-1][1]}"
    else:
      continue
    is_loss = prim == "reduce_sum" and where.endswith("gpt_loss")
    if is_loss and not backward:
      keep = True
    elif not backward:
      keep = prim in _FORWARD
    else:
      keep = prim in _BACKWARD or (prim == "add_any" and "+" in outs)
    key = (prim, where, outs.split(":", 1)[-1])
    if not keep or key in seen:
      continue
    seen.add(key)
    out.append(f"  {outs:<28} = {prim:<11} {args:<8} # {where}")
    if is_loss and not backward:
      backward = True
      out.append("  -- backward --")
  return out[:limit]


def report(res, params, opt_state, seconds: float) -> str:
  mesh = ", ".join(f"{k}={v}" for k, v in res.mesh_sizes.items())
  unsupported = sorted({p for p, _ in res.unsupported}) or ["none"]
  model = ", ".join(f"{k} {v}" for k, v in CONFIG.items())
  lines = [
      "gshard propagation report: GPT-style Transformer train step (grad + Adam)",
      f"mesh ({mesh}) over {jax.device_count()} simulated {jax.default_backend()} "
      f"devices; batch {BATCH}x{SEQ}",
      f"model: {model}",
      "",
      f"variables with a sharding : {len(res.graph.tensors)} (nested jaxprs included)",
      f"sweeps to the fixed point : {res.sweeps}",
      f"conflicts settled         : {len(res.conflicts)}",
      f"primitives without a rule : {', '.join(unsupported)}",
      f"trace + propagate         : {seconds:.1f} s",
      "",
      "Notation: 128@model = a dim of 128 split over mesh axis 'model' (a*b: over",
      "both); +data = each device holds a partial sum over 'data', still to be",
      "reduced. Where a summed dim is split and the result shows no +, the sum is",
      "reduced right where it is produced (the embedding gather, the wo and w2 dots).",
      "",
      f"{'parameter':<15} {'sharding':<19} {'gradient (produced)':<24} updated",
  ]
  for name, p, g, u in parameter_rows(res, params):
    lines.append(f"{name:<15} {p:<19} {g:<24} {u}")
  lines += ["", optimizer_state_summary(res, params, opt_state)]
  for c in res.conflicts[:5]:
    lines.append(f"conflict: {c}")
  lines += ["", "Key equations, one layer's copy (print(result) shows the whole jaxpr):",
            "  -- forward --"]
  lines += key_lines(res)
  return "\n".join(lines)


def propagation_report() -> None:
  mesh, step, args, in_specs = make_problem()
  start = time.perf_counter()
  res = gshard.infer_shardings(step, mesh, in_specs=in_specs)(*args)
  seconds = time.perf_counter() - start
  print(report(res, args[0], args[1], seconds))


def main() -> None:
  """Train on a 2x4 mesh, then print the partition report.

  ``python examples/demo.py --propagation`` prints the propagation report of
  the same train step instead.
  """
  if "--propagation" in sys.argv:
    propagation_report()
    return
  from examples import train_gpt
  train_gpt.main()


if __name__ == "__main__":
  main()
