"""A screenshot of `kiln serve`'s chat page in the middle of an answer (the README's docs/img/chat.png).

    .venv/bin/python tools/web_screenshot.py ENGINE_DIR [-o docs/img/chat.png]

Serves ENGINE_DIR on a free port of 127.0.0.1, opens the page in headless Chromium (Debian's chromium +
chromium-driver, driven by Selenium from the dev extra), asks a first question and lets it finish (so an
answer shows its tokens/s and TTFT), then asks a second one and takes the picture once that answer has
streamed a few lines. Needs a real model for readable text: the default SmolLM2 engine (make build-engine).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

SYSTEM = "You are a concise, friendly assistant."
QUESTIONS = ("What is the capital of France?", "Give me three tips for writing clear documentation.")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(condition, what: str, timeout: float = 300.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}")


def serve(engine: Path, port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", str(engine), "--port", str(port)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)

    def healthy() -> bool:
        if proc.poll() is not None:
            raise SystemExit(f"kiln serve exited:\n{log.read_text()}")
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(healthy, "kiln serve to start")
    return proc


def browser(width: int, height: int) -> webdriver.Chrome:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        raise SystemExit("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--hide-scrollbars",
                f"--window-size={width},{height}"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(driver))


def answer_text(page: webdriver.Chrome) -> tuple[str, str]:
    """(state, text) of the last answer."""
    return page.execute_script("""
        const a = [...document.querySelectorAll("#messages li.assistant")].pop();
        return a ? [a.dataset.state, a.querySelector(".text").textContent] : ["", ""];""")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine", type=Path)
    parser.add_argument("-o", "--out", type=Path, default=Path("docs/img/chat.png"))
    parser.add_argument("--chars", type=int, default=160, help="take the picture once the answer shows this many")
    args = parser.parse_args()
    port, log = free_port(), Path(os.environ.get("TMPDIR", "/tmp")) / "kiln-web-screenshot.log"
    server = serve(args.engine, port, log)
    page = browser(1100, 820)
    try:
        page.get(f"http://127.0.0.1:{port}/")
        wait_for(lambda: page.find_element(By.ID, "model").text != "connecting…", "the model name")
        for field, value in (("system", SYSTEM), ("temperature", "0"), ("max-tokens", "256")):
            page.find_element(By.ID, field).clear()
            page.find_element(By.ID, field).send_keys(value, Keys.TAB)
        page.find_element(By.ID, "input").send_keys(QUESTIONS[0], Keys.ENTER)
        wait_for(lambda: answer_text(page)[0] == "done", "the first answer")
        page.find_element(By.ID, "input").send_keys(QUESTIONS[1], Keys.ENTER)
        wait_for(lambda: len(answer_text(page)[1]) >= args.chars or answer_text(page)[0] == "done",
                 "the second answer to stream")
        if answer_text(page)[0] != "streaming":
            raise SystemExit("the answer ended before the picture; lower --chars")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        page.save_screenshot(str(args.out))
        page.find_element(By.ID, "stop").click()
    finally:
        page.quit()
        server.terminate()
        server.wait(timeout=30)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
