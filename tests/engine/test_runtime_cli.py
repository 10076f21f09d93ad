"""`kiln generate`, `kiln chat` and `kiln bench` on the tiny engine."""

import json

import pytest
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
    # 16 + 4 tokens need 2 blocks of 16 (the last sampled token is never fed back); every
    # sequence is prefilled in one step and decoded in 3 more, no preemption in a roomy pool
    assert [(r["steps"], r["kv_blocks_peak"], r["num_preemptions"]) for r in report["runs"]] == [(16, 2, 0), (4, 8, 0)]
    for run in report["runs"]:  # 4 requests of 4 output tokens over elapsed_s (rounded to 0.1 ms)
        elapsed = run["elapsed_s"]
        assert 16 / (elapsed + 5e-5) - 0.01 <= run["output_tok_per_s"] <= 16 / (elapsed - 5e-5) + 0.01
        assert run["output_tok_per_s"] == pytest.approx(4 * run["requests_per_s"], rel=1e-4)
        assert run["ttft_ms"]["p50"] <= run["ttft_ms"]["p90"] <= run["ttft_ms"]["p99"] <= 1e3 * run["elapsed_s"]
    weights = sum(p.stat().st_size for p in tiny_engine.glob("model.onnx*"))
    assert report["weight_bytes_per_token"] == weights
    bound = report["memory_bandwidth"]["read_gbps"] * 1e9 / weights
    assert report["bandwidth_bound_decode_tok_per_s"] == pytest.approx(bound, rel=1e-2)
    assert report["single_stream"]["decode_tok_per_s"] > 0  # a timing: nothing to hold it to


def test_generate_with_speculation_streams_the_same_text(tiny_engine):
    prompt = "ab ab ab ab ab ab"
    plain = CliRunner().invoke(main, ["generate", str(tiny_engine), prompt, "--max-tokens", "24"])
    for method in (["ngram"], ["draft", "--draft", str(tiny_engine)]):  # the engine as its own draft
        result = CliRunner().invoke(main, ["generate", str(tiny_engine), prompt, "--max-tokens", "24",
                                           "--speculative", *method[:1], "--num-speculative-tokens", "3",
                                           *method[1:]])
        assert result.exit_code == 0, result.output
        assert result.output == plain.output, method


def test_speculative_options_are_checked(tiny_engine):
    result = CliRunner().invoke(main, ["generate", str(tiny_engine), "hi", "--speculative", "draft"])
    assert result.exit_code == 1 and "--speculative draft needs --draft ENGINE_DIR" in result.output
    result = CliRunner().invoke(main, ["generate", str(tiny_engine), "hi", "--speculative", "medusa"])
    assert result.exit_code == 1 and "needs Medusa heads in the engine" in result.output
    result = CliRunner().invoke(main, ["generate", str(tiny_engine), "hi", "--speculative", "ngram",
                                       "--num-speculative-tokens", "0"])
    assert result.exit_code == 1 and "num_speculative_tokens must be in [1, 32]" in result.output


def test_bench_reports_speculation(tiny_engine, tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(main, [
        "bench", str(tiny_engine), "--num-requests", "2", "--input-len", "16", "--output-len", "8",
        "--concurrency", "1", "--speculative", "draft", "--draft", str(tiny_engine), "--json", str(out),
    ])
    assert result.exit_code == 0, result.output
    spec = json.loads(out.read_text())["runs"][0]["speculative"]
    assert spec["acceptance_rate"] == 1.0 and spec["tokens_per_verification"] > 1  # the target as its own draft
    assert "speculative: acceptance rate 1.0" in result.output
