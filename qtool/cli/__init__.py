"""The `qtool` command line: the only package that imports typer."""

from qtool.cli.commands import app, main

__all__ = ["app", "main"]
