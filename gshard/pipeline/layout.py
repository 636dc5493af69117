"""Stacked layer parameters: ``stack``, ``unstack``, and the layout ``run`` expects.

``pipeline.run`` takes the parameters of L layers with the same structure as
one pytree whose leaves carry the layers in leading dims. The leading dims
are chosen so that the devices of pipeline stage ``s`` hold exactly stage
``s``'s layers when those dims are split over the stage axis, with no
reordering or gathering at the program boundary:

==========================  ===========================  =======================
``run`` arguments           leaves                        stage split (in_specs)
==========================  ===========================  =======================
default                     ``[L, ...]`` layer order      ``P(stage)``
``repeats=v``               ``[v, L/v, ...]``: row ``c``  ``P(None, stage)``
                            is the c-th pass round the
                            ring of stages
``balance=counts`` (K)      ``[K, max(counts), ...]``:    ``P(stage)``
                            stage ``s``'s layers first,
                            then zero padding
==========================  ===========================  =======================

With ``repeats=v`` and K stages, device ``s`` holds chunk ``c`` (virtual stage
``c*K + s``, layers ``(c*K + s)*L/(vK)`` onwards) at ``[c, s*L/(vK) ...]``:
splitting dim 1 over the stage axis gives each device its v chunks. The
layout does not depend on K, so the same stack runs on any mesh, and off
mesh.

Example::

  layers = [init_layer(k) for k in jax.random.split(key, 8)]
  stacked = pipeline.stack(layers)                       # leaves [8, ...]
  stacked = pipeline.stack(layers, repeats=2)            # leaves [2, 4, ...]
  stacked = pipeline.stack(layers, balance=[1, 3, 3, 1]) # leaves [4, 3, ...]
  layers == pipeline.unstack(stacked, balance=[1, 3, 3, 1])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Layout:
  """How ``run``'s stacked leaves hold the layers.

  Attributes:
    num_layers: L.
    repeats: v, passes round the ring of stages (chunks per device).
    balance: layers per stage (K entries) or None (even).
  """

  num_layers: int
  repeats: int = 1
  balance: tuple[int, ...] | None = None

  @property
  def lead(self) -> tuple[int, ...]:
    """The leading dims every stacked leaf has."""
    if self.balance is not None:
      return (len(self.balance), max(self.balance))
    if self.repeats > 1:
      return (self.repeats, self.num_layers // self.repeats)
    return (self.num_layers,)

  def describe(self) -> str:
    """``[2, 4, ...] (repeats=2: [repeats, L/repeats, ...])``."""
    dims = ", ".join(map(str, self.lead))
    if self.balance is not None:
      return f"[{dims}, ...] (balance={list(self.balance)}: [K, max(balance), ...])"
    if self.repeats > 1:
      return f"[{dims}, ...] (repeats={self.repeats}: [repeats, L/repeats, ...])"
    return f"[{dims}, ...] (one row per layer)"

  def spec_dim(self) -> int:
    """The leaf dim split over the stage axis (1 for ``[v, L/v, ...]``, else 0)."""
    return 1 if self.balance is None and self.repeats > 1 else 0


def check_counts(balance, what: str = "balance") -> tuple[int, ...]:
  """``balance`` as a tuple of ints >= 1, or a ValueError naming it."""
  if isinstance(balance, (str, bytes)) or not isinstance(balance, Sequence) or not balance:
    raise ValueError(f"{what} must be a non-empty list of layers per stage (ints >= 1), e.g. "
                     f"pipeline.balance(costs, num_stages=K); got {balance!r}.")
  out = []
  for i, c in enumerate(balance):
    if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 1:
      raise ValueError(f"{what}[{i}] must be an int >= 1 (every stage holds a layer), got "
                       f"{c!r} in {list(balance)!r}.")
    out.append(int(c))
  return tuple(out)


def _check_repeats(repeats) -> int:
  if isinstance(repeats, bool) or not isinstance(repeats, (int, np.integer)) or repeats < 1:
    raise ValueError(f"repeats must be an int >= 1, got {repeats!r}.")
  return int(repeats)


def stack(layer_params: Sequence, *, repeats: int = 1, balance=None):
  """Stack L per-layer pytrees into ``run``'s layout (module docstring).

  Args:
    layer_params: a list of L pytrees with the same structure, shapes and dtypes.
    repeats: v; the leaves become ``[v, L/v, ...]`` (L must be a multiple of v).
    balance: layers per stage (sums to L); the leaves become ``[K, max, ...]``,
      each stage's layers first, then zeros.

  Returns:
    One pytree of the layers' structure with stacked leaves.
  """
  repeats = _check_repeats(repeats)
  if isinstance(layer_params, (str, bytes)) or not isinstance(layer_params, Sequence) \
      or not layer_params:
    raise ValueError("stack: layer_params must be a non-empty list of per-layer pytrees, got "
                     f"{type(layer_params).__name__}.")
  num_layers = len(layer_params)
  tree = jax.tree.structure(layer_params[0])
  for i, p in enumerate(layer_params):
    if jax.tree.structure(p) != tree:
      raise ValueError(f"stack: layer {i} has tree structure {jax.tree.structure(p)}, but "
                       f"layer 0 has {tree}; every layer must have the same structure.")
  first = jax.tree.leaves(layer_params[0])
  for i, p in enumerate(layer_params):
    for j, (a, b) in enumerate(zip(first, jax.tree.leaves(p))):
      if np.shape(a) != np.shape(b) or jnp.result_type(a) != jnp.result_type(b):
        raise ValueError(f"stack: leaf {j} of layer {i} is {jnp.result_type(b)}"
                         f"{list(np.shape(b))}, but layer 0's is {jnp.result_type(a)}"
                         f"{list(np.shape(a))}; every layer must have the same shapes.")
  if balance is not None:
    if repeats != 1:
      raise ValueError("stack: give balance or repeats > 1, not both (run supports balance "
                       "with repeats=1).")
    counts = check_counts(balance)
    if sum(counts) != num_layers:
      raise ValueError(f"stack: balance={list(counts)} sums to {sum(counts)}, but there are "
                       f"{len(layer_params)} layers; the counts must add up to L.")
    width, offsets = max(counts), np.cumsum((0,) + counts)
    def padded(*leaves):
      rows = []
      for s, c in enumerate(counts):
        block = jnp.stack(leaves[offsets[s]:offsets[s] + c])
        rows.append(jnp.pad(block, [(0, width - c)] + [(0, 0)] * (block.ndim - 1)))
      return jnp.stack(rows)
    return jax.tree.map(padded, *layer_params)
  if num_layers % repeats:
    raise ValueError(f"stack: repeats={repeats} must divide the number of layers "
                     f"{num_layers}.")
  stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *layer_params)
  if repeats > 1:
    stacked = jax.tree.map(lambda a: a.reshape((repeats, num_layers // repeats) + a.shape[1:]),
                           stacked)
  return stacked


def layout_of(stacked, *, repeats: int = 1, balance=None, where: str = "stacked") -> Layout:
  """The :class:`Layout` of ``stacked`` given ``run``'s ``repeats`` and ``balance``;
  a ValueError naming the leaf, its shape and the fix if a leaf does not fit."""
  repeats = _check_repeats(repeats)
  counts = None if balance is None else check_counts(balance)
  if counts is not None and repeats != 1:
    raise ValueError(f"balance={list(counts)} with repeats={repeats}: run supports unequal "
                     "stages with repeats=1 only. Use repeats=1, or even chunks "
                     "(balance=None).")
  leaves, _ = jax.tree_util.tree_flatten_with_path(stacked)
  if not leaves:
    raise ValueError(f"{where} has no array leaves; pass the stacked layer parameters "
                     "(pipeline.stack(layer_params)).")
  paths = [jax.tree_util.keystr(p) or "(the array)" for p, _ in leaves]
  shapes = [tuple(np.shape(x)) for _, x in leaves]
  if counts is not None:
    layout = Layout(sum(counts), 1, counts)
  else:
    rank = 2 if repeats > 1 else 1
    short = [(p, s) for p, s in zip(paths, shapes) if len(s) < rank]
    if short:
      p, s = short[0]
      raise ValueError(f"{where} leaf {p} has shape {s}; with repeats={repeats} every leaf is "
                       f"[{'repeats, L/repeats' if repeats > 1 else 'L'}, ...]. Use "
                       f"pipeline.stack(layer_params, repeats={repeats}).")
    lead = shapes[0][:rank]
    if repeats > 1 and lead[0] != repeats:
      raise ValueError(
          f"{where} leaf {paths[0]} has shape {shapes[0]}; with repeats={repeats} every leaf "
          f"is [repeats, L/repeats, ...] = [{repeats}, L/{repeats}, ...]. Use "
          f"pipeline.stack(layer_params, repeats={repeats}), or reshape an [L, ...] stack with "
          f"x.reshape({repeats}, -1, *x.shape[1:]).")
    layout = Layout(lead[0] * (lead[1] if repeats > 1 else 1), repeats)
  for p, s in zip(paths, shapes):
    if s[:len(layout.lead)] != layout.lead:
      fix = (f"pipeline.stack(layer_params, balance={list(counts)})" if counts is not None
             else f"pipeline.stack(layer_params, repeats={repeats})")
      other = (f", but {where} leaf {paths[0]} has shape {shapes[0]}" if p != paths[0]
               else "")
      raise ValueError(f"{where} leaf {p} has shape {s}{other}: every leaf must start with "
                       f"{layout.describe()}. Use {fix}.")
  return layout


def layer_order(stacked, layout: Layout):
  """The leaves as ``[L, ...]`` in layer order (padding of a balanced stack dropped)."""
  if layout.balance is not None:
    def unpad(a):
      return jnp.concatenate([a[s, :c] for s, c in enumerate(layout.balance)], axis=0)
    return jax.tree.map(unpad, stacked)
  if layout.repeats > 1:
    return jax.tree.map(lambda a: a.reshape((layout.num_layers,) + a.shape[2:]), stacked)
  return stacked


def unstack(stacked, *, repeats: int = 1, balance=None) -> list:
  """The list of L per-layer pytrees of a stack (the inverse of :func:`stack`).

  ``repeats`` and ``balance`` must be the ones the stack was made with: the
  leaves' shapes tell a balance's number of stages and its largest count,
  not the counts themselves (``[1, 3, 3, 1]`` and ``[3, 1, 3, 1]`` both stack
  8 layers as ``[4, 3, ...]``), so a different balance of the same shape
  reads the padding rows as layers."""
  layout = layout_of(stacked, repeats=repeats, balance=balance)
  ordered = layer_order(stacked, layout)
  return [jax.tree.map(lambda a, i=i: a[i], ordered) for i in range(layout.num_layers)]
