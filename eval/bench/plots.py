"""The benchmarks' one plot shape: a few named series of points, each point labelled, on a grid
(KL against file size in `bench gguf` and `bench onnx`, against KV memory in `bench kv`, speed-up
against draft size in `bench draft`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Series:
    """One legend entry: its points drawn with ``style`` (a matplotlib format string such as ``o`` or ``s-``)."""

    label: str
    style: str
    x: list[float]
    y: list[float]


def plot_series(
    path: Path,
    series: list[Series],
    notes: list[tuple[str, float, float]],
    xlabel: str,
    ylabel: str,
    title: str,
    note_size: int = 7,
    xscale: dict[str, Any] | None = None,
    yscale: dict[str, Any] | None = None,
    reference_y: float | None = None,
) -> Path:
    """``series`` (an empty one is left out) with each of ``notes`` (text, x, y) written beside its point;
    ``xscale`` / ``yscale``: matplotlib's set_xscale / set_yscale arguments (``{"value": "log"}``);
    ``reference_y``: a dashed horizontal line there (a ratio's 1.0)."""
    from compress.eval.reports import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    try:
        for s in series:
            if s.x:
                ax.plot(s.x, s.y, s.style, label=s.label)
        for text, x, y in notes:
            ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=note_size)
        if reference_y is not None:
            ax.axhline(reference_y, color="grey", linestyle="--", linewidth=1)
        if xscale is not None:
            ax.set_xscale(**xscale)
        if yscale is not None:
            ax.set_yscale(**yscale)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=8)
        return save_figure(fig, path)
    finally:
        plt.close(fig)
