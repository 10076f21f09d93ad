"""`kiln bench --plot DIR`: PNG charts of a concurrency sweep (matplotlib, the `plot` extra).

    throughput.png  aggregate output tok/s against requests in flight
    ttft.png        time to first token, p50 / p90 / p99, against requests in flight
    itl.png         inter-token latency, p50 / p90 / p99, against requests in flight

The charts read the report `kiln bench` prints (offline or --server: the runs have the same keys), so
they can be drawn again from a saved --json report. Figures are built with matplotlib's object API
(no pyplot state) and rendered by the Agg canvas: no display needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.errors import InvalidParamError, KilnError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PERCENTILES = ("p50", "p90", "p99")


def concurrency_sweep(num_requests: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to num_requests (which ends the sweep even when it is not a power of two)."""
    if num_requests < 1:
        raise InvalidParamError(f"--num-requests must be at least 1 for a sweep, got {num_requests}", "num_requests")
    sweep, c = [], 1
    while c < num_requests:
        sweep.append(c)
        c *= 2
    return (*sweep, num_requests)


def check_plottable(levels: set[int]) -> None:
    """--plot draws against concurrency, so it needs two or more different levels (requests in flight),
    and matplotlib: checked before a bench runs for minutes, not after."""
    if len(levels) < 2:
        raise InvalidParamError("--plot draws figures against concurrency: give --sweep or two or more "
                                "different --concurrency values", "plot")
    _new_figure()


def _in_flight(run: dict[str, Any]) -> int:
    config = run["config"]
    return int(config["concurrency"] or config["num_requests"])


def _title(report: dict[str, Any], what: str) -> str:
    config = report["runs"][0]["config"]
    where = f"kiln serve at {report['server']}" if report.get("server") else "kiln (offline)"
    return (f"{what}\n{Path(report['engine']).name}, {where}: {config['num_requests']} requests of "
            f"{config['input_len']} in / {config['output_len']} out")


def _new_figure() -> Figure:
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise KilnError(f"--plot needs matplotlib: pip install 'kiln[plot]' ({e})") from e
    return Figure(figsize=(6.4, 4.0), dpi=100, layout="constrained")


def _axes(figure: Figure, levels: list[int], title: str, ylabel: str) -> Any:
    ax = figure.add_subplot()
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.minorticks_off()
    ax.set_xlabel("requests in flight (concurrency)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    return ax


def bench_figures(report: dict[str, Any]) -> dict[str, Figure]:
    """The charts of a `kiln bench` report, by file stem."""
    runs = sorted(report["runs"], key=_in_flight)
    levels = [_in_flight(r) for r in runs]
    check_plottable(set(levels))
    figures: dict[str, Figure] = {}
    figure = _new_figure()
    ax = _axes(figure, levels, _title(report, "Aggregate output throughput"), "output tokens / s")
    values = [r["output_tok_per_s"] for r in runs]
    ax.plot(levels, values, marker="o", color="#c2410c")
    for x, y in zip(levels, values, strict=True):
        label = f"{y:.0f}" if y >= 100 else f"{y:.3g}"
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set_ylim(0, max(values) * 1.15)
    figures["throughput"] = figure
    for stem, key, what in (("ttft", "ttft_ms", "Time to first token"), ("itl", "itl_ms", "Inter-token latency")):
        figure = _new_figure()
        ax = _axes(figure, levels, _title(report, what), "ms")
        for p, style in zip(PERCENTILES, ("-", "--", ":"), strict=True):
            ax.plot(levels, [r[key][p] for r in runs], style, marker="o", label=p, color="#1d4ed8")
        ax.set_ylim(bottom=0)
        ax.legend()
        figures[stem] = figure
    return figures


def write_bench_charts(report: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write the charts as PNGs into out_dir (created); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for stem, figure in bench_figures(report).items():
        path = out / f"{stem}.png"
        figure.savefig(path)
        paths.append(path)
    return paths
