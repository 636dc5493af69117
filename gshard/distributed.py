"""Joining JAX's multi-process runtime, and feeding each process its rows.

A TPU pod or a GPU cluster runs one process per host; ``jax.distributed``
connects them, and a ``gshard.partition`` step then runs over every device of
every process (it is one ``shard_map`` under ``jax.jit``). This module is a
thin layer over that runtime, not a runtime of its own:

- :func:`initialize` calls ``jax.distributed.initialize``. Under
  ``python -m gshard.launch`` it passes what the launcher set (loopback
  coordinator, process count and id, timeouts); anywhere else it passes only
  what you give it, so on TPU, SLURM or Open MPI ``jax.distributed`` detects
  the cluster by itself.
- :func:`process_rows` says which rows of a global batch this process feeds to
  ``jax.make_array_from_process_local_data``.

Example::

  import gshard, jax
  gshard.distributed.initialize()        # first, before any other jax call
  mesh = gshard.make_mesh((2, 4), ("data", "model"))
  sharding = jax.NamedSharding(mesh, jax.P("data"))
  rows = gshard.distributed.process_rows(sharding, (256, 1024))
  tokens = jax.make_array_from_process_local_data(sharding, load(rows), (256, 1024))
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

# The environment python -m gshard.launch gives each process (see gshard/launch.py).
ENV_NUM_PROCESSES = "GSHARD_NUM_PROCESSES"
ENV_PROCESS_ID = "GSHARD_PROCESS_ID"
ENV_HEARTBEAT_TIMEOUT = "GSHARD_HEARTBEAT_TIMEOUT"
ENV_INIT_TIMEOUT = "GSHARD_INIT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "GSHARD_SHUTDOWN_TIMEOUT"
# jax reads these itself: the coordinator's address, the CPU device count and
# the CPU collectives (config options are read from JAX_<NAME> variables).
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"


def launched() -> bool:
  """Whether this process was started by ``python -m gshard.launch``."""
  return ENV_PROCESS_ID in os.environ


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, **kwargs) -> None:
  """Join the multi-process JAX runtime; call it first, before any other jax call.

  Under ``python -m gshard.launch`` the arguments default to what the launcher
  set: the loopback coordinator, this process's id and the process count, and
  short timeouts (``heartbeat_timeout_seconds``, ``initialization_timeout``,
  ``shutdown_timeout_seconds``) so that when one process dies the others stop
  within seconds. Anywhere else this is ``jax.distributed.initialize(...)``
  with exactly the arguments given: with none, jax detects a Cloud TPU pod,
  SLURM or Open MPI job by itself.

  Calling it again once initialized does nothing.

  Args:
    coordinator_address, num_processes, process_id: as for
      ``jax.distributed.initialize``; override the launcher's values.
    **kwargs: passed on to ``jax.distributed.initialize`` (for example
      ``local_device_ids``, ``heartbeat_timeout_seconds``).
  """
  import jax

  if jax.distributed.is_initialized():
    return
  if launched():
    env = os.environ
    num_processes = int(env[ENV_NUM_PROCESSES]) if num_processes is None else num_processes
    process_id = int(env[ENV_PROCESS_ID]) if process_id is None else process_id
    coordinator_address = coordinator_address or env.get(ENV_COORDINATOR)
    for name, var in (("heartbeat_timeout_seconds", ENV_HEARTBEAT_TIMEOUT),
                      ("initialization_timeout", ENV_INIT_TIMEOUT),
                      ("shutdown_timeout_seconds", ENV_SHUTDOWN_TIMEOUT)):
      if var in env:
        kwargs.setdefault(name, int(env[var]))
  jax.distributed.initialize(coordinator_address, num_processes, process_id, **kwargs)


def process_rows(sharding, global_shape: Sequence[int], dim: int = 0) -> np.ndarray:
  """The indices along ``dim`` of the global array that this process feeds.

  ``jax.make_array_from_process_local_data(sharding, local, global_shape)``
  takes, on each process, only the slices its own devices hold, concatenated
  in increasing order; this is the list of those indices. With one process it
  is every index. Load exactly these rows of the global batch (or any rows, if
  you do not need to know which global example lands where).

  Example: a batch of 16 split over ``data=2`` with one ``data`` row of the mesh
  per process gives ``[0..7]`` on process 0 and ``[8..15]`` on process 1.

  Raises:
    ValueError: ``dim`` is out of range for ``global_shape``.
  """
  global_shape = tuple(global_shape)
  if not 0 <= dim < len(global_shape):
    raise ValueError(f"process_rows(dim={dim}): global_shape {global_shape} has "
                     f"{len(global_shape)} dims.")
  size = global_shape[dim]
  blocks = {}
  for index in sharding.addressable_devices_indices_map(global_shape).values():
    start, stop, _ = index[dim].indices(size)
    blocks[start] = stop
  return np.concatenate([np.arange(start, blocks[start]) for start in sorted(blocks)])
