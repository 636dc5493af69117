"""Sharding annotations: ``split``, ``replicate``, ``shard`` and their primitive."""

from gshard.annotate._api import (as_sharding_constraints, current_mesh_sizes, mesh_context,
                                  replicate, shard, split)
from gshard.annotate._primitive import Annotation, annotate_p

__all__ = ["Annotation", "annotate_p", "as_sharding_constraints", "current_mesh_sizes",
           "mesh_context", "replicate", "shard", "split"]
