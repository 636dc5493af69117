"""Pipeline parallelism: GPipe inside the partitioned program; schedules, balancing, costs.

Public API::

  gshard.pipeline.run           GPipe over a mesh axis of stages (the plain loop off mesh)
  gshard.pipeline.stack         L per-layer pytrees -> the stacked layout run takes
  gshard.pipeline.unstack       the inverse
  gshard.pipeline.shift         move rows of one dim (one collective permute when split)
  gshard.pipeline.schedule      a validated tick x stage table of Actions, by name or your own
  gshard.pipeline.Schedule      the table with bubble_fraction, peak_in_flight, chart, plot
  gshard.pipeline.Action        Action(kind "F"/"B"/"W", microbatch, chunk)
  gshard.pipeline.balance       layers per stage: exact min-max (or Alpa) contiguous split
  gshard.pipeline.layer_costs   per-layer FLOPs and bytes counted from the jaxpr

Conventions (the executor's contract; details in ``gshard.pipeline.schedules``):
chunk ``c`` of device stage ``s`` is virtual stage ``c * K + s``; in one tick
each stage runs at most one action; a result produced at tick ``t`` is usable
by the neighbouring virtual stage from tick ``t + 1``.

Modules: ``loop`` (run), ``layout`` (stack, unstack), ``shift`` (the shift
primitive), ``actions`` (Action, virtual stages), ``schedules`` (Schedule),
``tables`` (the built-in schedules and ``schedule()``), ``timeline`` (costs),
``balance``, ``costs`` (layer_costs). ``gshard.pipeline.schedule`` and
``gshard.pipeline.run`` are the functions.
"""

from gshard.pipeline.actions import Action, placement, virtual_stage
from gshard.pipeline.balance import balance
from gshard.pipeline.costs import LayerCosts, layer_costs
from gshard.pipeline.layout import Layout, stack, unstack
from gshard.pipeline.loop import run
from gshard.pipeline.schedules import Schedule
from gshard.pipeline.shift import shift
from gshard.pipeline.tables import schedule
from gshard.pipeline.timeline import Costs, Event, Timeline

__all__ = ["Action", "Costs", "Event", "LayerCosts", "Layout", "Schedule", "Timeline",
           "balance", "layer_costs", "placement", "run", "schedule", "shift", "stack",
           "unstack", "virtual_stage"]
