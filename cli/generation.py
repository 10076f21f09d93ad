"""What `kiln generate` and `kiln chat` do (cli/commands.py only parses options)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from kiln.errors import InvalidParamError, RequestFailedError
from kiln.runtime.detokenizer import ChatMessage
from kiln.runtime.engine import Engine
from kiln.runtime.loader import load_engine
from kiln.runtime.params import RuntimeConfig, SamplingParams
from kiln.runtime.vision.images import decode_image_bytes

if TYPE_CHECKING:
    from PIL.Image import Image

# `kiln chat`'s commands and what /help says of each.
CHAT_COMMANDS = {
    "/help": "list these commands",
    "/reset": "forget the conversation (a --system message stays)",
    "/exit": "quit (as do Ctrl-D and Ctrl-C at the prompt)",
}


@dataclasses.dataclass(frozen=True)
class Streamed:
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort" (Ctrl-C)


@dataclasses.dataclass(frozen=True)
class PromptInput:
    """What `kiln generate` was asked: a raw PROMPT or a --chat message, and --image files."""

    prompt: str | None = None
    chat: str | None = None
    images: tuple[str, ...] = ()


def stream_text(engine: Engine, prompt: str | list[int], params: SamplingParams, out: TextIO,
                images: list[Image] | None = None) -> Streamed:
    """Run one request, writing its text to `out` as it becomes stable; Ctrl-C aborts it."""
    request_id = f"cli-{id(prompt)}-{len(engine.requests)}"
    engine.add(engine.prepare(request_id, prompt, params, images))
    shown: list[str] = []
    finish_reason = None
    try:
        while engine.has_unfinished():
            for output in engine.step():
                if output.error is not None:
                    raise RequestFailedError(output.error)
                text = output.outputs[0].text  # what this step added
                out.write(text)
                out.flush()
                shown.append(text)
                finish_reason = output.outputs[0].finish_reason or finish_reason
    except KeyboardInterrupt:
        engine.abort(request_id)
        finish_reason = "abort"
    return Streamed("".join(shown), finish_reason)


def generate(engine_dir: str, given: PromptInput, params: SamplingParams, config: RuntimeConfig | None = None,
             out: TextIO | None = None) -> str:
    """`kiln generate`: a raw PROMPT, or --chat TEXT wrapped in the engine's chat template; --image files go
    before the chat message (LLaVA's layout), or in place of the raw prompt's image tokens, one per image."""
    out = out or sys.stdout
    prompt, chat = given.prompt, given.chat
    if (prompt is None) == (chat is None):
        raise InvalidParamError("give exactly one of PROMPT or --chat TEXT", "prompt")
    images = [_read_image(Path(path)) for path in given.images]
    engine = load_engine(engine_dir, config)
    if images and engine.image_token is None:
        raise InvalidParamError(f"{engine_dir} is not a vision-language engine: it takes no --image", "image")
    if chat is not None:
        content = "".join(engine.image_placeholder or "" for _ in images) + chat
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": content}])
    assert prompt is not None  # exactly one of the two, checked above
    text = stream_text(engine, prompt, params, out, images).text
    out.write("\n")
    return text


def _read_image(path: Path) -> Image:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InvalidParamError(f"--image {path}: cannot be read ({exc.strerror})", "image") from None
    return decode_image_bytes(data, f"--image {path}")


def chat_repl(engine_dir: str, params: SamplingParams, system: str | None = None,
              config: RuntimeConfig | None = None, inp: TextIO | None = None, out: TextIO | None = None) -> None:
    """`kiln chat`: an interactive conversation until /exit, EOF or Ctrl-C at the prompt."""
    inp, out = inp or sys.stdin, out or sys.stdout
    engine = load_engine(engine_dir, config)
    base: list[ChatMessage] = [{"role": "system", "content": system}] if system else []
    history = list(base)
    out.write(f"kiln chat with {engine.model_name} (/help lists the commands)\n")
    while True:
        try:  # the prompt is inside: a Ctrl-C that lands just after it is shown still means "leave"
            out.write("> ")
            out.flush()
            line = inp.readline()
        except KeyboardInterrupt:  # at the prompt Ctrl-C means "leave", not an error
            line = ""
        if not line:
            out.write("\n")
            return
        line = line.strip()
        if line.startswith("/") and not line.startswith("//"):
            command = line.split()[0]
            if command == "/exit":
                return
            if command == "/reset":
                history = list(base)
                out.write("[conversation cleared]\n")
            elif command == "/help":
                out.write("".join(f"  {name:<8}{what}\n" for name, what in CHAT_COMMANDS.items())
                          + "  //...   send a message that starts with /\n")
            else:
                out.write(f"[unknown command {command}; /help lists the commands]\n")
            continue
        if line:
            _chat_turn(engine, params, history, line.removeprefix("/"), out)


def _chat_turn(engine: Engine, params: SamplingParams, history: list[ChatMessage], message: str,
               out: TextIO) -> None:
    """Answer message with the history as context; the reply joins the history, marked when it was cut."""
    history.append({"role": "user", "content": message})
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(history))
    room = engine.max_seq_len - len(ids)
    if room < 1:
        out.write("[the conversation is longer than the engine's max_seq_len; /reset to start over]\n")
        history.pop()
        return
    fits = params.max_tokens is not None and params.max_tokens <= room
    turn = params if fits else dataclasses.replace(params, max_tokens=room)
    reply = stream_text(engine, ids, turn, out)
    if reply.finish_reason == "length":
        out.write(f" [cut at --max-tokens {turn.max_tokens}]" if fits else
                  f" [cut at the engine's max_seq_len ({engine.max_seq_len} tokens); /reset to start over]")
    elif reply.finish_reason == "abort":
        out.write(" [interrupted]")
    out.write("\n")
    history.append({"role": "assistant", "content": reply.text})
