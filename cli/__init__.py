"""kiln.cli: the command line, the top layer (it may import every stage; no stage imports it).

Each command imports its stage inside its body, so `kiln --help` stays fast and a runtime-only
install (no torch) still serves.
"""

from kiln.cli.commands import main

__all__ = ["main"]
