"""PNG charts for `gpupack simulate` (matplotlib, Agg backend: no display needed).

matplotlib is the `simulate` extra's (`pip install 'gpupack[simulate]'`), not a runtime
dependency: it is imported when a chart is drawn, so the components' image carries none of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class ChartUnavailable(RuntimeError):
    pass


def pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise ChartUnavailable(
            "charts need matplotlib, in gpupack's `simulate` extra: pip install 'gpupack[simulate]'"
        ) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path, dpi: int = 100) -> Path:
    """Write `fig` as a PNG at `path` (its folder made if need be) and free it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


COLORS = {"random": "#999999", "bestfit": "#1f77b4", "fgd": "#ff7f0e", "gpupack": "#2ca02c"}


def replay_chart(
    curves: dict[str, list[float | None]], path: Path, title: str, bound: float | None = None
) -> Path:
    """Unallocated GPUs (% of capacity) against arrived GPU request (% of capacity), one curve per policy.

    `curves`: policy -> mean unallocated % per bin 0..130. `bound`: the lower bound at 100%
    (gpupack.simulate.bound), drawn as a marker no placement can go below.
    """
    plt = pyplot()
    fig, (full, zoom) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1, 1.3]})
    for name, ys in curves.items():
        xs = [x for x, y in enumerate(ys) if y is not None]
        vs = [y for y in ys if y is not None]
        color = COLORS.get(name)
        at100 = ys[100] if len(ys) > 100 else None
        label = name if at100 is None else f"{name}: {at100:.2f}% at 100%"
        full.plot(xs, vs, label=name, color=color, linewidth=1.6)
        pts = [(x, y) for x, y in zip(xs, vs, strict=True) if x >= 80]
        zoom.plot([p[0] for p in pts], [p[1] for p in pts], label=label, color=color, linewidth=1.8)
    if bound is not None:
        for ax in (full, zoom):
            ax.plot(
                [100],
                [bound],
                marker="v",
                markersize=9,
                linestyle="none",
                color="#d62728",
                label=f"bound (any placement): {bound:.2f}% at 100%" if ax is zoom else "bound",
            )
    for ax in (full, zoom):
        ax.axvline(100, color="#444444", linestyle=":", linewidth=1)
        ax.set_xlabel("arrived GPU request (% of cluster GPU capacity)")
        ax.grid(alpha=0.3)
    full.set_ylabel("unallocated GPUs (% of capacity)")
    full.set_title("whole replay")
    zoom.set_title("near and past full load (lower is better)")
    zoom.set_ylim(bottom=0)
    zoom.legend(loc="upper right")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def fleet_chart(rows: dict[str, dict[str, float]], path: Path, title: str) -> Path:
    """Grouped bars: whole-card allocation vs gpupack for GPUs used, pods placed, memory and SM use."""
    metrics = [
        ("gpus_needed", "GPUs needed for every replica"),
        ("pods_placed_pct", "pods placed (%)"),
        ("mem_util_pct", "GPU memory used (%)"),
        ("sm_util_pct", "SM share used (%)"),
    ]
    plt = pyplot()
    fig, axes = plt.subplots(1, len(metrics), figsize=(13, 4))
    modes = list(rows)
    colors = ["#999999", "#2ca02c", "#ff7f0e", "#1f77b4"]
    for ax, (key, label) in zip(axes, metrics, strict=True):
        vals = [rows[m][key] or 0.0 for m in modes]  # None: not every replica fit
        bars = ax.bar(range(len(modes)), vals, color=colors[: len(modes)])
        ax.set_xticks(range(len(modes)), modes, fontsize=9)
        ax.set_title(label, fontsize=10)
        for b, v in zip(bars, vals, strict=True):
            ax.annotate(f"{v:.0f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=9)
        ax.set_ylim(0, max(vals) * 1.18 if max(vals) else 1)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
