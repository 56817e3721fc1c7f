"""Regular expressions that come from files (a compressed-tensors `ignore`/`targets` `re:` entry,
a recipe's `re:` pattern) matched with a bound, so a hostile pattern cannot hang qtool.

They are matched by Python's own `re` engine, as compressed-tensors and vLLM match them (a
non-backtracking engine would refuse the lookarounds real configs use, or read them otherwise).
The bound: a pattern longer than MAX_PATTERN_CHARS is refused, and each match may take at most
MATCH_LIMIT_S seconds of wall time; `re` checks for signals while it backtracks, so a SIGALRM
timer (ITIMER_REAL) stops a catastrophic pattern (`(a+)+$`, `(.*)*x`, `(a|a)*b`) and the match
is refused with PatternError naming the pattern. The timer works on the main thread, where
qtool resolves every config; elsewhere only the length bound applies. Torch-free.
"""

from __future__ import annotations

import contextlib
import functools
import re
import signal
import threading
from collections.abc import Iterator
from types import FrameType

MAX_PATTERN_CHARS = 1_000
MATCH_LIMIT_S = 0.5


class PatternError(ValueError):
    """A pattern from a file that is invalid, too long, or too slow to match."""


class _Expired(Exception):
    pass


_state = threading.local()


@functools.lru_cache(maxsize=4096)
def compiled(pattern: str) -> re.Pattern[str]:
    """`pattern` compiled (PatternError when it is too long or not a regular expression)."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternError(
            f"regular expression of {len(pattern):,} characters (over {MAX_PATTERN_CHARS:,})"
        )
    try:
        return re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as err:
        raise PatternError(f"invalid regular expression {pattern!r}: {err}") from None


def matches(pattern: str, name: str, *, full: bool = False) -> bool:
    """re.match (or re.fullmatch) of `pattern` on `name`, bounded (see the module docstring)."""
    rx = compiled(pattern)
    with bounded():
        armed = getattr(_state, "armed", False)
        if armed:
            signal.setitimer(signal.ITIMER_REAL, MATCH_LIMIT_S)
        try:
            found = rx.fullmatch(name) if full else rx.match(name)
        except _Expired:
            raise PatternError(
                f"regular expression {pattern!r} took over {MATCH_LIMIT_S} s to match "
                f"{name[:80]!r} (it backtracks catastrophically); qtool refuses it"
            ) from None
        finally:
            if armed:
                signal.setitimer(signal.ITIMER_REAL, 0)
    return found is not None


@contextlib.contextmanager
def bounded() -> Iterator[None]:
    """Arm the match timer for the block (once, however deeply nested); a no-op off the main
    thread."""
    if getattr(_state, "depth", 0) or threading.current_thread() is not threading.main_thread():
        _state.depth = getattr(_state, "depth", 0) + 1
        try:
            yield
        finally:
            _state.depth -= 1
        return
    previous = signal.signal(signal.SIGALRM, _expire)
    _state.depth, _state.armed = 1, True
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        _state.depth, _state.armed = 0, False


def _expire(signum: int, frame: FrameType | None) -> None:
    raise _Expired()
