"""The calibration spill reserves its blocks with os.posix_fallocate where the platform has it:
on macOS (and Windows) os has no posix_fallocate, and the AttributeError, no OSError, crashed
every spilling run there. Without it the spill stays sparse, as where the kernel refuses."""

from __future__ import annotations

import errno
import os
import tempfile

import pytest

pytest.importorskip("transformers")

from qtool.engine.calibrate import sequential  # noqa: E402


def test_a_platform_without_posix_fallocate_keeps_the_sparse_spill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(os, "posix_fallocate", raising=False)
    with tempfile.TemporaryFile() as f:
        f.truncate(1 << 20)
        sequential._reserve(f.fileno(), 1 << 20)
        assert os.fstat(f.fileno()).st_size == 1 << 20


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL])
def test_a_kernel_that_cannot_reserve_keeps_the_sparse_spill(
    monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """(musl returns fallocate's own error; glibc writes a byte per block instead.)"""

    def refused(fd: int, offset: int, length: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "posix_fallocate", refused, raising=False)
    with tempfile.TemporaryFile() as f:
        sequential._reserve(f.fileno(), 1 << 20)
