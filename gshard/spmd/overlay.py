"""A trial's writes kept apart from the state it reads through.

The partial-sum marking (``partials.py``) tries resolving one value at a time
and keeps the trial only if the program's psum bytes drop. A trial touches the
few bounds the change reaches; copying the whole marking for each trial made
the tries cost the program's size each, quadratic in all. An :class:`Overlay`
holds only what the trial wrote; reads fall through to the state under it.
:func:`land` applies an accepted trial to that state in place (the state
under it is then the accepted one; the rejected trials over it are dropped).
"""

from __future__ import annotations

_GONE = object()       # a key the trial removed


class Overlay:
  """A dict (or, with int keys, a list) seen with a trial's writes on top."""

  __slots__ = ("base", "new")

  def __init__(self, base):
    self.base = base
    self.new: dict = {}

  def get(self, k, default=None):
    new = self.new
    if k in new:
      v = new[k]
      return default if v is _GONE else v
    return self.base.get(k, default)

  def __getitem__(self, k):
    new = self.new
    if k in new:
      v = new[k]
      if v is _GONE:
        raise KeyError(k)
      return v
    return self.base[k]

  def __contains__(self, k) -> bool:
    new = self.new
    if k in new:
      return new[k] is not _GONE
    return k in self.base

  def __setitem__(self, k, v) -> None:
    self.new[k] = v

  def pop(self, k, default=None):
    v = self.get(k, _GONE)
    self.new[k] = _GONE
    return default if v is _GONE else v


def copy(x):
  """A new plain dict or list with ``x``'s content (``x`` unchanged)."""
  if not isinstance(x, Overlay):
    return list(x) if isinstance(x, list) else dict(x)
  out = copy(x.base)
  _apply(out, x.new)
  return out


def land(x):
  """The plain dict or list under ``x``, with every overlay's writes applied to
  it in place, lowest first."""
  if not isinstance(x, Overlay):
    return x
  out = land(x.base)
  _apply(out, x.new)
  x.new = {}
  return out


def _apply(out, new: dict) -> None:
  for k, v in new.items():
    if v is _GONE:
      out.pop(k, None)
    else:
      out[k] = v
