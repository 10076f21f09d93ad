"""`python -m kiln.cli`: the same click group as the `kiln` script."""

from kiln.cli.commands import main

main()
