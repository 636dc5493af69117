"""Python's cyclic garbage collector paused while gshard builds a program.

Tracing, propagating and partitioning allocate hundreds of thousands of small
objects (tracers, equations, shardings) that live until the program is built;
the collector's generation-2 passes over them cost a third of gshard's own
time on a Transformer train step and free nothing. They are paused for the
build and run as usual afterwards (the cycles the build left are collected
then).
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def paused():
  """Run the block with automatic garbage collection off (nests; restores)."""
  was = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if was:
      gc.enable()
