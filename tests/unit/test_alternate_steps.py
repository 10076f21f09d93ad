"""benchmarks/alternate_steps.py's summary: each engine against the first, step by step."""

from __future__ import annotations

from pathlib import Path

from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "alternate_steps.py"


def test_summary_takes_each_steps_ratio_to_the_first_engines_step():
    alternate = load_script(SCRIPT, "alternate_steps")
    lines = alternate.summary(["a", "b"], [[0.010, 0.020, 0.030], [0.005, 0.030, 0.030]])
    assert lines[0] == "a: median 20.00 ms, fastest 10.00 ms, 1.000x the first's median, per-step ratio 1.000"
    # b's median 30 ms is 1.5x a's; its steps' ratios 0.5, 1.5, 1.0 -> median 1.0
    assert lines[1] == "b: median 30.00 ms, fastest 5.00 ms, 1.500x the first's median, per-step ratio 1.000"
