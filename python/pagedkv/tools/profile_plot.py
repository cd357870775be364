"""The PNG `python -m pagedkv.tools.profile --out DIR` saves beside its JSON: per decode step, the
kernel (CPU: op) time of each category side by side for every system, and the wall time with and
without the profiler (the profiler's per-launch cost inflates launch-heavy systems: only the
unprofiled bar is the speed to quote)."""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING

from pagedkv.tools.profiling import CATEGORIES, StepProfile

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def plot_profiles(profiles: list[StepProfile], path: pathlib.Path | None, title: str, cuda: bool,
                  spread: dict[str, tuple[float, float]] | None = None) -> Figure:
    """Draws the two panels, into `path` (PNG) when given. Uses matplotlib's Figure directly, not
    pyplot: no GUI backend, and a notebook's current figure is left alone (display() the result).
    spread: system -> (min, max) unprofiled ms per step over repeats, drawn as error bars."""
    from matplotlib.figure import Figure

    op = "kernel" if cuda else "op"
    gap = "idle gaps" if cuda else "outside ops"
    labels = [c for c, _ in CATEGORIES] + ["other"]
    labels = [c for c in labels if any(p.categories_ms.get(c, 0.0) > 0 for p in profiles)] + [gap]
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    by_category, walls = fig.subplots(1, 2, width_ratios=[3, 1.3])
    height = 0.8 / len(profiles)
    for i, p in enumerate(profiles):
        values = [max(p.categories_ms.get(c, 0.0), 0.0) for c in labels[:-1]] + [p.gap_ms]
        rows = [r + (i - (len(profiles) - 1) / 2) * height for r in range(len(labels))]
        by_category.barh(rows, values, height=height, label=p.system, color=f"C{i}")
    by_category.set_yticks(range(len(labels)), labels)
    by_category.invert_yaxis()
    by_category.set_xlim(left=0)
    # CUDA: each kernel's time alone on the device (profiling._busy_per_kernel), overlaps once
    by_category.set_xlabel(f"ms per decode step (profiled, {op} time" + (", overlaps counted once)" if cuda else ")"))
    by_category.set_title(f"where a step's {op} time goes")
    by_category.legend(loc="lower right")

    names = [p.system for p in profiles]
    x = range(len(profiles))
    # Each system in its colour, as on the left; the profiled bar hatched and pale.
    for i, p in enumerate(profiles):
        low, high = (spread or {}).get(p.system, (p.unprofiled_wall_ms, p.unprofiled_wall_ms))
        walls.bar(i - 0.2, p.unprofiled_wall_ms, width=0.4, color=f"C{i}", label="not profiled" if i == 0 else None,
                  yerr=[[p.unprofiled_wall_ms - low], [high - p.unprofiled_wall_ms]] if spread else None,
                  capsize=4)
        walls.bar(i + 0.2, p.wall_ms, width=0.4, color=f"C{i}", alpha=0.35, hatch="//",
                  label="profiled" if i == 0 else None)
        walls.annotate(f"{p.unprofiled_wall_ms:.3g}", (i - 0.2, max(p.unprofiled_wall_ms, 0.0)),
                       ha="center", va="bottom", fontsize="small")
    walls.set_xticks(list(x), names, rotation=15)
    top = max([p.unprofiled_wall_ms for p in profiles] + [p.wall_ms for p in profiles] + [1e-3]
              + [high for _, high in (spread or {}).values()])
    walls.set_ylim(0, 1.25 * top)
    walls.set_ylabel("wall ms per decode step")
    walls.set_title("wall time (quote the solid bar)")
    walls.legend(loc="upper left", fontsize="small")
    fig.suptitle(title)
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
