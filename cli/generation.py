"""What `kiln generate` and `kiln chat` do (cli/commands.py only parses options)."""

from __future__ import annotations

import dataclasses
import sys
from typing import TextIO

from kiln.errors import InvalidParamError
from kiln.runtime.engine import Engine
from kiln.runtime.loader import load_engine
from kiln.runtime.params import RuntimeConfig, SamplingParams


def stream_text(engine: Engine, prompt: str | list[int], params: SamplingParams, out: TextIO) -> str:
    """Run one request, writing its text to `out` as it becomes stable; returns the full text."""
    request_id = f"cli-{id(prompt)}-{len(engine.requests)}"
    engine.add_request(request_id, prompt, params)
    shown: list[str] = []
    try:
        while engine.has_unfinished():
            for output in engine.step():
                text = output.outputs[0].text  # what this step added
                out.write(text)
                out.flush()
                shown.append(text)
    except KeyboardInterrupt:
        engine.abort(request_id)
    return "".join(shown)


def generate(engine_dir: str, prompt: str | None, chat: str | None, params: SamplingParams,
             config: RuntimeConfig | None = None, out: TextIO | None = None) -> str:
    """`kiln generate`: a raw PROMPT, or --chat TEXT wrapped in the engine's chat template."""
    out = out or sys.stdout
    if (prompt is None) == (chat is None):
        raise InvalidParamError("give exactly one of PROMPT or --chat TEXT", "prompt")
    engine = load_engine(engine_dir, config)
    if chat is not None:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": chat}])
    assert prompt is not None  # exactly one of the two, checked above
    text = stream_text(engine, prompt, params, out)
    out.write("\n")
    return text


def chat_repl(engine_dir: str, params: SamplingParams, system: str | None = None,
              config: RuntimeConfig | None = None, inp: TextIO | None = None, out: TextIO | None = None) -> None:
    """`kiln chat`: an interactive conversation; /reset clears history, /exit or EOF quits."""
    inp, out = inp or sys.stdin, out or sys.stdout
    engine = load_engine(engine_dir, config)
    base = [{"role": "system", "content": system}] if system else []
    history = list(base)
    out.write(f"kiln chat with {engine.model_name} (/reset clears history, /exit quits)\n")
    while True:
        out.write("> ")
        out.flush()
        line = inp.readline()
        if not line or line.strip() == "/exit":
            break
        line = line.strip()
        if not line:
            continue
        if line == "/reset":
            history = list(base)
            continue
        history.append({"role": "user", "content": line})
        prompt = engine.tokenizer.apply_chat_template(history)
        ids = engine.tokenizer.encode(prompt)
        room = engine.max_seq_len - len(ids)
        if room < 1:
            out.write("[history is longer than the engine's max_seq_len; /reset to start over]\n")
            history.pop()
            continue
        turn = params if params.max_tokens is None or params.max_tokens <= room else \
            dataclasses.replace(params, max_tokens=room)
        reply = stream_text(engine, ids, turn, out)
        out.write("\n")
        history.append({"role": "assistant", "content": reply})
