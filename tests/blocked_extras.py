"""Run the kiln CLI as on a machine where some of kiln's extras are not installed, without uninstalling
anything: a sys.meta_path finder refuses the extras' modules (the first argument lists the extras).

    python tests/blocked_extras.py compile,server generate ENGINE "Hi"
"""

from __future__ import annotations

import sys

from kiln.cli.extras import EXTRA_MODULES


class _Blocker:
    def __init__(self, modules: frozenset[str]) -> None:
        self.modules = modules

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.split(".")[0] in self.modules:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def command_line(extras: str, *args: str) -> list[str]:
    """argv running the kiln CLI with args while the modules of `extras` (comma-separated) are missing."""
    return [sys.executable, __file__, extras, *args]


if __name__ == "__main__":
    blocked = frozenset().union(*(EXTRA_MODULES[extra] for extra in sys.argv.pop(1).split(",")))
    for loaded in [name for name in sys.modules if name.split(".")[0] in blocked]:
        raise SystemExit(f"{loaded} was imported before the blocker")
    sys.meta_path.insert(0, _Blocker(blocked))
    from kiln.cli import main

    main(prog_name="kiln")
