"""The chat page's own script (runtime/server/static/chat.js) run in Node, without a browser: its request-building
functions called on real inputs, so tests can send what the page would send.

    out = run_chat_js("return requestBody();", {"card": card})

runs chat.js in a Node `vm` context whose `document` only hands out stub elements (`{value: ""}`; the page's
DOMContentLoaded handler never fires), then the given function body in chat.js's own scope (its `let`s and
`const`s, e.g. `history` and `model`, are in reach), with the JSON ``inputs`` as INPUT; returns what the body
returns, through JSON. Needs `node` on PATH (tests skip without it).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

from kiln.runtime.server.web import read_asset

NODE = shutil.which("node")

_RUNNER = r"""
const vm = require("vm");
const {script, body, inputs} = JSON.parse(require("fs").readFileSync(0, "utf8"));
const elements = {};
const stub = (id) => elements[id] || (elements[id] = {id, value: "", hidden: true, addEventListener() {}});
const context = {document: {getElementById: stub, addEventListener() {}}, console, INPUT: inputs};
vm.createContext(context);
vm.runInContext(`${script}\n;globalThis.__out = JSON.stringify((() => { ${body} })());`, context);
process.stdout.write(context.__out);
"""


def run_chat_js(body: str, inputs: dict[str, Any] | None = None) -> Any:
    assert NODE is not None, "node is not on PATH"
    request = json.dumps({"script": read_asset("chat.js").decode(), "body": body, "inputs": inputs or {}})
    done = subprocess.run([NODE, "-e", _RUNNER], input=request, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
