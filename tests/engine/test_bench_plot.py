"""`kiln bench --sweep --plot DIR` on the tiny engine: one run per concurrency level, charts of those runs."""

import json

import pytest
from click.testing import CliRunner

from kiln.cli import main

pytest.importorskip("matplotlib")


def test_bench_sweep_writes_charts_of_its_runs(tiny_engine, tmp_path):
    from kiln.cli.charts import bench_figures

    report_path, charts = tmp_path / "bench.json", tmp_path / "charts"
    result = CliRunner().invoke(main, [
        "bench", str(tiny_engine), "--num-requests", "6", "--input-len", "16", "--output-len", "4",
        "--sweep", "--plot", str(charts), "--json", str(report_path),
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
    assert [r["config"]["concurrency"] for r in report["runs"]] == [1, 2, 4, 6]
    assert sorted(p.name for p in charts.iterdir()) == ["itl.png", "throughput.png", "ttft.png"]
    (line,) = bench_figures(report)["throughput"].axes[0].lines
    assert line.get_xydata().tolist() == [[r["config"]["concurrency"], r["output_tok_per_s"]] for r in report["runs"]]
