"""The chat page at / in a real browser: headless Chromium (Debian's chromium + chromium-driver) driven by
Selenium against `kiln serve` of the tiny engine on 127.0.0.1.

The tiny engine's greedy answer to "Hi!" is 't' for every one of 1500 tokens, one character per step, so the
page's text grows token by token for seconds: long enough to watch it stream and to stop it mid-way. What the
page sent is read back from Chromium's network log, and what it shows is compared with LLM.chat's answer and
with the server's own error message.
"""

from __future__ import annotations

import json
import re
import shutil
import time

import httpx
import pytest

pytest.importorskip("selenium")
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip("no headless Chromium here (apt-get install chromium chromium-driver)", allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from server_process import Server  # noqa: E402

from kiln.runtime import LLM, SamplingParams  # noqa: E402

LONG = 1500  # tokens of the streamed answers (the tiny engine's max_seq_len is 2048)


@pytest.fixture(scope="module")
def server(tiny_engine, tmp_path_factory):
    srv = Server(tiny_engine, tmp_path_factory.mktemp("web") / "server.log")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def reference(tiny_engine):
    llm = LLM(tiny_engine)

    def answer(messages: list[dict], max_tokens: int) -> str:
        return llm.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens))[0].outputs[0].text

    return answer


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,800"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


@pytest.fixture
def page(browser, server):
    """The page, freshly loaded with empty localStorage, greedy and long answers."""
    browser.get(server.url + "/")
    browser.execute_script("localStorage.clear()")
    browser.refresh()
    wait_for(lambda: browser.find_element(By.ID, "model").text != "connecting…", "the model name")
    set_field(browser, "temperature", "0")
    set_field(browser, "max-tokens", str(LONG))
    browser.get_log("performance")  # drop what loading the page logged
    return browser


def wait_for(condition, what: str, timeout: float = 60.0, poll: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def set_field(driver, field_id: str, value: str) -> None:
    """Type into a field and leave it (the page saves settings on change)."""
    field = driver.find_element(By.ID, field_id)
    field.clear()
    field.send_keys(value, Keys.TAB)


def ask(driver, text: str) -> None:
    driver.find_element(By.ID, "input").send_keys(text, Keys.ENTER)


def answers(driver) -> list:
    return driver.find_elements(By.CSS_SELECTOR, "#messages li.assistant")


def text_of(element) -> str:
    return element.find_element(By.CSS_SELECTOR, ".text").get_property("textContent")


def shown(text: str) -> str:
    """What an answer without Markdown syntax shows once rendered: its characters, less the blank lines and breaks
    between blocks that rendering turns into spacing."""
    assert not set(text) & set("*_`#[]>~"), f"this answer holds Markdown syntax: {text!r}"
    return "".join(text.split())


def finished(driver):
    """The last answer once it is no longer streaming."""
    items = answers(driver)
    return items[-1] if items and items[-1].get_attribute("data-state") != "streaming" else None


def sent_requests(driver, path: str) -> list[dict]:
    """The requests to URLs ending in ``path`` in Chromium's network log since it was last read (which empties
    it): {url, method, headers, body}."""
    found = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] != "Network.requestWillBeSent":
            continue
        request = message["params"]["request"]
        if request["url"].endswith(path):
            body = json.loads(request["postData"]) if request.get("postData") else None
            found.append({"url": request["url"], "method": request["method"], "headers": request["headers"],
                          "body": body})
    return found


def test_page_loads_its_assets_and_names_the_model(page, server):
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert page.find_element(By.ID, "model").text == f"{card['id']} · {card['max_model_len']} tokens"
    assert page.execute_script("return document.styleSheets.length") == 1  # chat.css applied under the CSP
    severe = [e for e in page.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, severe  # a CSP violation or a failed asset load would be logged here


# Records the last answer's text length after every change the page makes to it (a MutationObserver sees each
# render, however loaded the machine is; polling the DOM from the test could miss most of them).
WATCH_TEXT_LENGTHS = """
window.textLengths = [];
new MutationObserver(() => {
  const answer = [...document.querySelectorAll("#messages li.assistant .text")].pop();
  if (answer) window.textLengths.push(answer.textContent.length);
}).observe(document.getElementById("messages"), {subtree: true, childList: true, characterData: true});
"""


def test_an_answer_streams_token_by_token(page, reference):
    page.execute_script(WATCH_TEXT_LENGTHS)
    ask(page, "Hi!")
    item = wait_for(lambda: (answers(page) or [None])[-1], "the answer to appear")
    wait_for(lambda: item.get_attribute("data-state") != "streaming", "the answer to finish", timeout=120)
    seen = set(page.execute_script("return window.textLengths"))
    expected = reference([{"role": "user", "content": "Hi!"}], LONG)
    assert item.get_attribute("data-state") == "done"
    assert text_of(item) == expected and len(expected) == LONG
    partial = {n for n in seen if 0 < n < LONG}
    assert len(partial) >= 5, f"the text grew in too few steps while streaming: {sorted(seen)}"
    stats = item.find_element(By.CSS_SELECTOR, ".stats").text
    assert re.fullmatch(rf"{LONG} tokens · \d+\.\d tok/s · TTFT \d+ ms", stats), stats
    assert float(stats.split(" · ")[1].split()[0]) > 0


def test_history_system_prompt_settings_and_regenerate(page, reference):
    set_field(page, "system", "Be brief.")
    set_field(page, "max-tokens", "8")
    ask(page, "Hi!")
    wait_for(lambda: finished(page), "the first answer")
    ask(page, "Again")
    wait_for(lambda: len(answers(page)) == 2 and finished(page), "the second answer")
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    conversation += [{"role": "assistant", "content": reference(conversation, 8)}, {"role": "user", "content": "Again"}]
    second = sent_requests(page, "/v1/chat/completions")[-1]["body"]
    assert second["messages"] == conversation
    assert (second["temperature"], second["max_tokens"], second["stream"]) == (0, 8, True)
    assert shown(text_of(answers(page)[-1])) == shown(reference(conversation, 8))  # the tiny model writes "\n"s

    page.find_element(By.ID, "regenerate").click()
    wait_for(lambda: finished(page) and not page.find_element(By.ID, "regenerate").get_attribute("disabled"),
             "the regenerated answer")
    assert len(answers(page)) == 2  # the last answer was replaced, not added to
    assert sent_requests(page, "/v1/chat/completions")[-1]["body"] == second
    assert shown(text_of(answers(page)[-1])) == shown(reference(conversation, 8))  # the tiny model writes "\n"s
    page.refresh()  # settings outlive the page
    assert page.find_element(By.ID, "system").get_property("value") == "Be brief."
    assert page.find_element(By.ID, "max-tokens").get_property("value") == "8"


# Clicks Stop from inside the page once the streaming answer shows `arguments[0]` characters: a WebDriver round
# trip can take longer than the whole answer on a loaded machine, so the watch cannot run on the test's side.
STOP_AFTER = """
const [chars, done] = arguments;
const timer = setInterval(() => {
  const answer = [...document.querySelectorAll("#messages li.assistant")].pop();
  const shown = answer ? answer.querySelector(".text").textContent.length : 0;
  if (shown >= chars || (answer && answer.dataset.state !== "streaming")) {
    clearInterval(timer);
    if (answer.dataset.state === "streaming") document.getElementById("stop").click();
    done(shown);
  }
}, 2);
"""


def test_stop_aborts_the_request_and_frees_its_blocks(page, server, reference):
    aborted = server.aborted()
    ask(page, "Hi!")
    page.set_script_timeout(60)
    at_click = page.execute_async_script(STOP_AFTER, 10)
    item = answers(page)[-1]
    wait_for(lambda: item.get_attribute("data-state") != "streaming", "the answer to stop")
    assert item.get_attribute("data-state") == "stopped"
    shown, expected = text_of(item), reference([{"role": "user", "content": "Hi!"}], LONG)
    assert 10 <= at_click <= len(shown) < len(expected) and expected.startswith(shown)
    assert item.find_element(By.CSS_SELECTOR, ".stats").text.endswith(" · stopped")
    wait_for(lambda: server.aborted() == aborted + 1, "the server's abort counter to rise", timeout=10)
    wait_for(lambda: server.metric("kiln_kv_cache_blocks_used") == 0, "the KV pool to be free", timeout=10)
    assert server.metric("kiln_num_requests_running") == 0
    assert page.find_element(By.ID, "send").is_displayed() and not page.find_element(By.ID, "stop").is_displayed()


def test_a_server_error_shows_the_servers_message(page, server):
    prompt = "x" * 3000  # 3000 byte tokens: longer than the engine's 2048 before any max_tokens
    field = page.find_element(By.ID, "input")
    page.execute_script("arguments[0].value = arguments[1]", field, prompt)  # typing 3000 keys takes long
    page.find_element(By.ID, "send").click()
    item = wait_for(lambda: finished(page), "the error")
    sent = sent_requests(page, "/v1/chat/completions")[-1]
    resp = httpx.post(server.url + "/v1/chat/completions", json=sent["body"])  # the page's request, replayed
    assert resp.status_code == 400
    assert item.get_attribute("data-state") == "error"
    assert text_of(item) == resp.json()["error"]["message"]
    assert "max_seq_len" in text_of(item)
    user = page.find_elements(By.CSS_SELECTOR, "#messages li.user")[-1]
    assert "unsent" in user.get_attribute("class")  # out of the history; its text is back in the input box
    assert field.get_property("value") == prompt

    field.clear()  # the next message clears the failed exchange and is sent without it
    set_field(page, "max-tokens", "4")
    ask(page, "Hi!")
    wait_for(lambda: finished(page), "the next answer")
    assert page.find_elements(By.CSS_SELECTOR, "#messages li.failed") == []
    assert [li.get_attribute("data-state") for li in answers(page)] == ["done"]
    assert sent_requests(page, "/v1/chat/completions")[-1]["body"]["messages"] == [{"role": "user", "content": "Hi!"}]


def test_the_api_key_is_kept_in_the_browser_and_sent_as_bearer(page):
    set_field(page, "api-key", "sk-kiln-test")
    page.refresh()
    assert page.find_element(By.ID, "api-key").get_property("value") == "sk-kiln-test"
    assert page.execute_script("return localStorage.getItem('kiln.api-key')") == "sk-kiln-test"
    set_field(page, "max-tokens", "4")
    ask(page, "Hi!")
    wait_for(lambda: finished(page), "the answer")
    sent = sent_requests(page, "")
    for path in ("/v1/models", "/v1/chat/completions"):
        requests = [r for r in sent if r["url"].endswith(path)]
        assert requests and all(r["headers"].get("Authorization") == "Bearer sk-kiln-test" for r in requests), path


# Answers /v1/chat/completions inside the page with `arguments[0]`'s pieces as streamed deltas (20 ms apart), as
# the server would stream a model that writes them: the page's rendering of any text, without a model that does.
STUB_STREAM = """
const pieces = arguments[0];
const serverFetch = window.fetch;
window.fetch = (url, options) => {
  if (!String(url).endsWith("/v1/chat/completions")) return serverFetch(url, options);
  const events = pieces.map((content) => ({choices: [{index: 0, delta: {content}}]}));
  const encoder = new TextEncoder();
  const body = new ReadableStream({
    async pull(controller) {
      await new Promise((resolve) => setTimeout(resolve, 20));
      const event = events.length ? JSON.stringify(events.shift()) : "[DONE]";
      controller.enqueue(encoder.encode(`data: ${event}\\n\\n`));
      if (event === "[DONE]") controller.close();
    },
  });
  return Promise.resolve(new Response(body, {headers: {"Content-Type": "text/event-stream"}}));
};
"""

MARKDOWN = (
    "# Plan\n\n"
    "Use **bold**, *emphasis*, `inline <code>` and [the docs](https://example.org/docs).\n\n"
    "- first\n"
    "- second\n"
    "  - nested\n\n"
    "3. three\n"
    "4. four\n\n"
    "```python\n"
    "print(\"<b>hi</b>\")\n"
    "```\n"
    "After the code."
)


def stream_answer(page, text: str, piece: int = 5):
    """Ask once with the page answering `text` in pieces of `piece` characters; the finished answer's element."""
    page.get_log("browser")  # drop what earlier tests logged
    page.execute_script(STUB_STREAM, [text[i:i + piece] for i in range(0, len(text), piece)])
    page.execute_script(WATCH_TEXT_LENGTHS)
    ask(page, "Show me markdown.")
    return wait_for(lambda: finished(page), "the stubbed answer")


def rendered(item, selector: str) -> list[str]:
    return [e.get_property("textContent") for e in item.find_elements(By.CSS_SELECTOR, f".text {selector}")]


def test_markdown_renders_as_it_streams(page, server):
    item = stream_answer(page, MARKDOWN)
    assert item.get_attribute("data-state") == "done"
    assert rendered(item, "h1") == ["Plan"]
    assert rendered(item, "p > strong") == ["bold"] and rendered(item, "p > em") == ["emphasis"]
    assert rendered(item, "p > code") == ["inline <code>"]
    link = item.find_element(By.CSS_SELECTOR, ".text p > a")
    assert (link.text, link.get_attribute("href")) == ("the docs", "https://example.org/docs")
    assert (link.get_attribute("target"), link.get_attribute("rel")) == ("_blank", "noopener noreferrer")
    assert rendered(item, "ul > li > ul > li") == ["nested"]
    assert rendered(item, "> ul > li > p") == ["first", "second"]
    assert rendered(item, "ol > li") == ["three", "four"]
    assert item.find_element(By.CSS_SELECTOR, ".text ol").get_attribute("start") == "3"
    assert rendered(item, "pre > code") == ['print("<b>hi</b>")']  # a fence's text, never its markup
    assert rendered(item, ".code-head .language") == ["python"]
    assert rendered(item, "p")[-1] == "After the code."
    assert item.find_elements(By.CSS_SELECTOR, ".text b") == []
    lengths = page.execute_script("return window.textLengths")
    assert len({n for n in lengths if 0 < n < lengths[-1]}) >= 5, f"rendered in too few steps: {lengths}"
    severe = [e for e in page.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, severe


def test_the_copy_button_copies_the_code(page, server):
    page.execute_cdp_cmd("Browser.grantPermissions", {
        "origin": server.url, "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]})
    item = stream_answer(page, "Run:\n\n~~~\nmake build-engine\nkiln serve x\n~~~\n")
    button = item.find_element(By.CSS_SELECTOR, ".code-block .copy")
    assert button.text == "Copy"
    button.click()
    wait_for(lambda: button.text == "Copied", "the button to say Copied", timeout=5)
    page.set_script_timeout(10)
    copied = page.execute_async_script("navigator.clipboard.readText().then(arguments[0], (e) => arguments[0](null))")
    assert copied == "make build-engine\nkiln serve x"


HOSTILE = (
    '<script>window.pwned = "script"</script>\n\n'
    '<img src="/no-such-image" onerror="window.pwned = \'img\'">\n\n'
    '[click me](javascript:window.pwned=1) and **<i onmouseover="window.pwned=2">bold</i>**'
)


def test_html_and_script_in_the_model_text_show_as_text(page, server):
    item = stream_answer(page, HOSTILE, piece=7)
    time.sleep(0.5)  # an image's onerror would have run by now
    assert page.execute_script("return window.pwned") is None
    for tag in ("script", "img", "i", "a"):
        assert item.find_elements(By.CSS_SELECTOR, f".text {tag}") == [], tag
    assert rendered(item, "p") == ['<script>window.pwned = "script"</script>',
                                   '<img src="/no-such-image" onerror="window.pwned = \'img\'">',
                                   '[click me](javascript:window.pwned=1) and <i onmouseover="window.pwned=2">bold</i>']
    assert rendered(item, "strong") == ['<i onmouseover="window.pwned=2">bold</i>']
