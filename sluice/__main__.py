"""`python -m sluice` is the `sluice` command."""

from sluice.cli import main

main()
