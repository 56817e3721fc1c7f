"""Output directories that appear whole, never replace what they must not, and never lose data.

`DirTransaction(out, force=..., protected=...)`: `check()` before any work, then `with tx as
temp:` builds in `.<name>.qtool-tmp-<pid>-<random>/` beside `out`, locked (flock) for its whole
life so a later run's cleanup never takes it. On success the transaction writes a manifest of
what it built (`.qtool-export.json`: each file's size, and the SHA-256 of small ones), then
publishes in one atomic step without replacing anything unexpected (the manifest records files
by relative path, `1_Pooling/config.json`, and lists the subdirectories, so a subdirectory it
built is replaced only when every file in it is one it wrote, unchanged):

- `out` missing (or an empty directory): `renameat2(RENAME_NOREPLACE)` (fallback: an exclusive
  mkdir then a rename over that empty placeholder). A directory that appeared meanwhile is never
  replaced: the run fails, naming `out`, and leaves nothing.
- `out` a previous qtool export and `--force`: `out` is locked, checked again (every file is one
  its manifest lists, unchanged), and swapped with the temp directory by
  `renameat2(RENAME_EXCHANGE)`; the old export, now under the locked temp name, is checked once
  more (swapped back if anything else appeared) and removed. Without RENAME_EXCHANGE the old
  one is moved aside to `.<name>.qtool-old-<pid>-<random>` first and restored if the new one
  cannot take its place; a run killed in between leaves it there, locked by nobody, and the next
  run's cleanup (`remove_stale_dirs`) renames it back when `out` is missing.
- anything else (files qtool did not write, a symlink, a file, `-o .`) is refused in `check()`,
  before any work, naming up to three of the files that would be lost.

Errors inside the build name `out`, never the temp directory. Torch-free.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType

from qtool.errors import OutputError, QtoolError, UsageError
from qtool.io import renames
from qtool.io.atomic import describe_os_error, file_id
from qtool.io.safeopen import file_kind

MANIFEST = ".qtool-export.json"
MANIFEST_FORMAT = "qtool-export"
HASHED_MAX_BYTES = 16 << 20  # files this small (configs, tokenizers) are hashed, weights sized
MAX_DEPTH = 8  # subdirectory levels a manifest records (a copied subdirectory has at most 4)
LISTED = 3
_TEMP_DIR_RE = re.compile(r"^\.(.+)\.qtool-(tmp|old)-(\d+)-[0-9a-f]+$")


class DirTransaction:
    """Build a directory beside `out` and publish it as `out` (see the module docstring)."""

    def __init__(self, out: Path, *, force: bool, protected: Sequence[Path] = ()) -> None:
        self.out = out
        self.force = force
        self.protected = list(protected)
        self.temp = out.parent / f".{out.name}.qtool-tmp-{os.getpid()}-{secrets.token_hex(4)}"
        self._parent_fd = -1
        self._lock_fd = -1
        self._keep_temp = False  # the temp name holds data that is not ours to remove

    # ------------------------------------------------------------ before any work

    def check(self) -> None:
        """Refuse, before any work, an `out` this run may not write (see check_out_dir)."""
        check_out_dir(self.out, self.protected, self.force)

    # ------------------------------------------------------------ the build

    def __enter__(self) -> Path:
        self.check()
        parent = self.out.parent
        try:
            self._parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as err:
            raise OutputError(self.out, f"cannot open {parent}: {describe_os_error(err)}") from err
        remove_stale_dirs(parent)
        self._lock_fd = self._make_temp()
        return self.temp

    def _make_temp(self) -> int:
        """mkdir the temp directory and lock it; retried if a cleanup took it before the lock."""
        while True:
            try:
                os.mkdir(self.temp.name, 0o777, dir_fd=self._parent_fd)
                fd = os.open(
                    self.temp.name,
                    os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                    dir_fd=self._parent_fd,
                )
            except OSError as err:
                raise OutputError(
                    self.out, f"cannot create a directory in {self.out.parent}: "
                    f"{describe_os_error(err)}"
                ) from err  # fmt: skip
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _same(fd, self._parent_fd, self.temp.name):
                return fd
            os.close(fd)
            self.temp = self.temp.with_name(
                f".{self.out.name}.qtool-tmp-{os.getpid()}-{secrets.token_hex(4)}"
            )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc is None:
                self._publish()
                return
            self._discard()
            if isinstance(exc, QtoolError):
                _rename_paths(exc, self.temp, self.out)
        except BaseException as err:
            self._discard()
            if isinstance(err, QtoolError):
                _rename_paths(err, self.temp, self.out)
            raise
        finally:
            self._close()

    def _close(self) -> None:
        for fd in (self._lock_fd, self._parent_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._lock_fd = self._parent_fd = -1

    def _discard(self) -> None:
        """Remove the temp directory (the new build, or an old export swapped back out)."""
        if self._keep_temp:
            return
        if self._parent_fd >= 0:
            _rmtree_at(self._parent_fd, self.temp.name)
        else:
            shutil.rmtree(self.temp, ignore_errors=True)

    # ------------------------------------------------------------ publishing

    def _publish(self) -> None:
        try:
            write_manifest(self._lock_fd)
            os.fsync(self._lock_fd)
        except OSError as err:
            raise OutputError(self.out, f"cannot write: {describe_os_error(err)}") from err
        name = self.out.name
        st = _lstat_at(self._parent_fd, name)
        if st is not None and stat.S_ISDIR(st.st_mode) and _listdir_at(self._parent_fd, name):
            if not self.force:
                raise _appeared(self.out)
            self._replace()
        else:
            self._create(st)
        _fsync(self._parent_fd)

    def _create(self, st: os.stat_result | None) -> None:
        """`out` is missing or an empty directory: take its place, replacing nothing else."""
        name = self.out.name
        try:
            if st is None:
                renames.rename_noreplace(self._parent_fd, self.temp.name, name)
            elif stat.S_ISDIR(st.st_mode):
                os.rename(self.temp.name, name, src_dir_fd=self._parent_fd,
                          dst_dir_fd=self._parent_fd)  # fmt: skip
            else:
                raise _appeared(self.out)
        except (FileExistsError, IsADirectoryError, NotADirectoryError) as err:
            raise _appeared(self.out) from err
        except OSError as err:
            if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise _appeared(self.out) from err
            raise OutputError(
                self.out, f"cannot rename into place: {describe_os_error(err)}"
            ) from err

    def _replace(self) -> None:
        """--force over a previous export: lock it, check it, swap, check again, remove."""
        name = self.out.name
        old_fd = _open_dir_at(self._parent_fd, name)
        if old_fd < 0:
            raise _appeared(self.out)
        try:
            fcntl.flock(old_fd, fcntl.LOCK_EX)
            refuse_unknown_files(self.out, old_fd, self.protected)
            if not renames.exchange(self._parent_fd, self.temp.name, name):
                self._move_aside_and_replace(name)
            elif _same(old_fd, self._parent_fd, self.temp.name):
                self._check_swapped_out(old_fd, name)
                _rmtree_at(self._parent_fd, self.temp.name)  # the old export, locked by us
            else:  # the temp name holds something else: leave it alone
                self._keep_temp = True
        finally:
            os.close(old_fd)

    def _check_swapped_out(self, old_fd: int, name: str) -> None:
        """After the swap: if anything but the old export appeared in it meanwhile, swap back."""
        try:
            refuse_unknown_files(self.out, old_fd, self.protected)
        except OutputError:
            if not renames.exchange(self._parent_fd, self.temp.name, name):
                self._keep_temp = True
                raise OutputError(
                    self.out,
                    f"changed while this run replaced it; its previous content is in {self.temp}",
                ) from None
            raise

    def _move_aside_and_replace(self, name: str) -> None:
        """No RENAME_EXCHANGE here: move the old export aside (it stays locked by us), put the
        new one in its place, and only then remove the old one."""
        aside = f".{name}.qtool-old-{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(name, aside, src_dir_fd=self._parent_fd, dst_dir_fd=self._parent_fd)
        try:
            renames.rename_noreplace(self._parent_fd, self.temp.name, name)
        except OSError as err:
            os.rename(aside, name, src_dir_fd=self._parent_fd, dst_dir_fd=self._parent_fd)
            raise _appeared(self.out) from err
        _rmtree_at(self._parent_fd, aside)


# ---------------------------------------------------------------- checks


def check_out_dir(out: Path, protected: Sequence[Path], force: bool) -> None:
    """Refuse an output directory that is `.`/`..`, a symlink, not a directory, is/contains/
    lies inside a protected path (an input, its directory, a config), holds files qtool did
    not write (or anything without `force`), or whose parent is missing or read-only."""
    if out.name in ("", ".", ".."):
        raise UsageError(
            out, "name the output directory itself, not '.' or '..' (e.g. ../NAME)", hint="output"
        )
    refuse_nesting(out, protected)
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        st = None
    except OSError as err:
        raise OutputError(out, f"cannot check this output: {describe_os_error(err)}") from err
    if st is not None:
        _check_existing(out, st, protected, force)
    parent = out.parent
    if not parent.is_dir():
        raise OutputError(out, f"directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(out, f"directory {parent} is not writable; choose another location")


def _check_existing(out: Path, st: os.stat_result, protected: Sequence[Path], force: bool) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise OutputError(
            out,
            f"is a symlink (to {os.readlink(out)}); give the directory itself, "
            "qtool does not write through links",
        )
    if not stat.S_ISDIR(st.st_mode):
        kind = "a file" if stat.S_ISREG(st.st_mode) else file_kind(st.st_mode)
        raise OutputError(out, f"exists and is {kind}, not a directory; choose a directory name")
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not os.listdir(fd):
            return
        if not force:
            raise OutputError(
                out, "already exists and is not empty; it is replaced only when asked",
                hint="force",
            )  # fmt: skip
        refuse_unknown_files(out, fd, protected)
    finally:
        os.close(fd)


def refuse_nesting(out: Path, protected: Sequence[Path]) -> None:
    """OutputError when `out` is, lies inside, or contains a protected path, compared by
    (st_dev, st_ino) along the resolved chain of each (symlinks and bind mounts included)."""
    out_chain = _chain(out)
    out_id = file_id(out)
    for p in protected:
        pid = file_id(p)
        if pid is None:
            continue
        if out_id == pid:
            what = "the input directory" if p.is_dir() else f"the input {p}"
            raise OutputError(out, f"is {what}; choose another output directory")
        if pid in out_chain:
            raise OutputError(
                out, f"lies inside the input directory {p}; choose a directory outside it"
            )
        if out_id is not None and out_id in _chain(p):
            raise OutputError(
                out, f"contains the input {p}; replacing it would lose the input, "
                "choose another output directory"
            )  # fmt: skip


def _chain(path: Path) -> set[tuple[int, int]]:
    """(device, inode) of every directory above `path` (symlinks resolved), up to the root."""
    ids: set[tuple[int, int]] = set()
    current = Path(os.path.realpath(path.parent if path.name else path))
    for directory in (current, *current.parents):
        if (i := file_id(directory)) is not None:
            ids.add(i)
    return ids


def refuse_unknown_files(out: Path, fd: int, protected: Sequence[Path]) -> None:
    """OutputError naming up to three entries of the directory `fd` that are not files of a
    previous qtool export, unchanged since (or that are a protected file); a subdirectory the
    manifest records is checked entry by entry, never through a link."""
    recorded = _read_manifest(fd)
    guarded = {i for p in protected if (i := file_id(p)) is not None}
    unknown = _unknown_entries(fd, "", recorded, _recorded_dirs(fd), guarded)
    if not unknown:
        return
    shown = ", ".join(unknown[:LISTED]) + (
        f" and {len(unknown) - LISTED} more" if len(unknown) > LISTED else ""
    )
    what = "is not a qtool export" if recorded is None else "holds files qtool did not write"
    raise OutputError(
        out,
        f"{what} ({shown} would be lost); --force replaces only a previous qtool export "
        "left as qtool wrote it: move those files or choose another output directory",
    )


def _unknown_entries(
    fd: int,
    prefix: str,
    recorded: dict[str, dict[str, object]] | None,
    dirs: frozenset[str],
    guarded: set[tuple[int, int]],
) -> list[str]:
    """Entries under `fd` (named `prefix` + name) that are not recorded and unchanged."""
    unknown = []
    for name in sorted(os.listdir(fd)):
        rel = prefix + name
        if rel == MANIFEST:
            continue
        if rel in dirs and prefix.count("/") < MAX_DEPTH and _is_dir_at(fd, name):
            sub = _open_dir_at(fd, name)
            if sub >= 0:
                try:  # a mount in its place is not what qtool wrote
                    if os.fstat(sub).st_dev == os.fstat(fd).st_dev:
                        unknown += _unknown_entries(sub, rel + "/", recorded, dirs, guarded)
                        continue
                finally:
                    os.close(sub)
        if not _is_recorded(fd, name, rel, recorded, guarded):
            unknown.append(rel + ("/" if _is_dir_at(fd, name) else ""))
    return unknown


def _is_recorded(
    fd: int,
    name: str,
    rel: str,
    recorded: dict[str, dict[str, object]] | None,
    guarded: set[tuple[int, int]],
) -> bool:
    if recorded is None or rel not in recorded:
        return False
    st = _lstat_at(fd, name)
    if st is None or not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) in guarded:
        return False
    record = recorded[rel]
    if record.get("size") != st.st_size:
        return False
    digest = record.get("sha256")
    return digest is None or digest == _sha256_at(fd, name)


# ---------------------------------------------------------------- the manifest


def write_manifest(fd: int) -> None:
    """Record every regular file of the directory `fd` by its relative path (size; SHA-256 when
    small), and its subdirectories (at most MAX_DEPTH levels, never through a link)."""
    files: dict[str, dict[str, object]] = {}
    directories: list[str] = []
    _record(fd, "", files, directories)
    doc: dict[str, object] = {"format": MANIFEST_FORMAT, "version": 1, "files": files}
    if directories:
        doc["directories"] = directories
    data = json.dumps(doc, indent=1, ensure_ascii=False).encode() + b"\n"
    out = os.open(MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666, dir_fd=fd)
    with os.fdopen(out, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _record(
    fd: int, prefix: str, files: dict[str, dict[str, object]], directories: list[str]
) -> None:
    for name in sorted(os.listdir(fd)):
        st, rel = _lstat_at(fd, name), prefix + name
        if rel == MANIFEST or st is None:
            continue
        if stat.S_ISDIR(st.st_mode) and prefix.count("/") < MAX_DEPTH:
            sub = _open_dir_at(fd, name)
            if sub >= 0:
                directories.append(rel)
                try:
                    _record(sub, rel + "/", files, directories)
                finally:
                    os.close(sub)
        elif stat.S_ISREG(st.st_mode):
            small = st.st_size <= HASHED_MAX_BYTES
            files[rel] = {"size": st.st_size, "sha256": _sha256_at(fd, name) if small else None}


def _recorded_dirs(fd: int) -> frozenset[str]:
    """The subdirectories a manifest lists (none for a manifest without any)."""
    doc = _manifest_doc(fd)
    dirs = doc.get("directories") if doc is not None else None
    if not isinstance(dirs, list):
        return frozenset()
    return frozenset(d for d in dirs if isinstance(d, str))


def _read_manifest(fd: int) -> dict[str, dict[str, object]] | None:
    """The files a manifest lists, or None when there is no (valid) manifest."""
    doc = _manifest_doc(fd)
    files = doc.get("files") if doc is not None else None
    if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
        return None
    return files


def _manifest_doc(fd: int) -> dict[str, object] | None:
    """The manifest of the directory `fd`, None when there is no valid one."""
    try:
        mfd = os.open(MANIFEST, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    except OSError:
        return None
    with os.fdopen(mfd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        data = f.read(HASHED_MAX_BYTES + 1)
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        return None
    return doc


def _sha256_at(fd: int, name: str) -> str | None:
    try:
        ffd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    except OSError:
        return None
    digest = hashlib.sha256()
    with os.fdopen(ffd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------- cleanup of dead runs


def remove_stale_dirs(parent: Path) -> int:
    """Remove the temp directories of dead runs in `parent` (those whose lock can be taken);
    an old export a dead run had moved aside is renamed back when its name is free. Returns
    the count."""
    try:
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return 0
    removed = 0
    try:
        for name in os.listdir(fd):
            match = _TEMP_DIR_RE.match(name)
            if match and _remove_if_dead(fd, name, match.group(1), match.group(2)):
                removed += 1
    finally:
        os.close(fd)
    return removed


def _remove_if_dead(parent_fd: int, name: str, final: str, kind: str) -> bool:
    dfd = _open_dir_at(parent_fd, name)
    if dfd < 0:
        return False  # a temp file (atomic.remove_stale_temps) or gone
    try:
        try:
            fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # a live run holds it
        if not _same(dfd, parent_fd, name):
            return False
        if kind == "old" and _lstat_at(parent_fd, final) is None:
            with contextlib.suppress(OSError):
                renames.rename_noreplace(parent_fd, name, final)
                return True
        _rmtree_at(parent_fd, name)
        return True
    finally:
        os.close(dfd)


# ---------------------------------------------------------------- helpers


def _appeared(out: Path) -> OutputError:
    return OutputError(
        out,
        "appeared while this run was writing (another run or process); nothing was replaced "
        "and nothing of this run was left: run again, or choose another output directory",
    )


def _rename_paths(err: QtoolError, temp: Path, out: Path) -> None:
    """An error raised inside the build names `out`, as the user gave it, not the temp dir."""
    for attr in ("path", "message"):
        value = getattr(err, attr)
        if isinstance(value, str) and str(temp) in value:
            setattr(err, attr, value.replace(str(temp), str(out)))
    err.args = (err.message,)


def _same(fd: int, parent_fd: int, name: str) -> bool:
    st = _lstat_at(parent_fd, name)
    return st is not None and os.path.samestat(os.fstat(fd), st)


def _lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None


def _is_dir_at(dir_fd: int, name: str) -> bool:
    st = _lstat_at(dir_fd, name)
    return st is not None and stat.S_ISDIR(st.st_mode)


def _listdir_at(dir_fd: int, name: str) -> list[str]:
    fd = _open_dir_at(dir_fd, name)
    if fd < 0:
        return []
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def _open_dir_at(dir_fd: int, name: str) -> int:
    """A descriptor on the directory `name` (never through a link), or -1."""
    try:
        return os.open(
            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd
        )
    except OSError:
        return -1


def _rmtree_at(dir_fd: int, name: str) -> None:
    """Remove the directory `name` and all it holds, never following a link out of it."""
    with contextlib.suppress(OSError):
        shutil.rmtree(name, dir_fd=dir_fd)


def _fsync(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.fsync(fd)


@contextlib.contextmanager
def transaction(out: Path, *, force: bool, protected: Sequence[Path] = ()) -> Iterator[Path]:
    """`with transaction(out, ...) as temp:` (see DirTransaction)."""
    with DirTransaction(out, force=force, protected=protected) as temp:
        yield temp
