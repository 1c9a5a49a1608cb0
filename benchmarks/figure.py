"""What the real-worker benchmarks' figures share: log-scale axes labelled at the measured
points, and the caption and file written one way."""
from __future__ import annotations

from pathlib import Path


def measured_ticks(ax, xs: list) -> None:
    """Ticks at exactly the measured x values (a log axis otherwise labels powers of ten), a light
    grid and the legend."""
    ax.set_xticks(xs, [str(x) for x in xs], minor=False)
    ax.set_xticks([], minor=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def save(fig, path: Path, caption: str) -> None:
    fig.suptitle(caption, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
