"""`python -m nummon`: the command line."""

from ._cli import entry

__all__: list[str] = []

entry()
