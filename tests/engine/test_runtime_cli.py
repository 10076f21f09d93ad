"""`kiln generate`, `kiln chat` and `kiln bench` on the tiny engine."""

import json
import os
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner

from kiln.cli import main
from kiln.optimize.weight_bytes import weight_bytes_per_token
from kiln.runtime import LLM, SamplingParams
from kiln.runtime.ops import library_variant


def test_generate_streams_the_same_text_as_llm(tiny_engine):
    result = CliRunner().invoke(main, ["generate", str(tiny_engine), "hello there", "--max-tokens", "12"])
    assert result.exit_code == 0, result.output
    expected = LLM(tiny_engine).generate("hello there", SamplingParams(temperature=0, max_tokens=12))
    assert result.output == expected[0].outputs[0].text + "\n"


def test_generate_needs_exactly_one_prompt(tiny_engine):
    result = CliRunner().invoke(main, ["generate", str(tiny_engine)])
    assert result.exit_code == 1 and "Error: give exactly one of PROMPT or --chat" in result.output


def test_generate_runs_on_a_plain_install(tiny_engine):
    """`pip install kiln` with no extras serves an engine dir: no torch, onnx, fastapi... is imported."""
    from blocked_extras import command_line

    result = subprocess.run(command_line("compile,server", "generate", str(tiny_engine), "hello there",
                                         "--max-tokens", "12"), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    expected = LLM(tiny_engine).generate("hello there", SamplingParams(temperature=0, max_tokens=12))
    assert result.stdout == expected[0].outputs[0].text + "\n"


def _chat(tiny_engine, lines: str, *options: str) -> list[str]:
    result = CliRunner().invoke(main, ["chat", str(tiny_engine), *options], input=lines)
    assert result.exit_code == 0, result.output
    head, *turns = result.output.split("> ")
    assert head == "kiln chat with engine (/help lists the commands)\n"
    return turns


def _reply(tiny_engine, messages: list[dict], max_tokens: int):
    llm = LLM(tiny_engine)
    prompt = llm.engine.tokenizer.apply_chat_template(messages)
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))[0].outputs[0]


def test_chat_commands_answer_and_are_never_sent_to_the_model(tiny_engine):
    turns = _chat(tiny_engine, "/help\n/frobnicate now\n/reset\n/exit\n")
    assert turns[0] == ("  /help   list these commands\n  /reset  forget the conversation (a --system message stays)\n"
                        "  /exit   quit (as do Ctrl-D and Ctrl-C at the prompt)\n"
                        "  //...   send a message that starts with /\n")
    assert turns[1] == "[unknown command /frobnicate; /help lists the commands]\n"
    assert turns[2] == "[conversation cleared]\n"
    assert turns[3:] == [""]  # /exit: nothing more, exit 0


def test_chat_keeps_history_until_reset_and_marks_a_cut_reply(tiny_engine):
    """Each reply is the model's answer to the whole conversation; /reset starts over; a reply stopped by
    --max-tokens ends with a mark (the tiny random model rarely stops by itself within 3 tokens)."""
    first = _reply(tiny_engine, [{"role": "user", "content": "hi"}], 3)
    second = _reply(tiny_engine, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first.text},
                                  {"role": "user", "content": "again"}], 3)
    assert first.finish_reason == second.finish_reason == "length"
    turns = _chat(tiny_engine, "hi\nagain\n/reset\nhi\n", "--max-tokens", "3")
    mark = " [cut at --max-tokens 3]\n"
    assert turns == [first.text + mark, second.text + mark, "[conversation cleared]\n", first.text + mark, "\n"]


def test_bench_takes_the_step_token_budget(tiny_engine, tmp_path):
    """--max-num-batched-tokens 8 splits each 16-token prompt over two steps (4 requests one at a time:
    2 + 3 steps each instead of 1 + 3); more than the engine was built for is refused."""
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(main, [
        "bench", str(tiny_engine), "--num-requests", "4", "--input-len", "16", "--output-len", "4",
        "--concurrency", "1", "--max-num-batched-tokens", "8", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["runs"][0]["steps"] == 20
    result = CliRunner().invoke(main, ["bench", str(tiny_engine), "--max-num-batched-tokens", "4096"])
    assert result.exit_code == 1
    assert "max_num_tokens 4096 is more than the 2048 tokens per step this engine was built for" in result.output


def test_ctrl_c_at_the_chat_prompt_exits_quietly(tiny_engine):
    chat = subprocess.Popen([sys.executable, "-m", "kiln.cli", "chat", str(tiny_engine)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        shown = ""
        while not shown.endswith("> "):
            char = chat.stdout.read(1)
            assert char, chat.stderr.read()
            shown += char
        chat.send_signal(signal.SIGINT)
        stdout, stderr = chat.communicate(timeout=60)
    finally:
        chat.kill()
    assert (chat.returncode, stdout, stderr) == (0, "\n", "")


def test_ctrl_c_while_the_prompt_is_shown_also_exits_quietly(tiny_engine):
    """The signal may land between showing "> " and reading the line (the subprocess test above races on it)."""
    import io

    from kiln.cli.generation import chat_repl

    class InterruptedOnFlush(io.StringIO):
        def flush(self):
            if self.getvalue().endswith("> "):
                raise KeyboardInterrupt

    out = InterruptedOnFlush()
    try:
        chat_repl(str(tiny_engine), SamplingParams(temperature=0), inp=io.StringIO("hi\n"), out=out)
    except KeyboardInterrupt:  # escaping would stop pytest itself, not fail this test
        pytest.fail("Ctrl-C just after the prompt was shown escaped chat_repl")
    assert out.getvalue() == "kiln chat with engine (/help lists the commands)\n> \n"


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
    # the graph's initializers a step reads: fewer than the files hold (the embedding table is gathered)
    weights = report["weight_bytes_per_token"]
    assert report["weight_bytes_counted_from"] == "graph"
    assert weights == weight_bytes_per_token(tiny_engine)
    assert 0 < weights < sum(p.stat().st_size for p in tiny_engine.glob("model.onnx*"))
    assert report["op_library"] == library_variant()  # the kernels' copy this CPU loads, named in the report
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
    result = CliRunner().invoke(main, ["generate", str(tiny_engine), "hi", "--speculative", "ngram",
                                       "--min-guess-probability", "0.2"])
    assert result.exit_code == 1 and "--min-guess-probability needs --speculative medusa" in result.output


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
