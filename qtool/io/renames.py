"""Renames that never replace what they must not: `renameat2(RENAME_NOREPLACE)` and
`renameat2(RENAME_EXCHANGE)` (Linux 3.15+, through libc with ctypes), with fallbacks where the
kernel, libc or filesystem lacks them (EINVAL, ENOSYS):

- no-replace: `mkdir(new)` claims the name exclusively, then `rename(old, new)` replaces that
  empty placeholder (rename(2) replaces a directory only when it is empty, atomically);
- exchange: the caller moves the old directory aside and back itself (see outdir.py).

Names are relative to a directory descriptor, so a parent swapped meanwhile cannot redirect
them. Torch-free.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from collections.abc import Callable

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


def _libc_renameat2() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _libc_renameat2()
FORCE_FALLBACK = False  # tests set this to run the fallbacks on a kernel that has renameat2


def renameat2(dir_fd: int, old: str, new: str, flags: int) -> bool:
    """Rename `old` to `new` inside `dir_fd` with `flags`; True when done, False when this
    system cannot (the caller falls back); OSError for a real failure (EEXIST, ENOTEMPTY...)."""
    if _renameat2 is None or FORCE_FALLBACK:
        return False
    if _renameat2(dir_fd, os.fsencode(old), dir_fd, os.fsencode(new), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), new)


def rename_noreplace(dir_fd: int, old: str, new: str) -> None:
    """Rename directory `old` to `new` unless `new` exists (FileExistsError then)."""
    if renameat2(dir_fd, old, new, RENAME_NOREPLACE):
        return
    os.mkdir(new, dir_fd=dir_fd)  # FileExistsError: someone else has the name
    try:
        os.rename(old, new, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError:
        with contextlib.suppress(OSError):
            os.rmdir(new, dir_fd=dir_fd)  # only ever removes an empty directory
        raise


def exchange(dir_fd: int, a: str, b: str) -> bool:
    """Swap directories `a` and `b` atomically; False when this system cannot."""
    return renameat2(dir_fd, a, b, RENAME_EXCHANGE)
