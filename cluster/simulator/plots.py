"""PNG plots of simulator runs (matplotlib, imported only here, headless)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt
    return plt


def plot_load_sweep(sweep: dict[str, list[dict]], capacity_rps: float, path: str | Path, title: str = "",
                    slo_ttft: float | None = None) -> Path:
    """TTFT p99 and goodput against load, one line per policy (cli.load_sweep's result); `slo_ttft` draws the
    SLO's TTFT on the first panel."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for policy, points in sweep.items():
        loads = [p["load"] * 100 for p in points]
        style = dict(ls="--", color="gray") if policy == "bound" else dict(marker="o")
        ax1.plot(loads, [p["ttft_p99"] for p in points], label=policy, **style)
        ax2.plot(loads, [p["goodput"] for p in points], label=policy, **style)
    if slo_ttft:
        ax1.axhline(slo_ttft, ls=":", color="black", lw=0.8, label=f"SLO TTFT {slo_ttft:g} s")
    ax1.set(xlabel="load (% of capacity)", ylabel="TTFT p99 (s)", yscale="log", title="TTFT p99")
    ax2.set(xlabel="load (% of capacity)", ylabel="goodput (req/s meeting the SLO)", title="goodput")
    ax2.plot([min(p["load"] for p in sweep["bound"]) * 100, max(p["load"] for p in sweep["bound"]) * 100],
             [min(p["load"] for p in sweep["bound"]) * capacity_rps,
              max(p["load"] for p in sweep["bound"]) * capacity_rps], ls=":", color="black", lw=0.8,
             label="offered")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_replicas_over_time(series: dict[str, list[tuple[float, int]]], path: str | Path, title: str = "",
                            rate: list[tuple[float, float]] | None = None) -> Path:
    """Replica count over time per autoscaling policy (steps), with the offered rate on a second axis."""
    plt = _pyplot()
    end = max((t for points in series.values() for t, _ in points), default=0.0)
    unit, scale = ("h", 3600.0) if end > 3 * 3600 else ("min", 60.0)
    fig, ax = plt.subplots(figsize=(9, 4))
    if rate:  # drawn first, on its own axis, so the replica lines stay on top
        ax2 = ax.twinx()
        ax2.fill_between([t / scale for t, _ in rate], [r for _, r in rate], step="mid", color="gray", alpha=0.2,
                         lw=0)
        ax2.set_ylabel("offered req/s (shaded)", color="gray")
        ax2.set_ylim(bottom=0)
        ax.set_zorder(ax2.get_zorder() + 1)
        ax.patch.set_visible(False)
    for name, points in series.items():
        ax.step([t / scale for t, _ in points], [n for _, n in points], where="post", label=name, lw=1.6)
    ax.set(xlabel=f"time ({unit})", ylabel="replicas (live: starting, serving, draining)",
           title=title or "replicas under autoscaling")
    ax.set_ylim(bottom=0)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
