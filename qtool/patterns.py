"""Regular expressions that come from files (a compressed-tensors `ignore`/`targets` `re:` entry,
a recipe's `re:` pattern) matched with a bound, so a hostile pattern cannot hang qtool.

They are matched by Python's own `re` engine, as compressed-tensors and vLLM match them (a
non-backtracking engine would refuse the lookarounds real configs use, or read them otherwise;
the `regex` module's `timeout=` is also a backtracking engine, with a dialect of its own).
The bounds:

- a pattern longer than MAX_PATTERN_CHARS, or one `re` cannot compile (bad syntax, nesting
  deep enough to overflow its compiler), is refused (`compiled`);
- each match may take at most MATCH_LIMIT_S seconds;
- all the matches of one `bounded()` block (one file's patterns against every name of a
  model: a config's `ignore` and `targets`, a recipe's rules) may take at most TOTAL_LIMIT_S
  seconds together, however many patterns and names there are. Without it, 31 patterns each
  just under the per-match limit, times the modules of a model, took minutes.

On the main thread (where qtool resolves every config) a SIGALRM timer ticks every TICK_S
while a block runs; at a tick during a match over either limit, the handler stops it (`re`
checks for signals while it backtracks). One timer per block, not two syscalls per match:
matching 46,000 names against 10 patterns costs little more than `re` itself. Elsewhere a
match cannot be interrupted, so the limits are checked after each one. A PatternError names
the pattern; the caller names the file. Results are remembered, so a name matched twice (a
config resolved for inspect, then for dequantize) costs once. Torch-free.
"""

from __future__ import annotations

import contextlib
import functools
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import TypeVar

MAX_PATTERN_CHARS = 1_000
MATCH_LIMIT_S = 0.5
TOTAL_LIMIT_S = 5.0
TICK_S = 0.05
_T = TypeVar("_T")
_REMEMBERED = 1 << 16  # results kept (pattern, name, full) -> bool; cleared when full


class PatternError(ValueError):
    """A pattern from a file that is invalid, too long, or too slow to match."""


class _Expired(Exception):
    pass


@dataclass
class _Budget:
    """The time one bounded() block has spent matching, in total and per pattern."""

    spent: float = 0.0
    count: int = 0
    by_pattern: dict[str, float] = field(default_factory=dict)

    def add(self, pattern: str, seconds: float) -> None:
        self.spent += seconds
        self.count += 1
        self.by_pattern[pattern] = self.by_pattern.get(pattern, 0.0) + seconds

    def exhausted(self, pattern: str) -> PatternError:
        slowest = max(self.by_pattern, key=self.by_pattern.__getitem__, default=pattern)
        share = self.by_pattern.get(slowest, 0.0)
        return PatternError(
            f"patterns took over {TOTAL_LIMIT_S:g} s in total to compile and match "
            f"({len(self.by_pattern):,} patterns, {self.count:,} matches; the slowest, "
            f"{slowest}, took {share:.2f} s); qtool refuses them: use fewer, simpler "
            "patterns (anchor them; avoid repeated .* and nested repetition)"
        )


_state = threading.local()
_results: dict[tuple[str, str, bool], bool] = {}


@functools.lru_cache(maxsize=4096)
def compiled(pattern: str) -> re.Pattern[str]:
    """`pattern` compiled (PatternError when it is too long or not a regular expression)."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternError(
            f"regular expression of {len(pattern):,} characters (over {MAX_PATTERN_CHARS:,})"
        )
    try:
        return re.compile(pattern)
    except (re.error, RecursionError, OverflowError, MemoryError) as err:
        why = "nested too deeply" if isinstance(err, RecursionError) else str(err)
        raise PatternError(f"invalid regular expression: {why} (in {_shown(pattern)})") from None


def matches(pattern: str, name: str, *, full: bool = False) -> bool:
    """re.match (or re.fullmatch) of `pattern` on `name`, bounded (see the module docstring):
    compiling counts against the limits too (15,000 long patterns in an `ignore` list, or more
    distinct patterns than the compile cache holds, would otherwise take minutes)."""
    key = (pattern, name, full)
    known = _results.get(key)
    if known is not None:
        return known
    if getattr(_state, "depth", 0):
        found = _timed_match(pattern, name, full)
    else:
        with bounded():
            found = _timed_match(pattern, name, full)
    if len(_results) >= _REMEMBERED:
        _results.clear()
    _results[key] = found
    return found


def _timed_match(pattern: str, name: str, full: bool) -> bool:
    rx: list[re.Pattern[str]] = []

    def work() -> bool:
        rx.append(compiled(pattern))
        found = rx[0].fullmatch(name) if full else rx[0].match(name)
        return found is not None

    doing: Callable[[], str] = lambda: f"to match {name[:80]!r}" if rx else "to compile"  # noqa: E731
    return _charged(f"regular expression {_shown(pattern)}", work, doing)


def timed(label: str, work: Callable[[], _T], name: str = "") -> _T:
    """`work()` (compiling or matching patterns from a file that are not `re:` ones: a
    recipe's globs) under the same limits as a regular expression, charged to `label` (how an
    error names the patterns); `name`: the name being matched, for the error."""
    doing: Callable[[], str] = lambda: f"to match {name[:80]!r}" if name else "to compile"  # noqa: E731
    if getattr(_state, "depth", 0):
        return _charged(label, work, doing)
    with bounded():
        return _charged(label, work, doing)


def _charged(label: str, work: Callable[[], _T], doing: Callable[[], str]) -> _T:
    """Run `work` inside the current bounded() block: PatternError when the block's budget is
    spent, or when this one call takes over MATCH_LIMIT_S (stopped by the ticking timer on the
    main thread, found out afterwards elsewhere)."""
    budget: _Budget = _state.budget
    if budget.spent >= TOTAL_LIMIT_S:
        raise budget.exhausted(label)
    started = time.perf_counter()
    expired = False
    try:
        _state.started = started
        try:
            result = work()
        finally:
            _state.started = None
    except _Expired:  # also a tick delivered just after the work ended
        expired = True
    took = time.perf_counter() - started
    budget.add(label, took)
    if budget.spent > TOTAL_LIMIT_S:
        raise budget.exhausted(label)
    if expired or took > MATCH_LIMIT_S:
        raise PatternError(
            f"{label} took over {MATCH_LIMIT_S} s {doing()} (it backtracks catastrophically); "
            "qtool refuses it"
        )
    return result


def _shown(pattern: str) -> str:
    return repr(pattern if len(pattern) <= 80 else pattern[:77] + "...")


@contextlib.contextmanager
def bounded() -> Iterator[None]:
    """One budget for every match in the block (the outermost block, however deeply nested);
    on the main thread, the ticking timer runs for the block."""
    depth = getattr(_state, "depth", 0)
    if depth:
        _state.depth = depth + 1
        try:
            yield
        finally:
            _state.depth -= 1
        return
    main = threading.current_thread() is threading.main_thread()
    _state.depth, _state.budget, _state.started = 1, _Budget(), None
    previous = signal.signal(signal.SIGALRM, _tick) if main else None
    if main:
        signal.setitimer(signal.ITIMER_REAL, TICK_S, TICK_S)
    try:
        yield
    finally:
        if main:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        _state.depth, _state.started = 0, None


def _tick(signum: int, frame: FrameType | None) -> None:
    """Stop the match in progress once it is over either limit (a no-op between matches)."""
    started = getattr(_state, "started", None)
    if started is None:
        return
    took = time.perf_counter() - started
    if took > MATCH_LIMIT_S or _state.budget.spent + took > TOTAL_LIMIT_S:
        _state.started = None
        raise _Expired()
