"""gshard: annotate a single-device JAX program, get it sharded over a mesh.

Public API::

  gshard.split / gshard.replicate / gshard.shard   annotations in model code
  gshard.make_mesh                                 a mesh with Auto axes
  gshard.infer_shardings                           propagation over a whole program
  gshard.partition                                 the per-device program, run or lowered
  gshard.auto_shard                                the layouts found by a solver (a Plan)
  gshard.TensorSharding                            the sharding value
  gshard.PaddedArray / gshard.unpad                uneven state kept split between calls
  gshard.coverage                                  which primitives take the safe path
  gshard.gspmd_jit                                 the same annotations, through XLA GSPMD
  gshard.distributed                               JAX's multi-process runtime: initialize, process_rows
  gshard.checkpoint                                save / restore train state with orbax-checkpoint

  python -m gshard.launch                          run a script as N processes on this machine
"""

from gshard import checkpoint, distributed
from gshard.auto import Plan, auto_shard
from gshard._mesh import make_mesh
from gshard.annotate import replicate, shard, split
from gshard.coverage import Coverage, coverage
from gshard.gspmd import gspmd_jit
from gshard.spmd.infer import ShardingResult, infer_shardings
from gshard.spmd.partition.api import Partitioned, partition
from gshard.spmd.partition.context import Collective, PartitionWarning
from gshard.spmd.partition.padded import PaddedArray, unpad
from gshard.spmd.sharding import TensorSharding

__all__ = ["Collective", "Coverage", "PaddedArray", "PartitionWarning", "Partitioned",
           "Plan", "ShardingResult", "TensorSharding", "auto_shard", "checkpoint", "coverage", "distributed",
           "gspmd_jit", "infer_shardings", "make_mesh", "partition", "replicate", "shard",
           "split", "unpad"]
__version__ = "0.1.0"
