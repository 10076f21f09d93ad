"""`kiln serve` as a real subprocess for end-to-end tests: started on a free port, waited for
until /health answers, read through the official openai client, /metrics, and its log."""

from __future__ import annotations

import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, engine: Path, log: Path, *extra: str, env: dict[str, str] | None = None,
                 api_key: str = "none", tls_ca: Path | None = None):
        """tls_ca: the server runs with --ssl-* flags (in ``extra``); clients trust this CA file."""
        self.verify: bool | ssl.SSLContext = ssl.create_default_context(cafile=str(tls_ca)) if tls_ca else True
        self.api_key = api_key
        self.log_path = log
        # The port is free when chosen but bound only once the engine has loaded, and what starts meanwhile (Ray's
        # services, for --pipeline-parallel) may take it: then the server exits saying so, and starts on another.
        for _ in range(3):
            if self._start(engine, extra, env, "https" if tls_ca else "http"):
                return
        raise AssertionError(Path(log).read_text())

    def _start(self, engine: Path, extra: tuple[str, ...], env: dict[str, str] | None, scheme: str) -> bool:
        """True once /health answers; False when the server exited because its port was taken."""
        self.port = _free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.cli", "serve", str(engine), "--port", str(self.port), *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.close()
                text = self.log_path.read_text()
                assert "address already in use" in text, text
                return False
            try:
                if httpx.get(self.url + "/health", timeout=1, verify=self.verify).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(self.log_path.read_text())

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def client(self, **kw):
        if self.verify is not True:
            kw.setdefault("http_client", httpx.Client(verify=self.verify))
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key, max_retries=0, **kw)

    def async_client(self, **kw):
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key, max_retries=0, **kw)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=5, verify=self.verify).text
        return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))

    def finished(self) -> dict[str, float]:
        """kiln_request_success_total by finish reason."""
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=5).text
        pattern = r'^kiln_request_success_total\{finish_reason="(\w+)"\} (\S+)$'
        return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.M)}

    def aborted(self) -> float:
        """kiln_request_abort_total: completions cut short (not a finish reason of success)."""
        return self.metric("kiln_request_abort_total")

    def rss_bytes(self) -> int:
        """The server process's resident memory now (Linux /proc)."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) * 1024

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        return self.proc.wait()
