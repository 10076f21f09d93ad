"""`kiln serve ENGINE` as a subprocess on a free port of 127.0.0.1, for end-to-end tests.

    server = ServeProcess(engine, log_path, "--max-num-seqs", "8")
    server.metric("kiln_kv_cache_blocks_used"); server.aborted(); server.stop()  # -> exit code
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServeProcess:
    def __init__(self, engine: Path, log: Path, *extra: str, startup_timeout: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log)
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.cli", "serve", str(engine), "--port", str(self.port), *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kiln serve exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"kiln serve did not answer /health in {startup_timeout} s:\n{self.log_path.read_text()}")

    def metrics_text(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5).text

    def metric(self, name: str) -> float:
        found = re.search(rf"^{re.escape(name)} (\S+)$", self.metrics_text(), re.M)
        if found is None:
            raise KeyError(f"/metrics has no sample {name}")
        return float(found.group(1))

    def aborted(self) -> float:
        """Requests the server aborted: kiln_request_abort_total where the server has that counter (issue 14),
        else the "abort" finish reason of kiln_request_success_total."""
        text = self.metrics_text()
        samples = re.findall(r'^kiln_request_abort_total (\S+)$', text, re.M)
        samples += re.findall(r'^kiln_request_success_total\{finish_reason="abort"\} (\S+)$', text, re.M)
        return sum(float(s) for s in samples)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        return self.proc.wait()
