"""`kiln generate`, `kiln chat` and `kiln bench` on the tiny engine."""

import json

from click.testing import CliRunner

from kiln.cli import main
from kiln.runtime import LLM, SamplingParams


def test_generate_streams_the_same_text_as_llm(tiny_engine):
    result = CliRunner().invoke(main, ["generate", str(tiny_engine), "hello there", "--max-tokens", "12"])
    assert result.exit_code == 0, result.output
    expected = LLM(tiny_engine).generate("hello there", SamplingParams(temperature=0, max_tokens=12))
    assert result.output == expected[0].outputs[0].text + "\n"


def test_generate_needs_exactly_one_prompt(tiny_engine):
    result = CliRunner().invoke(main, ["generate", str(tiny_engine)])
    assert result.exit_code == 1 and "Error: give exactly one of PROMPT or --chat" in result.output


def test_chat_repl_keeps_history(tiny_engine):
    result = CliRunner().invoke(main, ["chat", str(tiny_engine), "--max-tokens", "4"],
                                input="hi\n/reset\nhello again\n/exit\n")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("kiln chat with engine")
    assert result.output.count("> ") >= 3


def test_bench_reports_json(tiny_engine, tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(main, [
        "bench", str(tiny_engine), "--num-requests", "4", "--input-len", "16", "--output-len", "4",
        "--concurrency", "1", "--concurrency", "4", "--json", str(out),
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [r["config"]["concurrency"] for r in report["runs"]] == [1, 4]
    run = report["runs"][1]
    assert run["output_tok_per_s"] > 0 and run["kv_blocks_peak"] > 0
    assert set(run["ttft_ms"]) == {"p50", "p90", "p99"}
    assert report["memory_bandwidth"]["read_gbps"] > 0 and report["weight_bytes_per_token"] > 0
    assert report["single_stream"]["decode_tok_per_s"] > 0
