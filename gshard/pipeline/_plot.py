"""PNG Gantt chart of a schedule's timeline (matplotlib, optional: ``gshard[plot]``).

Uses ``matplotlib.figure.Figure`` and the Agg canvas directly, so it neither
needs a display nor changes pyplot's global state or the user's backend.
"""

from __future__ import annotations

import os

_HATCH = {"F": "", "B": "//", "W": ".."}
_ALPHA = {"F": 1.0, "B": 0.85, "W": 0.45}
_IDLE = "#d9d9d9"


def _matplotlib():
  try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
  except ImportError as e:
    raise ImportError(
        "Schedule.plot needs matplotlib, which is an optional dependency of gshard: install "
        "it with pip install 'gshard[plot]' (or pip install matplotlib). Schedule.chart() "
        "gives the same chart as text without it.") from e
  return Figure, FigureCanvasAgg, Patch


def plot_timeline(timeline, path, *, num_microbatches: int, show_chunk: bool,
                  title: str) -> str:
  """Draw ``timeline`` (a ``Timeline``) to the PNG file ``path``; returns ``str(path)``."""
  Figure, FigureCanvasAgg, Patch = _matplotlib()
  num_stages = timeline.num_stages
  makespan = max(timeline.makespan, 1e-12)
  width = min(30.0, max(6.0, 0.4 * len(timeline.events) / max(num_stages, 1) + 2.0))
  fig = Figure(figsize=(width, 1.0 + 0.55 * num_stages))
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  colours = _colours(num_microbatches)
  # Idle background first: whatever the actions do not cover stays grey.
  ax.barh(range(num_stages), [makespan] * num_stages, left=0.0, height=0.8, color=_IDLE,
          edgecolor="none")
  for e in timeline.events:
    a = e.action
    ax.barh(e.stage, e.end - e.start, left=e.start, height=0.8,
            color=colours[a.microbatch], alpha=_ALPHA[a.kind], hatch=_HATCH[a.kind],
            edgecolor="black", linewidth=0.6)
    # Box width in points (the axes take ~80% of the figure): the full label if it
    # fits, else without the chunk, else the micro-batch number, else none.
    points = (e.end - e.start) / makespan * 0.8 * width * 72
    for text in (a.label(show_chunk), a.label(False), str(a.microbatch)):
      if len(text) * 7 * 0.62 + 2 <= points:
        ax.text((e.start + e.end) / 2, e.stage, text, ha="center", va="center", fontsize=7)
        break
  ax.set_yticks(range(num_stages), [f"stage {s}" for s in range(num_stages)])
  ax.set_ylim(num_stages - 0.5, -0.5)
  ax.set_xlim(0.0, makespan)
  ax.set_xlabel("time (ticks)" if all(e.end - e.start == 1.0 for e in timeline.events)
                else "time (cost units)")
  ax.set_title(title, fontsize=10)
  legend = [Patch(facecolor="white", edgecolor="black", hatch=_HATCH[k], label=label)
            for k, label in (("F", "F forward"), ("B", "B backward"), ("W", "W weight grad"))]
  legend.append(Patch(facecolor=_IDLE, edgecolor="none", label="idle (bubble)"))
  ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
  fig.tight_layout()
  suffix = os.path.splitext(os.fspath(path))[1].lower().lstrip(".")
  fmt = suffix if suffix in fig.canvas.get_supported_filetypes() else "png"
  fig.savefig(os.fspath(path), format=fmt, dpi=110)
  return str(path)


def _colours(n: int) -> list:
  """One colour per micro-batch: tab20 (distinct) up to 20, a continuous map beyond."""
  from matplotlib import colormaps
  if n <= 20:
    cmap = colormaps["tab20"]
    order = list(range(0, 20, 2)) + list(range(1, 20, 2))  # strong shades first
    return [cmap(order[i]) for i in range(n)]
  cmap = colormaps["viridis"]
  return [cmap(i / (n - 1)) for i in range(n)]
