"""A no-replace rename whose call is retried (NFS resends a rename or link() whose reply was
lost; the server answers the resend with EEXIST for the name the first one made) is the
commit's own success, not a file that "appeared": the output lands complete, no temp is left.
A name that holds anyone else's file is still refused (test_commit_races_lose_nothing.py)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from qtool.io import atomic, renames
from qtool.io.atomic import OutputSet
from tests.outputs import leftovers


@pytest.mark.parametrize("call", ["renameat2", "link"])
def test_an_eexist_for_our_own_rename_or_link_is_success(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    final = tmp_path / "a.gguf"
    real_renameat2, real_link = renames.renameat2, os.link
    calls: list[str] = []

    def renameat2(dir_fd: int, old: str, new: str, flags: int) -> bool:
        calls.append("renameat2")
        if call == "link":
            return False  # no renameat2 here: the link() fallback
        assert real_renameat2(dir_fd, old, new, flags)
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), new)

    def link(old: str, new: str, **kw: int | bool) -> None:
        calls.append("link")
        real_link(old, new, **kw)  # type: ignore[arg-type]
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), new)

    monkeypatch.setattr(renames, "renameat2", renameat2)
    monkeypatch.setattr(os, "link", link)
    atomic.preflight([final], [], force=False)
    with OutputSet() as outputs:
        outputs.create(final).write(b"ours")
        outputs.commit()
    assert calls == (["renameat2"] if call == "renameat2" else ["renameat2", "link"])
    assert final.read_bytes() == b"ours" and final.stat().st_nlink == 1
    assert leftovers(tmp_path) == [] and os.listdir(tmp_path) == ["a.gguf"]
