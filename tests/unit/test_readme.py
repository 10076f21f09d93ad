"""The README's first steps work as written: the engine its serving commands use is the one
`make build-engine` builds, and it says how `kiln` gets on the PATH before the first `kiln` line."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
MAKEFILE = (REPO / "Makefile").read_text()


def _code_lines() -> list[str]:
    blocks = re.findall(r"^```(?:bash|python)\n(.*?)^```", README, re.M | re.S)
    return [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]


def test_the_serving_commands_use_the_engine_make_builds():
    engine = re.search(r"^ENGINE \?= (\S+)$", MAKEFILE, re.M).group(1)
    lines = _code_lines()
    used = {m.group(1) for line in lines if (m := re.match(r"kiln (?:generate|chat|serve|bench) (\S+)", line))}
    used |= {m.group(1) for line in lines if (m := re.match(r'llm = LLM\("([^"]+)"\)', line))}
    built = {m.group(1) for line in lines if (m := re.match(r"kiln build \S+ .*-o (\S+)$", line))}
    assert engine in used and used <= built  # any other engine served is one the README builds first
    assert f"kiln build default -o {engine}" in lines  # the README's own build of it, by hand


def test_kiln_is_on_the_path_before_the_first_kiln_line():
    lines = _code_lines()
    first_kiln = next(i for i, line in enumerate(lines) if line.startswith("kiln "))
    assert lines.index("make build-engine") < lines.index(". .venv/bin/activate") < first_kiln
    venv = re.search(r"^VENV \?= (\S+)$", MAKEFILE, re.M).group(1)
    assert venv == ".venv"

