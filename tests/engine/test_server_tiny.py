"""`kiln serve` on the tiny engine as a subprocess: the serve flags (the API key from $KILN_API_KEY,
--max-model-len, --chat-template, --num-threads, --disable-prefix-caching, --max-queue,
--max-num-batched-tokens), the
start-up summary and the request log, sizes refused before the port is bound, and shutdown past
--shutdown-timeout (streams end with an error event and [DONE], no traceback, exit 0)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from server_process import Server  # noqa: E402

KEY = "sk-tiny-secret"
TEMPLATE = ("{% for m in messages %}<<{{ m.role }}:{{ m.content }}>>{% endfor %}"
            "{% if add_generation_prompt %}<<assistant:{% endif %}")


@pytest.fixture(scope="module")
def server(tiny_engine, tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-flags")
    (folder / "chat.jinja").write_text(TEMPLATE)
    srv = Server(tiny_engine, folder / "server.log", "--served-model-name", "tiny", "--max-model-len", "256",
                 "--chat-template", str(folder / "chat.jinja"), "--num-threads", "1", "--disable-prefix-caching",
                 "--max-queue", "8", "--max-num-batched-tokens", "96", "--no-access-log",
                 env={"KILN_API_KEY": KEY}, api_key=KEY)
    yield srv
    assert srv.stop() == 0


def test_startup_summary_names_pool_context_threads(server):
    log = server.log_path.read_text()
    assert re.search(r"KV pool: \d+ blocks of 16 tokens = \d+ tokens, [\d.]+ MiB; max context 256 tokens; "
                     r"step budget 96 tokens; threads: 1; prefix caching: off", log), log
    assert "as 'tiny'" in log and "queue bound 8" in log and "API key required" in log


def test_flags_through_the_official_client(server):
    client = server.client()
    assert client.models.retrieve("tiny").model_extra["max_model_len"] == 256
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200  # probes need no key
    with pytest.raises(openai.BadRequestError, match=r"max_seq_len \(256\)") as err:
        client.completions.create(model="tiny", prompt="Hello", max_tokens=300)
    assert err.value.body["param"] == "max_tokens"
    done = client.completions.create(model="tiny", prompt="Hello", max_tokens=4.0, temperature=0,  # type: ignore
                                     extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 4
    log = server.log_path.read_text()
    assert re.search(rf"{done.id}: prompt_tokens={done.usage.prompt_tokens} output_tokens=4 finish_reason=length "
                     r"latency=\d+\.\d+s", log)
    assert "POST /v1/completions" not in log  # --no-access-log: kiln's request line without uvicorn's


def test_bench_against_a_server_with_a_key(server, tiny_engine, capsys):
    from kiln.runtime.bench.offline import BenchConfig
    from kiln.runtime.bench.serving import bench_server

    (run,) = bench_server(server.url, str(tiny_engine), BenchConfig(num_requests=4, input_len=8, output_len=4), (2,),
                          api_key=KEY)["runs"]
    assert run["num_errors"] == 0 and run["output_tok_per_s"] > 0 and run["kv_blocks_total"] > 0
    capsys.readouterr()


def test_prefix_caching_is_off(server):
    prompt = list(range(3, 60))  # 57 tokens: three full blocks a prefix cache would find the second time
    for _ in range(2):
        done = server.client().completions.create(model="tiny", prompt=prompt, max_tokens=1)
        assert done.usage.prompt_tokens_details.cached_tokens == 0


def test_the_chat_template_file_is_the_one_applied(server):
    messages = [{"role": "user", "content": "hi there"}]
    post = lambda body: httpx.post(server.url + "/tokenize", json=body, headers=server.headers, timeout=5).json()  # noqa: E731
    rendered = post({"prompt": "<<user:hi there>><<assistant:", "add_special_tokens": False,
                     "return_token_strs": True})
    assert post({"messages": messages})["tokens"] == rendered["tokens"]
    assert len(rendered["token_strs"]) == rendered["count"] and all(rendered["token_strs"])
    text = httpx.post(server.url + "/detokenize", json={"tokens": rendered["tokens"]}, headers=server.headers,
                      timeout=5).json()["prompt"]
    assert text == "<<user:hi there>><<assistant:"
    reply = server.client().chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0)
    assert reply.usage.prompt_tokens == rendered["count"]


@pytest.mark.parametrize("args,message", [
    (["--kv-cache-bytes", "1"], "kv_cache_bytes 1 holds no block of 16 tokens"),
    (["--kv-cache-bytes", "1", "--max-model-len", "64"],
     "kv_cache_bytes 1 holds 0 tokens but one sequence of max_model_len 64 tokens needs"),
    (["--kv-cache-bytes", str(1 << 50)], "is more than the available memory"),
    (["--max-model-len", "4096"], "max_model_len 4096 exceeds the engine's max_seq_len 2048"),
])
def test_impossible_sizes_are_refused_before_binding(tiny_engine, args, message):
    result = subprocess.run([sys.executable, "-m", "kiln.cli", "serve", str(tiny_engine), "--port", "1", *args],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("Error: ") and message in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_shutdown_past_the_deadline_ends_streams_with_error_and_done(tiny_engine, tmp_path):
    srv = Server(tiny_engine, tmp_path / "server.log", "--shutdown-timeout", "0.5")
    body = {"prompt": "Count:", "max_tokens": 2000, "ignore_eos": True, "stream": True, "temperature": 0}
    results: list[list[str]] = [[] for _ in range(4)]
    started = threading.Barrier(len(results) + 1)

    def stream(events: list[str]) -> None:
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            for n, line in enumerate(line for line in r.iter_lines() if line.startswith("data: ")):
                events.append(line[len("data: "):])
                if n == 0:
                    started.wait()

    try:
        threads = [threading.Thread(target=stream, args=(events,)) for events in results]
        for t in threads:
            t.start()
        started.wait(timeout=60)  # every stream is running
        srv.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=60)
        assert srv.proc.wait(timeout=30) == 0
    finally:
        srv.stop()
    for events in results:
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "server_shutting_down" and "0.5 s deadline" in error["message"]
        assert 0 < len(events) - 2 < 2000  # streamed some, was cut
    log = srv.log_path.read_text()
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert len(re.findall(r"finish_reason=abort,? ", log)) == len(results)  # each logged as aborted
