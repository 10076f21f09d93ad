"""benchmarks/peers' pure pieces: the medians/ratios table and the parsing of llama.cpp's bench output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import load_script

PEERS = Path(__file__).resolve().parents[2] / "benchmarks" / "peers"


def _load(name: str):
    return load_script(PEERS / f"{name}.py", f"peers_{name}")


report = _load("report")
llama = _load("llama")

# Recorded here from `llama-bench -t 2 -p 512 -n 0 -r 1 -o json` (fields abridged; those read kept).
LLAMA_BENCH_JSON = """[
  {
    "build_commit": "unknown",
    "model_type": "llama 256M Q4_1",
    "n_threads": 2,
    "n_prompt": 512,
    "n_gen": 0,
    "n_depth": 0,
    "test_time": "2026-12-01T06:53:09Z",
    "avg_ns": 1095049514,
    "stddev_ns": 0,
    "avg_ts": 467.558766,
    "stddev_ts": 0.000000,
    "samples_ns": [ 1095049514 ],
    "samples_ts": [ 467.559 ]
  }
]
"""

# Recorded here from `llama-batched-bench ... -npp 36 -ntg 32 -npl 16,32 -kvu --output-format jsonl`
# (run.py runs one -npl per process), with a non-JSON line as the tool may print around its rows.
BATCHED_BENCH_JSONL = """main: n_kv_max = 8192, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0
{"n_kv_max": 8192, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, \
"n_threads": 2, "n_threads_batch": 2, "pp": 36, "tg": 32, "pl": 16, "n_kv": 1088, "t_pp": 1.179325, \
"speed_pp": 488.414978, "t_tg": 1.518555, "speed_tg": 337.162628, "t": 2.697880, "speed": 403.279602}
{"n_kv_max": 8192, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, \
"n_threads": 2, "n_threads_batch": 2, "pp": 36, "tg": 32, "pl": 32, "n_kv": 2176, "t_pp": 2.329155, \
"speed_pp": 494.599976, "t_tg": 13.130914, "speed_tg": 77.983910, "t": 15.460069, "speed": 140.749695}
"""


def test_llama_bench_gives_prefill_speed_by_prompt_length():
    assert llama.parse_llama_bench(LLAMA_BENCH_JSON) == {512: pytest.approx(467.558766)}


def test_batched_bench_aggregate_counts_generated_tokens_only():
    rows = llama.parse_batched_bench(BATCHED_BENCH_JSONL)
    assert sorted(rows) == [16, 32]
    assert rows[16]["decode_tok_per_s"] == pytest.approx(337.162628)
    # the tool's own "speed" counts prompt tokens too; the peers table counts generated tokens
    assert rows[16]["aggregate_tok_per_s"] == pytest.approx(16 * 32 / 2.697880)
    assert rows[32]["aggregate_tok_per_s"] == pytest.approx(32 * 32 / 15.460069)


def test_batched_bench_command_runs_one_parallel_count_over_one_kv_cache():
    cmd = llama.batched_bench_cmd(Path("bin/llama-batched-bench"), Path("m.gguf"), 2, 37, 128, 32)
    assert cmd[cmd.index("-npl") + 1] == "32" and cmd[cmd.index("-npp") + 1] == "37"
    assert cmd[cmd.index("--output-format") + 1] == "jsonl"
    assert "-kvu" in cmd  # one shared KV cache: llama.cpp's fast setting for many sequences


ROUNDS = [
    {"peer": {"decode_1": 100.0, "prefill_512": 600.0}, "kiln a": {"decode_1": 80.0, "prefill_512": 900.0}},
    {"peer": {"decode_1": 120.0, "prefill_512": 500.0}, "kiln a": {"decode_1": 120.0, "prefill_512": 1000.0}},
    {"peer": {"decode_1": 90.0, "prefill_512": 700.0}, "kiln a": {"decode_1": 81.0, "prefill_512": 700.0}},
]
FIGURES = [report.Figure("prefill_512", "prefill", "tok/s"), report.Figure("decode_1", "decode", "tok/s"),
           report.Figure("serve_output_tok_s", "serving", "tok/s")]


def test_ratios_are_taken_within_each_round_then_summarized():
    ratios = report.ratios_of(ROUNDS, "kiln a", "peer", "decode_1")
    assert ratios == pytest.approx([0.8, 1.0, 0.9])
    s = report.spread(ratios)
    assert (s.median, s.low, s.high) == pytest.approx((0.9, 0.8, 1.0))


def test_table_shows_medians_ratios_with_ranges_and_dashes_for_missing_figures():
    text = report.table(ROUNDS, FIGURES, ["kiln a"], ["peer"])
    header, rule, prefill, decode, serving = text.splitlines()
    assert header == "| figure | peer | kiln a | kiln a / peer |"
    assert rule == "|---|---|---|---|"
    assert prefill == "| prefill (tok/s) | 600 | 900 | 1.50× [1.00–2.00] |"
    assert decode == "| decode (tok/s) | 100 | 81 | 0.90× [0.80–1.00] |"
    assert serving == "| serving (tok/s) | — | — | — |"


def test_summary_is_json_ready_and_holds_the_table_numbers():
    out = report.summary(ROUNDS, FIGURES, ["kiln a"], ["peer"])
    assert out["medians"]["peer"]["prefill_512"] == {"median": 600.0, "low": 500.0, "high": 700.0}
    assert out["ratios"]["kiln a / peer"]["decode_1"]["median"] == pytest.approx(0.9)
    assert "serve_output_tok_s" not in out["medians"]["peer"]
    json.dumps(out)


def test_figure_needs_a_key_and_a_label():
    with pytest.raises(ValueError, match="key and label"):
        report.Figure("", "x", "tok/s")


def test_a_tally_shows_its_medians_but_no_ratio():
    rounds = [{"peer": {"serve_failed": 2.0}, "kiln a": {"serve_failed": 0.0}},
              {"peer": {"serve_failed": 4.0}, "kiln a": {"serve_failed": 0.0}}]
    text = report.table(rounds, [report.Figure("serve_failed", "failed", "count")], ["kiln a"], ["peer"])
    assert text.splitlines()[-1] == "| failed (count) | 3 | 0 | — |"
