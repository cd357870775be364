"""Writing a benchmark's results: a markdown table printed and saved, and a matplotlib PNG."""

from __future__ import annotations

import pathlib
import textwrap
from typing import Sequence


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def fmt(v: object) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def save_table(out_dir: pathlib.Path, name: str, title: str, table: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    text = f"{title}\n\n{table}\n"
    (out_dir / f"{name}.md").write_text(text)
    print(text)


def save_bar_plot(out_dir: pathlib.Path, name: str, title: str, labels: Sequence[str],
                  series: dict[str, Sequence[float]], ylabel: str) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig_width = max(6, len(labels) * 1.2)
    fig, ax = plt.subplots(figsize=(fig_width, 4))
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=label)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(labels))], labels)
    ax.set_ylabel(ylabel)
    # Wrapped to the figure's width (~11 title characters an inch), and the legend under the axes:
    # a long title ran off the image, and a legend of many series hid the first group's bars.
    ax.set_title("\n".join(textwrap.wrap(title, width=int(fig_width * 11))))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=min(4, len(series)),
              fontsize="small", frameon=False)
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
