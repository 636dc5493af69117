"""The user's source line of an equation: the innermost frame of the user's code.

jax's own traceback filtering (``source_info_util.summarize``) skips frames
inside jax and the Python standard library, so an equation that Flax's
``nn.Dense`` binds is reported at ``flax/linen/linear.py``, the same line for
every layer of a model. :func:`source_of` skips the frames of libraries as
well: a frame counts as a library's when its file is inside an installed
package (``site-packages`` / ``dist-packages``), the standard library, or one
of the packages in :data:`LIBRARIES` wherever it is installed (gshard itself
is often an editable checkout). It reports the innermost remaining frame, as
``file:line:column (function)``, and names the library frame the equation was
bound in after it::

  model.py:12:8 (MLP.__call__) via flax/linen/linear.py:287

When every frame is a library's (an equation of jax's own jitted functions,
say), it falls back to jax's filtering: the innermost frame outside jax and
gshard, or ``""``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sysconfig

from jax.extend import source_info_util

# packages whose frames are never the user's model code, wherever installed
LIBRARIES = ("jax", "jaxlib", "gshard", "flax", "optax", "orbax", "chex", "equinox",
             "haiku", "numpy", "ml_dtypes", "opt_einsum", "scipy")
# frames of these are skipped even as the "via" library frame (jax's own filtering)
_CORE = ("jax", "jaxlib", "gshard")


def _package_dirs(names) -> tuple[str, ...]:
  """Where the packages ``names`` are installed (found without importing them)."""
  out = []
  for name in names:
    try:
      spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
      continue
    for loc in (spec.submodule_search_locations or []) if spec else []:
      out.append(os.path.realpath(loc) + os.sep)
  return tuple(out)


_INSTALLED = ("site-packages" + os.sep, "dist-packages" + os.sep)


@functools.lru_cache(maxsize=None)
def _roots() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
  """Path prefixes: (jax and gshard, the standard library, other libraries)."""
  paths = sysconfig.get_paths()
  std = {paths.get("stdlib"), paths.get("platstdlib"), os.path.dirname(os.__file__)}
  std_roots = tuple(os.path.realpath(p) + os.sep for p in std if p)
  return _package_dirs(_CORE), std_roots, _package_dirs(LIBRARIES)


@functools.lru_cache(maxsize=4096)
def _kind(file_name: str) -> str:
  """``"core"`` (jax, jaxlib, gshard, the standard library), ``"library"`` or ``"user"``."""
  path = os.path.realpath(file_name)
  core, std, libs = _roots()
  if path.startswith(core) or file_name.startswith("<frozen"):
    return "core"
  if any(m in path for m in _INSTALLED) or path.startswith(libs):
    return "library"
  return "core" if path.startswith(std) else "user"


def _short(file_name: str) -> str:
  """A library file relative to where it is installed: ``flax/linen/linear.py``."""
  path = os.path.realpath(file_name)
  for marker in _INSTALLED:
    if marker in path:
      return path.rsplit(marker, 1)[1]
  for root in _roots()[2]:
    if path.startswith(root):
      return os.path.join(os.path.basename(root.rstrip(os.sep)), path[len(root):])
  return path


def _location(traceback, code, lasti) -> tuple[int, int]:
  """(line, column) of one raw frame."""
  locate = getattr(type(traceback), "code_addr2location", None)
  if locate is not None:
    return tuple(locate(code, lasti)[:2])
  return type(traceback).code_addr2line(code, lasti), 0   # an older jaxlib: the line only


def _format(file_name, function, line, col) -> str:
  if col:
    return f"{file_name}:{line}:{col} ({function})"
  return f"{file_name}:{line} ({function})"


def source_of(eqn) -> str:
  """The user's ``file:line:column (function)`` of ``eqn``, library frames skipped,
  with `` via LIB/FILE.py:LINE`` when the equation was bound inside a library;
  ``""`` when no frame outside jax and gshard exists."""
  info = getattr(eqn, "source_info", None)
  return summarize(getattr(info, "traceback", None))


def rebinding(info, own_line: bool = True):
  """The context to bind an equation's ops again in (an interpreter's): its
  name stack after the current one and, with ``own_line``, its traceback (else
  the caller's stays), so lowered programs name the user's layer and line."""
  names = source_info_util.current_name_stack() + info.name_stack
  return source_info_util.user_context(info.traceback if own_line else None, name_stack=names)


def names_code(traceback) -> bool:
  """Whether ``traceback`` has a frame outside jax, jaxlib, gshard and the
  standard library (:func:`summarize` of it is not ``""``)."""
  return traceback is not None and any(
      _kind(code.co_filename) != "core" for code in traceback.raw_frames()[0])


def summarize(traceback) -> str:
  """:func:`source_of` of a jaxlib ``Traceback`` (``eqn.source_info.traceback``)."""
  if traceback is None:
    return ""
  first = None      # the innermost library frame: (code, lasti)
  for code, lasti in zip(*traceback.raw_frames()):
    kind = _kind(code.co_filename)
    if kind == "core":
      continue
    if kind == "user":
      where = _format(code.co_filename, code.co_qualname,
                      *_location(traceback, code, lasti))
      if first is None:
        return where
      return f"{where} via {_short(first[0].co_filename)}:" \
             f"{_location(traceback, *first)[0]}"
    if first is None:
      first = (code, lasti)
  if first is not None:
    code, lasti = first
    return _format(code.co_filename, code.co_qualname, *_location(traceback, code, lasti))
  return ""
