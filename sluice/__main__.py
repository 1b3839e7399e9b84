"""`python -m sluice` is the `sluice` command."""

from cli import main

main()
