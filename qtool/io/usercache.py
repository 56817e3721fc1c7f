"""A cache of facts that take seconds to learn and never change for the same inputs (which
nn.Linear modules transformers builds from a config.json): small JSON documents in the user's
cache directory, each named by a hash of everything the fact depends on.

Where: $QTOOL_CACHE_DIR (an absolute path; `off` turns the cache off), else
$XDG_CACHE_HOME/qtool, else ~/.cache/qtool, the latter two only when that home belongs to the
user running qtool and no one else can write it (root under sudo with another user's HOME keeps
no cache there), walked down from it without following links, each level private to the user
(missing levels are made 0700). A document is read only from such a directory, through
O_NOFOLLOW, as a regular file of the user's of bounded size that names the key it was asked
for; anything else is a miss, never an error: the caller computes the fact again. Writes are
atomic (temp file, rename) and their failures are ignored (a read-only home, a full disk).
Torch-free.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import time
from pathlib import Path

ENV = "QTOOL_CACHE_DIR"
OFF = "off"
SCHEMA = 1
MAX_BYTES = 4 << 20
TEMP_PREFIX = ".tmp-"
TEMP_MAX_AGE_S = 24 * 3600  # a temp file this old was left by a killed run


def location() -> tuple[Path, tuple[str, ...]] | None:
    """Where the cache lies: (a base directory, the names below it), QTOOL_CACHE_DIR as given
    or a home of the user's that no one else can write with the cache's names below it (walked
    without following links); None when QTOOL_CACHE_DIR is `off` or not an absolute path, or
    there is no such home. Nothing is created here."""
    chosen = os.environ.get(ENV)
    if chosen is not None and chosen != "":
        return (Path(chosen), ()) if chosen.lower() != OFF and os.path.isabs(chosen) else None
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return (Path(xdg), ("qtool",)) if _private(xdg) else None
    home = os.environ.get("HOME", "")
    return (Path(home), (".cache", "qtool")) if os.path.isabs(home) and _private(home) else None


def _private(path: str) -> bool:
    try:
        return _is_private(os.stat(path))
    except OSError:
        return False


def _is_private(st: os.stat_result) -> bool:
    """Owned by this user, and neither its group nor others may write it."""
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def key_of(kind: str, *parts: object) -> str:
    """The key of a fact of `kind` that depends on `parts` (JSON-serializable)."""
    text = json.dumps([SCHEMA, kind, *parts], sort_keys=True, separators=(",", ":"))
    return f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:40]}"


def load(key: str) -> dict[str, object] | None:
    """The document stored under `key`, or None (a miss) for anything but a sound entry."""
    try:
        dfd = _open_cache(create=False)
    except OSError:
        return None
    try:
        raw = _read_entry(dfd, f"{key}.json")
    except OSError:
        return None
    finally:
        os.close(dfd)
    if not raw.startswith(_prefix(key)):  # before parsing: a planted document costs nothing
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not (isinstance(doc, dict) and doc.get("key") == key and isinstance(doc.get("value"), dict)):
        return None
    value: dict[str, object] = doc["value"]
    return value


def store(key: str, value: dict[str, object]) -> None:
    """Keep `value` under `key`; silently nothing when the cache cannot be written."""
    with contextlib.suppress(OSError, ValueError):
        dfd = _open_cache(create=True)
        try:
            doc = json.dumps({"key": key, "value": value}, separators=(",", ":"))
            _write_entry(dfd, f"{key}.json", doc.encode())
            _sweep_temps(dfd)
        finally:
            os.close(dfd)


def _prefix(key: str) -> bytes:
    """How a document store() writes for `key` begins."""
    return json.dumps({"key": key}, separators=(",", ":"))[:-1].encode()


def _open_cache(*, create: bool) -> int:
    """A descriptor of the cache directory, private to this user (created so, with its missing
    parents under a home, when `create`); OSError when there is none or it is not private."""
    found = location()
    if found is None:
        raise FileNotFoundError("no cache directory")
    base, names = found
    made = False
    if create and not names:  # QTOOL_CACHE_DIR: its parents as they come, itself 0700
        base.parent.mkdir(parents=True, exist_ok=True)
        made = _made(base, None)
    fd = _open_private(os.fspath(base), None, follow=True, made=made)
    for name in names:
        made = create and _made(name, fd)
        try:
            child = _open_private(name, fd, made=made)
        finally:
            os.close(fd)
        fd = child
    return fd


def _made(name: str | Path, dir_fd: int | None) -> bool:
    """Create directory `name` (0700); False when it exists already."""
    try:
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        return False
    return True


def _open_private(
    name: str, dir_fd: int | None, *, follow: bool = False, made: bool = False
) -> int:
    """Open directory `name` (relative to dir_fd; a link followed only when `follow`, for the
    directory the user named: QTOOL_CACHE_DIR or the home): a
    descriptor when it is private to this user, else OSError. `made`: just created by this
    process, so its mode is set to 0700 whatever the umask."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(name, flags, dir_fd=dir_fd)
    if made:
        os.fchmod(fd, 0o700)
    if not _is_private(os.fstat(fd)):
        os.close(fd)
        raise PermissionError(f"{name} is not private to this user")
    return fd


def _read_entry(dfd: int, name: str) -> bytes:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    fd = os.open(name, flags, dir_fd=dfd)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise PermissionError(name)
        raw = f.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise OSError(f"{name} is over {MAX_BYTES} bytes")
    return raw


def _write_entry(dfd: int, name: str, data: bytes) -> None:
    if len(data) > MAX_BYTES:
        return
    temp = f"{TEMP_PREFIX}{os.getpid()}-{os.urandom(6).hex()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temp, flags, 0o600, dir_fd=dfd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(temp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dfd)
        raise


def _sweep_temps(dfd: int) -> None:
    """Remove temp files that killed runs left behind (a day old)."""
    now = time.time()
    for entry in os.scandir(dfd):
        if entry.name.startswith(TEMP_PREFIX):
            with contextlib.suppress(OSError):
                if now - entry.stat(follow_symlinks=False).st_mtime > TEMP_MAX_AGE_S:
                    os.unlink(entry.name, dir_fd=dfd)
