"""Option values that can never work are refused by the CLI in one line, before anything loads."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kiln.cli import main


@pytest.mark.parametrize("args,message", [
    (["serve", "{dir}", "--port", "99999"], "'--port': 99999 is not in the range 0<=x<=65535"),
    (["serve", "{dir}", "--port", "-1"], "'--port': -1 is not in the range 0<=x<=65535"),
    (["serve", "{dir}", "--max-queue", "0"], "'--max-queue': 0 is not in the range x>=1"),
    (["serve", "{dir}", "--max-queue", "-1"], "'--max-queue': -1 is not in the range x>=1"),
    (["serve", "{dir}", "--kv-cache-bytes", "0"], "'--kv-cache-bytes': 0 is not in the range x>=1"),
    (["serve", "{dir}", "--max-model-len", "0"], "'--max-model-len': 0 is not in the range x>=1"),
    (["serve", "{dir}", "--num-threads", "0"], "'--num-threads': 0 is not in the range x>=1"),
    (["serve", "{dir}", "--shutdown-timeout", "-1"], "'--shutdown-timeout': -1.0 is not in the range x>=0"),
    (["serve", "{dir}", "--log-level", "loud"], "'--log-level': 'loud' is not one of"),
    (["serve", "{dir}", "--reasoning-parser", "r1"], "'--reasoning-parser': 'r1' is not one of"),
    (["serve", "{dir}", "--chat-template", "{dir}/missing.jinja"], "'--chat-template': File"),
    (["bench", "{dir}", "--num-requests", "0"], "'--num-requests': 0 is not in the range x>=1"),
    (["bench", "{dir}", "--concurrency", "0"], "'--concurrency': 0 is not in the range x>=1"),
    (["bench", "{dir}", "--concurrency", "4", "--concurrency", "-2"], "'--concurrency': -2 is not in the range"),
    (["bench", "{dir}", "--request-rate", "0"], "'--request-rate': 0.0 is not in the range x>0"),
])
def test_impossible_values_are_one_line(tmp_path, args, message):
    result = CliRunner().invoke(main, [a.format(dir=tmp_path) for a in args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert result.output.count("Error:") == 1


@pytest.mark.parametrize("field,value", [("num_requests", 0), ("input_len", 0), ("output_len", -1),
                                         ("concurrency", 0), ("request_rate", 0.0)])
def test_bench_config_names_the_bad_field(field, value):
    from kiln.runtime.bench.offline import BenchConfig

    with pytest.raises(ValueError, match=f"^{field} must be ") as err:
        BenchConfig(**{field: value})
    assert err.value.param == field


def test_serve_options_name_the_bad_field():
    pytest.importorskip("uvicorn")
    from kiln.runtime.server.launch import ServeOptions

    for field, value in [("port", 70000), ("max_queue", 0), ("shutdown_timeout", -1.0), ("log_level", "loud"),
                         ("api_key", ""), ("reasoning_parser", "r1")]:
        with pytest.raises(ValueError, match=f"^{field} must be ") as err:
            ServeOptions(**{field: value})
        assert err.value.param == field


@pytest.mark.parametrize("args,message", [
    (["--replicas", "0"], "'--replicas': 0 is not in the range x>=1"),
    (["--prefill-replicas", "1"], "--prefill-replicas and --decode-replicas go together"),
    (["--replicas", "2", "--prefill-replicas", "1", "--decode-replicas", "1"], "not both"),
    (["--routing", "round-robin"], "--routing needs --replicas"),
    (["--ray-address", "auto"], "--ray-address needs --replicas"),
    (["--replicas", "2", "--routing", "random"], "'--routing': 'random' is not one of"),
    (["--replicas", "2", "--allowed-media-path", "."], "--allowed-media-path is for one engine's images"),
    (["--allowed-media-path", "/nonexistent-media"], "'/nonexistent-media' does not exist"),
])
def test_replica_options_that_cannot_work_are_one_line(tmp_path, args, message):
    """Checked before Ray (or an engine) starts."""
    result = CliRunner().invoke(main, ["serve", str(tmp_path), *args])
    assert result.exit_code in (1, 2), result.output
    assert message in result.output and "Traceback" not in result.output
    assert result.output.count("Error:") == 1
