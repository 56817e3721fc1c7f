"""A cache of facts that take seconds to learn and never change for the same inputs (which
nn.Linear modules transformers builds from a config.json): small JSON documents in the user's
cache directory, each named by a hash of everything the fact depends on.

Where: $QTOOL_CACHE_DIR (an absolute path; `off` turns the cache off), else
$XDG_CACHE_HOME/qtool, else ~/.cache/qtool, the latter two only when that home belongs to the
user running qtool and no one else can write it (root under sudo with another user's HOME keeps
no cache there). The path is walked from / one component at a time: a symlink on the way is
followed only when the link itself is the user's or root's (another user's link planted in a
sticky /tmp is never followed, whatever the kernel's protected_symlinks says), and below a
home no link is followed at all. Each level qtool uses is private to the user (missing levels
are made 0700).

qtool deletes only files it wrote. Entries live in a directory tagged with a CACHEDIR.TAG of
qtool's, which qtool writes only into a directory it made or found empty (a non-empty
directory the user named gets a `qtool` subdirectory, and nothing of the user's is ever
touched); the sweep of temp files that killed runs left behind looks only there, only at names
qtool makes (`.qtool-cache-tmp-<pid>-<16 hex>`), and removes only the user's regular files a
day old that begin as qtool's documents do (`{"key":"<kind>-<40 hex>"`), or are empty (killed
before their first byte).

A document is read only from such a directory, through O_NOFOLLOW, as a regular file of the
user's of bounded size that names the key it was asked for; anything else is a miss, never an
error: the caller computes the fact again. Writes are atomic (temp file, rename) and their
failures are ignored (a read-only home, a full disk). Torch-free.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import time
from pathlib import Path

ENV = "QTOOL_CACHE_DIR"
OFF = "off"
SCHEMA = 1
MAX_BYTES = 4 << 20
MARKER = re.compile(rb'\{"key":"[a-z][a-z0-9_]*-[0-9a-f]{40}"')  # how every document begins
TEMP_PREFIX = ".qtool-cache-tmp-"
TEMP_NAME = re.compile(r"\.qtool-cache-tmp-[0-9]{1,10}-[0-9a-f]{16}\Z")
TEMP_MAX_AGE_S = 24 * 3600  # a temp file this old was left by a killed run
TAG = "CACHEDIR.TAG"
TAG_TEXT = (  # https://bford.info/cachedir/: backup tools skip the directory
    b"Signature: 8a477f597d28d172789f06886806bc55\n"
    b"# This file is a cache directory tag created by qtool.\n"
    b"# For information about cache directory tags see https://bford.info/cachedir/\n"
)
SUBDIR = "qtool"  # qtool's own directory inside a directory of the user's it did not make
MAX_LINKS = 40  # as the kernel's limit on links in one path
_MARKER_BYTES = 64
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


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
        fd, _ = _walk(path, create=False)
    except OSError:
        return False
    try:
        return _is_private(os.fstat(fd))
    finally:
        os.close(fd)


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
    """A descriptor of the cache directory: private to this user and tagged as qtool's (made
    so, with its missing levels, when `create`); OSError when there is none."""
    found = location()
    if found is None:
        raise FileNotFoundError("no cache directory")
    base, names = found
    fd, made = _walk(os.fspath(base), create=create and not names)  # QTOOL_CACHE_DIR: made
    fd = _checked(fd, made)  # each step below closes the descriptor it is given on failure
    for name in names:
        try:
            made = create and _made(name, fd, 0o700)
        except BaseException:
            os.close(fd)
            raise
        fd = _checked(_descend(fd, name), made)
    return _qtools_own(fd, made, create)


def _walk(path: str, *, create: bool) -> tuple[int, bool]:
    """A descriptor of directory `path` (absolute), walked from / one component at a time,
    and whether its last level was made here. A symlink on the way is followed only when the
    link itself belongs to this user or root: anyone may plant one in a sticky directory such
    as /tmp, and following it by its target's owner let root's run write and sweep wherever
    another user pointed it (the kernel's protected_symlinks, off in many containers, is not
    relied on). Missing levels are made when `create` (the last 0700, the others as the umask
    says)."""
    todo = [p for p in reversed(path.split("/")) if p not in ("", ".")]
    fd, made, links = os.open("/", _DIR_FLAGS), False, 0
    try:
        while todo:
            name = todo.pop()
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                made = False
            except FileNotFoundError:
                if not create:
                    raise
                made = _made(name, fd, 0o700 if not todo else 0o777)
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                links += 1
                todo += _link_parts(fd, name, st, links)
                if todo and todo[-1] == "/":  # an absolute target: from / again
                    todo.pop()
                    fd = _replace(fd, os.open("/", _DIR_FLAGS))
                continue
            fd = _replace(fd, os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd))
        return fd, made
    except BaseException:
        os.close(fd)
        raise


def _link_parts(dfd: int, name: str, st: os.stat_result, links: int) -> list[str]:
    """The components of link `name`'s target, to walk next (reversed, "/" last when absolute);
    PermissionError for a link owned by anyone but this user or root, or too many links."""
    if st.st_uid not in (os.geteuid(), 0):
        raise PermissionError(f"{name} is a link of uid {st.st_uid}, not followed")
    if links > MAX_LINKS:
        raise OSError(f"more than {MAX_LINKS} links")
    target = os.readlink(name, dir_fd=dfd)
    again = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    if (again.st_ino, again.st_dev, again.st_uid) != (st.st_ino, st.st_dev, st.st_uid):
        raise PermissionError(f"{name} was replaced while qtool read it")
    parts = [p for p in reversed(target.split("/")) if p not in ("", ".")]
    return [*parts, "/"] if target.startswith("/") else parts


def _replace(old: int, new: int) -> int:
    os.close(old)
    return new


def _made(name: str, dir_fd: int, mode: int) -> bool:
    """Create directory `name`; False when it exists already."""
    try:
        os.mkdir(name, mode, dir_fd=dir_fd)
    except FileExistsError:
        return False
    return True


def _descend(dfd: int, name: str) -> int:
    """Directory `name` in `dfd`, never through a link; closes `dfd`."""
    try:
        return os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=dfd)
    finally:
        os.close(dfd)


def _checked(fd: int, made: bool) -> int:
    """`fd` when its directory is private to this user, else OSError (and `fd` closed).
    `made`: just created by this process, so its mode is set to 0700 whatever the umask."""
    try:
        if made:
            os.fchmod(fd, 0o700)
        if not _is_private(os.fstat(fd)):
            raise PermissionError("the cache directory is not private to this user")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _qtools_own(fd: int, made: bool, create: bool) -> int:
    """The directory qtool keeps its entries in: `fd`'s when qtool made it, tagged it before
    or finds it empty (tagged now, when `create`), else its SUBDIR, likewise: in a directory
    of the user's that QTOOL_CACHE_DIR names, nothing but SUBDIR is ever written or swept."""
    try:
        if _adopted(fd, made, create):
            return fd
        sub_made = create and _made(SUBDIR, fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    sub = _checked(_descend(fd, SUBDIR), sub_made)
    try:
        if not _adopted(sub, sub_made, create):
            raise PermissionError(f"{SUBDIR}/ is not a cache directory of qtool's")
    except BaseException:
        os.close(sub)
        raise
    return sub


def _adopted(dfd: int, made: bool, create: bool) -> bool:
    """Whether the directory is qtool's cache: tagged, or made by this run or empty (nothing
    of the user's in it) and tagged now when `create`."""
    if _tagged(dfd):
        return True
    if create and (made or not os.listdir(dfd)):
        _write_tag(dfd)
        return True
    return False


def _write_tag(dfd: int) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(TAG, flags, 0o600, dir_fd=dfd)
    with os.fdopen(fd, "wb") as f:
        f.write(TAG_TEXT)


def _tagged(dfd: int) -> bool:
    """Whether the directory holds qtool's CACHEDIR.TAG (a regular file of this user's)."""
    try:
        fd = os.open(TAG, _FILE_FLAGS, dir_fd=dfd)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return False
        return f.read(len(TAG_TEXT) + 1) == TAG_TEXT


def _read_entry(dfd: int, name: str) -> bytes:
    fd = os.open(name, _FILE_FLAGS, dir_fd=dfd)
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
    temp = f"{TEMP_PREFIX}{os.getpid()}-{os.urandom(8).hex()}"
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
    """Remove the temp files that killed runs left behind (a day old), and nothing else."""
    now = time.time()
    for entry in os.scandir(dfd):
        if TEMP_NAME.match(entry.name):
            with contextlib.suppress(OSError):
                _remove_stale_temp(dfd, entry.name, now)


def _remove_stale_temp(dfd: int, name: str, now: float) -> None:
    """Unlink `name` if it is a temp file of qtool's: a regular file of this user's, a day old,
    beginning as qtool's documents do (or empty), checked on its own descriptor (a link is
    never opened)."""
    fd = os.open(name, _FILE_FLAGS, dir_fd=dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return
        if now - st.st_mtime <= TEMP_MAX_AGE_S:
            return
        if st.st_size and not MARKER.match(os.pread(fd, _MARKER_BYTES, 0)):
            return
    finally:
        os.close(fd)
    again = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    if (again.st_ino, again.st_dev) == (st.st_ino, st.st_dev):
        os.unlink(name, dir_fd=dfd)
