"""One grouped bar chart of the kiln/peer ratios of a peers report (run.py's JSON), as a PNG.

    .venv/bin/python benchmarks/peers/plot.py results.json -o DIR     # writes DIR/ratios.png

One row per figure, one bar per kiln/peer pair: the median ratio over the rounds, with its min–max
range as an error bar; the line at 1× is parity, and right of it kiln is ahead (for times, where
lower is better, the bar is peer / kiln so that right is still kiln ahead; the label says so). run.py --plot DIR
draws it when the rounds are done.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from matplotlib.figure import Figure

# Figures where a lower value is better: their ratios are drawn inverted (peer / kiln).
LOWER_IS_BETTER_UNITS = ("s", "ms")


def ratio_figure(report: dict) -> Figure:
    """The chart of report["summary"]["ratios"], labelled from report["figures"] when present."""
    ratios: dict[str, dict[str, dict[str, float]]] = report["summary"]["ratios"]
    if not ratios:
        raise ValueError("the report has no kiln/peer ratios to chart")
    described = report.get("figures", {})  # older reports: keys as labels, every ratio taken as higher-is-better
    keys = [k for k in described if any(k in r for r in ratios.values())]
    keys += sorted({k for r in ratios.values() for k in r} - set(keys))
    pairs = list(ratios)
    height = 0.8 / len(pairs)
    figure = Figure(figsize=(8.0, 1.2 + 0.3 * len(keys) * len(pairs)), dpi=100, layout="constrained")
    ax = figure.add_subplot()
    for i, pair in enumerate(pairs):
        rows, medians, errors = [], [], [[], []]
        for row, key in enumerate(keys):
            spread = ratios[pair].get(key)
            if spread is None:
                continue
            lower_better = described.get(key, {}).get("unit") in LOWER_IS_BETTER_UNITS
            med, low, high = ((1 / spread["median"], 1 / spread["high"], 1 / spread["low"]) if lower_better
                              else (spread["median"], spread["low"], spread["high"]))
            rows.append(row + (i - (len(pairs) - 1) / 2) * height)
            medians.append(med)
            errors[0].append(med - low)
            errors[1].append(high - med)
        ax.barh(rows, medians, height=height, xerr=errors, capsize=2, label=pair)
        for y, med, above in zip(rows, medians, errors[1], strict=True):  # the label right of the range's end
            ax.annotate(f"{med:.2f}×", (med + above, y), xytext=(4, 0), textcoords="offset points", va="center",
                        fontsize=7)
    labels = []
    for key in keys:
        info = described.get(key)
        label = f"{info['label']} ({info['unit']})" if info else key
        labels.append(label + (", peer/kiln" if info and info["unit"] in LOWER_IS_BETTER_UNITS else ""))
    ax.set_yticks(range(len(keys)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("kiln / peer: median over rounds, bars min–max; right of 1 is kiln ahead")
    ax.set_title(f"kiln against its peers, {len(report['rounds'])} interleaved rounds, "
                 f"{report.get('threads', '?')} threads", fontsize=10)
    ax.set_xlim(0, ax.get_xlim()[1] * 1.08)  # room for the labels
    figure.legend(fontsize=8, loc="outside lower center", ncols=min(len(pairs), 3))
    ax.grid(True, axis="x", alpha=0.3)
    return figure


def write_ratio_chart(report: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "ratios.png"
    ratio_figure(report).savefig(path)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path, help="a JSON report of run.py")
    parser.add_argument("-o", "--out", type=Path, required=True, help="directory for ratios.png")
    args = parser.parse_args()
    print(write_ratio_chart(json.loads(args.report.read_text()), args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
