"""The checks an output directory passes before any work (and, for an old export, again just
before it is replaced): not `.`/`..`, a symlink, a mount point or a non-directory; never an
input, nor containing or lying inside one (by device and inode); with `--force`, holding only
the files of a previous qtool export, unchanged since (manifest.py). Used by outdir.py and by
sharded qtool runs. Torch-free.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

from qtool.errors import OutputError, UsageError
from qtool.io import tempdirs as td
from qtool.io.atomic import describe_os_error, file_id
from qtool.io.manifest import MANIFEST, Record, read_directories, read_manifest, unchanged
from qtool.io.mounts import is_mount_point, mount_points
from qtool.io.safeopen import file_kind

LISTED = 3


def check_out_dir(out: Path, protected: Sequence[Path], force: bool) -> None:
    """Refuse an output directory that is `.`/`..`, a symlink, a mount point, not a directory,
    is/contains/lies inside a protected path (an input, its directory, a config), holds files
    qtool did not write (or anything without `force`), or whose parent is missing or
    read-only."""
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
            f"is a symlink{_link_target(out)}; give the directory itself, "
            "qtool does not write through links",
        )
    if not stat.S_ISDIR(st.st_mode):
        kind = "a file" if stat.S_ISREG(st.st_mode) else file_kind(st.st_mode)
        raise OutputError(out, f"exists and is {kind}, not a directory; choose a directory name")
    if is_mount_point(out):
        raise OutputError(out, MOUNT_POINT)
    try:
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:  # gone, or swapped for a link or a file, since the lstat
        raise OutputError(
            out, f"changed while qtool checked it ({err.strerror}); nothing was written: run again"
        ) from err
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


MOUNT_POINT = (
    "is a mount point; qtool publishes an output directory by renaming it into place, which a "
    "mount point cannot take: write to a new directory inside it (-o MOUNT/NAME) or elsewhere"
)


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
                out, f"lies inside the input directory {_named(p)}; choose a directory outside it"
            )
        if out_id is not None and out_id in _chain(p):
            raise OutputError(
                out, f"contains the input {p}; replacing it would lose the input, "
                "choose another output directory"
            )  # fmt: skip


def _named(path: Path) -> Path:
    """`path` as a message names it: `.` and `..` spelled out."""
    return path if path.name not in ("", ".", "..") else Path(os.path.abspath(path))


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
    manifest lists (`1_Pooling/`) is checked entry by entry, never through a link or a mount."""
    recorded = read_manifest(fd)
    guarded = {i for p in protected if (i := file_id(p)) is not None}
    unknown = _unknown_entries(fd, "", recorded, read_directories(fd), guarded)
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
    recorded: dict[str, Record] | None,
    directories: frozenset[str],
    guarded: set[tuple[int, int]],
) -> list[str]:
    """The entries of the directory `fd` (named `prefix` + name) that are not recorded and
    unchanged, the listed subdirectories' included."""
    mounted = _mounted_in(fd)  # a file mounted over a listed one is never ours to delete
    unknown = []
    for name in sorted(os.listdir(fd)):
        rel = prefix + name
        if rel == MANIFEST:
            continue
        st = td.lstat_at(fd, name)
        if rel in directories and st is not None and (st.st_dev, st.st_ino) not in mounted:
            sub = td.open_dir_at(fd, name)
            if sub >= 0:
                try:
                    if td.same_at(sub, fd, name):
                        unknown += _unknown_entries(sub, rel + "/", recorded, directories, guarded)
                        continue
                finally:
                    os.close(sub)
        if not _is_recorded(fd, name, rel, recorded, guarded | mounted):
            unknown.append(rel + ("/" if td.is_dir_at(fd, name) else ""))
    return unknown


def _mounted_in(fd: int) -> set[tuple[int, int]]:
    """(device, inode) of the entries of the directory `fd` that are mount points, or lie on
    another device than the directory."""
    try:
        base = os.readlink(f"/proc/self/fd/{fd}")
        device = os.fstat(fd).st_dev
        names = os.listdir(fd)
    except OSError:
        return set()
    points = mount_points()
    found = set()
    for name in names:
        st = td.lstat_at(fd, name)
        if st is not None and (st.st_dev != device or os.path.join(base, name) in points):
            found.add((st.st_dev, st.st_ino))
    return found


def _is_recorded(
    fd: int,
    name: str,
    rel: str,
    recorded: dict[str, Record] | None,
    guarded: set[tuple[int, int]],
) -> bool:
    if recorded is None or rel not in recorded:
        return False
    st = td.lstat_at(fd, name)
    if st is None or not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) in guarded:
        return False
    return unchanged(fd, name, recorded[rel])


def _link_target(path: Path) -> str:
    """' (to TARGET)', or nothing when the link changed since."""
    try:
        return f" (to {os.readlink(path)})"
    except OSError:
        return ""
