"""Line numbers of the tables, keys and array elements of a TOML text.

tomllib returns plain dicts without positions, and a recipe error must name its line, so this
scanner walks the text (already accepted by tomllib) once and records where each path starts:
("rule", 0) is the first `[[rule]]` table or the first element of `rule = [...]`,
("rule", 0, "dtype") a key in it, ("ladder",) a top-level key, ("ladder", 2) the third element
of its array and ("ladder", 2, "dtype") a key of that element's inline table.
"""

from __future__ import annotations

import tomllib

TomlPath = tuple[str | int, ...]

_BARE_KEY = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_SCALAR_END = frozenset(",]}\n#")


def toml_lines(text: str) -> dict[TomlPath, int]:
    """The 1-based line of every table header, key and array element of a valid TOML text."""
    scanner = _Scanner(text)
    scanner.document()
    return scanner.lines


def line_of(lines: dict[TomlPath, int], path: TomlPath) -> int:
    """The line of `path`, or of its longest recorded prefix (1 when nothing is recorded)."""
    for n in range(len(path), 0, -1):
        if path[:n] in lines:
            return lines[path[:n]]
    return 1


class _Scanner:
    """A recursive walk over valid TOML that skips strings and comments exactly."""

    def __init__(self, text: str) -> None:
        self.text, self.pos, self.line = text, 0, 1
        self.lines: dict[TomlPath, int] = {}
        self._tables: dict[TomlPath, int] = {}  # how many [[name]] headers were seen

    def document(self) -> None:
        table: TomlPath = ()
        while self._skip_blank(newlines=True):
            start = self.pos
            if self._peek() == "[":
                table = self._header()
            else:
                self._keyval(table)
            self._ensure_progress(start)

    def _ensure_progress(self, start: int) -> None:
        """Never loop on text this scanner does not understand (at worst, a line is off)."""
        if self.pos == start:
            self._advance()

    def _peek(self, n: int = 1) -> str:
        return self.text[self.pos : self.pos + n]

    def _advance(self, n: int = 1) -> None:
        self.line += self.text.count("\n", self.pos, self.pos + n)
        self.pos += n

    def _skip_blank(self, newlines: bool) -> bool:
        """Skip spaces, tabs, comments (and newlines); False at the end of the text."""
        skip = " \t\r\n" if newlines else " \t\r"
        while self.pos < len(self.text):
            c = self.text[self.pos]
            if c == "#":
                end = self.text.find("\n", self.pos)
                self._advance((len(self.text) if end < 0 else end) - self.pos)
            elif c in skip:
                self._advance()
            else:
                return True
        return False

    def _record(self, path: TomlPath, line: int) -> None:
        for n in range(1, len(path) + 1):
            self.lines.setdefault(path[:n], line)

    def _header(self) -> TomlPath:
        """`[a.b]` -> ("a", "b"); the n-th `[[a]]` -> ("a", n)."""
        line, double = self.line, self._peek(2) == "[["
        self._advance(2 if double else 1)
        name = self._key()
        self._skip_blank(newlines=False)
        self._advance(2 if double else 1)
        path: TomlPath = name
        if double:
            count = self._tables.get(name, 0)
            self._tables[name] = count + 1
            path = (*name, count)
        self._record(path, line)
        return path

    def _keyval(self, table: TomlPath) -> None:
        line = self.line
        path = (*table, *self._key())
        self._skip_blank(newlines=False)
        self._advance()  # "="
        self._skip_blank(newlines=False)
        self._record(path, line)
        self._value(path)

    def _key(self) -> tuple[str, ...]:
        """A dotted key: bare, "basic" or 'literal' parts separated by dots."""
        parts = []
        while True:
            self._skip_blank(newlines=False)
            start = self.pos
            if self._peek() in ("'", '"'):
                self._string()
                parts.append(str(tomllib.loads("k = " + self.text[start : self.pos])["k"]))
            else:
                while self.pos < len(self.text) and self.text[self.pos] in _BARE_KEY:
                    self._advance()
                parts.append(self.text[start : self.pos])
            self._skip_blank(newlines=False)
            if self._peek() != ".":
                return tuple(parts)
            self._advance()

    def _value(self, path: TomlPath) -> None:
        c = self._peek()
        if c in ("'", '"'):
            self._string()
        elif c == "[":
            self._array(path)
        elif c == "{":
            self._inline_table(path)
        else:  # number, bool or date-time (which may hold a space)
            while self.pos < len(self.text) and self.text[self.pos] not in _SCALAR_END:
                self._advance()

    def _array(self, path: TomlPath) -> None:
        self._advance()
        index = 0
        while self._skip_blank(newlines=True) and self._peek() != "]":
            if self._peek() == ",":
                self._advance()
                continue
            start = self.pos
            self._record((*path, index), self.line)
            self._value((*path, index))
            self._ensure_progress(start)
            index += 1
        self._advance()

    def _inline_table(self, path: TomlPath) -> None:
        self._advance()
        while self._skip_blank(newlines=True) and self._peek() != "}":
            if self._peek() == ",":
                self._advance()
                continue
            start = self.pos
            self._keyval(path)
            self._ensure_progress(start)
        self._advance()

    def _string(self) -> None:
        """Skip one string of any of the four kinds, escapes included."""
        quote = self._peek()
        delim = quote * 3 if self._peek(3) == quote * 3 else quote
        self._advance(len(delim))
        while self.pos < len(self.text):
            if quote == '"' and self._peek() == "\\":
                self._advance(2)
            elif self._peek(len(delim)) == delim:
                self._advance(len(delim))
                # A multi-line string may end in up to two more quotes: '''a''''' is "a''".
                for _ in range(2 if len(delim) == 3 else 0):
                    if self._peek() == quote:
                        self._advance()
                return
            else:
                self._advance()
