"""Tables, JSON files and figures for the example scripts in this folder.

Not part of dpfunc and not an example itself: the scripts import it (``import report``,
from this folder) to print their tables, save their records and draw their plots, so
that each of them reads as its experiment alone. Figures use matplotlib's Agg backend:
they are written to files, no display is needed.
"""

from __future__ import annotations

import json
import os
import statistics


def mean_std(values) -> tuple[float, float]:
    """The mean and the sample standard deviation of ``values`` (0 for a single value)."""
    values = list(values)
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def print_header(columns) -> None:
    """Prints the titles of a table's ``columns``, a list of ``(title, width)``.

    A positive width right-aligns the column (numbers), a negative one left-aligns it
    (names); ``print_row`` prints the rows under it, as they come.
    """
    print_row(columns, [title for title, _ in columns])


def print_row(columns, cells) -> None:
    """Prints one row of ``cells`` (strings formatted by the caller) under ``columns``."""
    print(" ".join(f"{c:{'>' if w > 0 else '<'}{abs(w)}}" for c, (_, w) in zip(cells, columns)))


def save_json(data, path: str) -> None:
    """Writes ``data`` to ``path`` as indented JSON (creating its folder) and says so."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    print(f"saved {path}")


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (imported here: only plotting needs it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def epsilon_axis(ax, epsilons, *, xlabel: str, ylabel: str, title: str) -> None:
    """A log-scale epsilon axis ticked at ``epsilons``, the labels, a legend and a grid."""
    epsilons = sorted(epsilons)
    ax.set_xscale("log")
    ax.set_xticks(epsilons, [f"{e:.2g}" for e in epsilons])
    ax.minorticks_off()
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)


def save_figure(fig, path: str, dpi: int = 120) -> None:
    """Lays out ``fig``, writes it to ``path`` (creating its folder), closes it, says so."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    print(f"saved {path}")
