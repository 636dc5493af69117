"""Pipeline parallelism: schedules (GPipe, 1F1B, interleaved, zero bubble), balancing, costs.

Public API::

  gshard.pipeline.schedule      a validated tick x stage table of Actions, by name or your own
  gshard.pipeline.Schedule      the table with bubble_fraction, peak_in_flight, chart, plot
  gshard.pipeline.Action        Action(kind "F"/"B"/"W", microbatch, chunk)
  gshard.pipeline.balance       layers per stage: exact min-max (or Alpa) contiguous split
  gshard.pipeline.layer_costs   per-layer FLOPs and bytes counted from the jaxpr

Conventions (the executor's contract; details in ``gshard.pipeline.schedules``):
chunk ``c`` of device stage ``s`` is virtual stage ``c * K + s``; in one tick
each stage runs at most one action; a result produced at tick ``t`` is usable
by the neighbouring virtual stage from tick ``t + 1``.

Modules: ``actions`` (Action, virtual stages), ``schedules`` (Schedule),
``tables`` (the built-in schedules and ``schedule()``), ``timeline`` (costs),
``balance``, ``costs`` (layer_costs).
"""

from gshard.pipeline.actions import Action, placement, virtual_stage
from gshard.pipeline.balance import balance
from gshard.pipeline.costs import LayerCosts, layer_costs
from gshard.pipeline.schedules import Schedule
from gshard.pipeline.tables import schedule
from gshard.pipeline.timeline import Costs, Event, Timeline

__all__ = ["Action", "Costs", "Event", "LayerCosts", "Schedule", "Timeline", "balance",
           "layer_costs", "placement", "schedule", "virtual_stage"]
