"""The PNG charts: `kiln bench --plot` (kiln.cli.charts) from a bench report, and the peers' ratio chart
(benchmarks/peers/plot.py) from a synthetic run.py report. The plotted data is read back from the figures."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import load_script

pytest.importorskip("matplotlib")
from click.testing import CliRunner  # noqa: E402

from kiln.cli import main  # noqa: E402
from kiln.cli.charts import bench_figures, concurrency_sweep, write_bench_charts  # noqa: E402
from kiln.errors import InvalidParamError  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(concurrency: int | None, tok_s: float, ttft: float, itl: float) -> dict:
    return {"config": {"num_requests": 32, "input_len": 128, "output_len": 64, "concurrency": concurrency,
                       "request_rate": None, "seed": 0},
            "output_tok_per_s": tok_s,
            "ttft_ms": {"p50": ttft, "p90": 2 * ttft, "p99": 3 * ttft},
            "itl_ms": {"p50": itl, "p90": 1.5 * itl, "p99": 2 * itl}}


# Out of order on purpose, and the last run with every request in flight (concurrency None = 32).
REPORT = {"engine": "engines/smollm2-fp32", "runs": [_run(4, 300.0, 40.0, 9.0), _run(1, 100.0, 20.0, 8.0),
                                                     _run(None, 420.0, 900.0, 30.0), _run(2, 180.0, 25.0, 8.5)]}


def test_sweep_doubles_up_to_the_number_of_requests():
    assert concurrency_sweep(1) == (1,)
    assert concurrency_sweep(16) == (1, 2, 4, 8, 16)
    assert concurrency_sweep(24) == (1, 2, 4, 8, 16, 24)
    with pytest.raises(InvalidParamError, match="num-requests"):
        concurrency_sweep(0)


def test_bench_charts_plot_each_run_against_requests_in_flight():
    figures = bench_figures(REPORT)
    assert list(figures) == ["throughput", "ttft", "itl"]
    (line,) = figures["throughput"].axes[0].lines
    np.testing.assert_array_equal(line.get_xydata(), [[1, 100], [2, 180], [4, 300], [32, 420]])
    ttft = {ln.get_label(): ln.get_ydata().tolist() for ln in figures["ttft"].axes[0].lines}
    assert ttft == {"p50": [20, 25, 40, 900], "p90": [40, 50, 80, 1800], "p99": [60, 75, 120, 2700]}
    itl = {ln.get_label(): ln.get_ydata().tolist() for ln in figures["itl"].axes[0].lines}
    assert itl["p99"] == [16, 17, 18, 60]
    assert "32 requests of 128 in / 64 out" in figures["ttft"].axes[0].get_title()


def test_bench_charts_of_a_server_run_say_so():
    figures = bench_figures({**REPORT, "server": "http://127.0.0.1:8000"})
    assert "kiln serve at http://127.0.0.1:8000" in figures["throughput"].axes[0].get_title()


def test_bench_charts_need_two_concurrency_levels():
    with pytest.raises(InvalidParamError, match="--sweep or two or more"):
        bench_figures({**REPORT, "runs": [_run(None, 1.0, 1.0, 1.0), _run(32, 1.0, 1.0, 1.0)]})


def test_bench_charts_are_written_as_pngs(tmp_path):
    paths = write_bench_charts(REPORT, tmp_path / "charts")
    assert [p.name for p in paths] == ["throughput.png", "ttft.png", "itl.png"]
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and 5_000 < len(data) < 200_000


@pytest.mark.parametrize(("flags", "message"), [
    (["--plot", "out"], "--plot draws figures against concurrency"),
    (["--plot", "out", "--concurrency", "4", "--num-requests", "4"], "--plot draws figures against concurrency"),
    (["--sweep", "--concurrency", "2"], "--sweep or --concurrency values, not both"),
])
def test_bench_refuses_a_plot_without_a_sweep_before_running(tmp_path, flags, message):
    result = CliRunner().invoke(main, ["bench", str(tmp_path), *flags])  # no engine: it must not get that far
    assert result.exit_code == 1 and message in result.output, result.output


# ---- benchmarks/peers/plot.py -------------------------------------------------------------------------

def _load_peers_plot():
    return load_script(Path(__file__).resolve().parents[2] / "benchmarks" / "peers" / "plot.py", "peers_plot")


peers_plot = _load_peers_plot()


def _spread(median: float, low: float, high: float) -> dict:
    return {"median": median, "low": low, "high": high}


# The shape run.py writes: figures with labels and units, summary ratios per kiln/peer pair (one pair
# lacks the serving figure, as onnxruntime-genai has no server).
PEERS_REPORT = {
    "threads": 2, "rounds": [{}, {}, {}],
    "figures": {"decode_1": {"label": "single-stream decode", "unit": "tok/s"},
                "serve_ttft_p50_s": {"label": "serving: TTFT median", "unit": "s"}},
    "summary": {"ratios": {
        "kiln q4 / ort-genai int4": {"decode_1": _spread(1.2, 1.1, 1.3)},
        "kiln q4 / llama.cpp Q4_1": {"decode_1": _spread(1.5, 1.4, 1.7), "serve_ttft_p50_s": _spread(0.5, 0.4, 0.8)},
    }},
}


def test_peer_ratio_chart_has_one_bar_per_pair_and_figure():
    ax = peers_plot.ratio_figure(PEERS_REPORT).axes[0]
    bars = [c for c in ax.containers if hasattr(c, "patches")]
    assert [c.get_label() for c in bars] == ["kiln q4 / ort-genai int4", "kiln q4 / llama.cpp Q4_1"]
    assert [p.get_width() for p in bars[0].patches] == [1.2]
    # a time: drawn as peer / kiln, so right of 1 is still kiln ahead, and the range flips with it
    assert [p.get_width() for p in bars[1].patches] == pytest.approx([1.5, 2.0])
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["single-stream decode (tok/s)", "serving: TTFT median (s), peer/kiln"]
    errors = [c for c in ax.containers if not hasattr(c, "patches")]
    (_, _, (bar_lines,)) = errors[1].lines
    x_ranges = sorted(tuple(round(v, 6) for v in seg[:, 0]) for seg in bar_lines.get_segments())
    assert x_ranges == [(1.25, 2.5), (1.4, 1.7)]


def test_peer_ratio_chart_of_an_older_report_uses_the_figure_keys(tmp_path):
    old = {**PEERS_REPORT, "figures": None}
    del old["figures"]
    path = peers_plot.write_ratio_chart(json.loads(json.dumps(old)), tmp_path)
    assert path.name == "ratios.png" and path.read_bytes().startswith(PNG_MAGIC)
    ax = peers_plot.ratio_figure(old).axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["decode_1", "serve_ttft_p50_s"]
