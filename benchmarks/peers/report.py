"""The peers table: per-system medians over rounds and kiln/peer ratios with their [min–max] range.

Pure functions over `rounds`: a list (one entry per round) of {system: {figure: value}}. A ratio is
taken within each round (kiln's figure over the peer's from the same round, minutes apart), then
summarized; a figure a system does not have (onnxruntime-genai has no server) shows as "—".
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

Rounds = list[dict[str, dict[str, float]]]


@dataclass(frozen=True)
class Figure:
    key: str
    label: str
    unit: str

    def __post_init__(self) -> None:
        if not self.key or not self.label:
            raise ValueError(f"key and label must be non-empty, got key={self.key!r} label={self.label!r}")


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float


def spread(values: list[float]) -> Spread | None:
    return Spread(statistics.median(values), min(values), max(values)) if values else None


def values_of(rounds: Rounds, system: str, key: str) -> list[float]:
    return [r[system][key] for r in rounds if key in r.get(system, {})]


def ratios_of(rounds: Rounds, system: str, peer: str, key: str) -> list[float]:
    """system / peer, round by round, over the rounds that measured both."""
    return [r[system][key] / r[peer][key] for r in rounds
            if key in r.get(system, {}) and key in r.get(peer, {}) and r[peer][key]]


def fmt_value(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def fmt_ratio(s: Spread | None) -> str:
    return "—" if s is None else f"{s.median:.2f}× [{s.low:.2f}–{s.high:.2f}]"


def table(rounds: Rounds, figures: list[Figure], kiln: list[str], peers: list[str]) -> str:
    """Markdown: one row per figure; each system's median, then each kiln/peer ratio."""
    ratio_cols = [(k, p) for k in kiln for p in peers]
    header = ["figure", *peers, *kiln, *(f"{k} / {p}" for k, p in ratio_cols)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for fig in figures:
        cells = [f"{fig.label} ({fig.unit})"]
        for system in [*peers, *kiln]:
            s = spread(values_of(rounds, system, fig.key))
            cells.append("—" if s is None else fmt_value(s.median))
        if fig.unit == "count":  # a tally (failed requests), not a speed: no ratio
            cells += ["—"] * len(ratio_cols)
        else:
            cells += [fmt_ratio(spread(ratios_of(rounds, k, p, fig.key))) for k, p in ratio_cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(rounds: Rounds, figures: list[Figure], kiln: list[str], peers: list[str]) -> dict:
    """The table's numbers for the JSON report."""
    out: dict = {"medians": {}, "ratios": {}}
    for fig in figures:
        for system in [*peers, *kiln]:
            s = spread(values_of(rounds, system, fig.key))
            if s is not None:
                out["medians"].setdefault(system, {})[fig.key] = s.__dict__
        for k in kiln:
            for p in peers:
                s = spread(ratios_of(rounds, k, p, fig.key))
                if s is not None:
                    out["ratios"].setdefault(f"{k} / {p}", {})[fig.key] = s.__dict__
    return out
