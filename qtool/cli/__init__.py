"""The `qtool` command line: the only package that imports typer. app.py is the program (entry
point, signals, exit codes); each command is a module that registers itself on `app` when it
is imported here (parse the options, call qtool.api, render)."""

from qtool.cli import calibrate, compare, dequantize, evaluate, inspect, plot, quantize
from qtool.cli.app import app, main

__all__ = [
    "app",
    "calibrate",
    "compare",
    "dequantize",
    "evaluate",
    "inspect",
    "main",
    "plot",
    "quantize",
]
