"""The `qtool` command line: the only package that imports typer. app.py is the program (entry
point, signals, exit codes), commands.py its commands (imported here, which registers them)."""

from qtool.cli import commands as commands
from qtool.cli import evaluate as evaluate  # `qtool eval`
from qtool.cli.app import app, main

__all__ = ["app", "main"]
