"""Issue 28, class 1: qtool deletes only files it wrote, and writes only where the user (not
another user) pointed it. The user cache (io/usercache.py) sweeps temp files only in a
directory qtool made and tagged, only under names qtool makes, only the user's regular files
that begin with qtool's marker; and a symlink another user planted on the way to the cache
(in a sticky directory such as /tmp) is never followed, whoever runs qtool."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from qtool.io import usercache

KEY = usercache.key_of("test", 1)
OTHER_UID = 54321  # a user who is not the one running qtool (nor root)
DAYS_AGO = time.time() - 2 * usercache.TEMP_MAX_AGE_S
DOC = b'{"key":"linears-' + b"0" * 40 + b'","value":{'  # how qtool's documents begin


def _aged(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    os.utime(path, (DAYS_AGO, DAYS_AGO), follow_symlinks=False)
    return path


def _snapshot(directory: Path) -> dict[str, bytes | str]:
    """Every name below `directory`, with its content (a link: its target)."""
    found: dict[str, bytes | str] = {}
    for path in sorted(directory.rglob("*")):
        name = str(path.relative_to(directory))
        if path.is_symlink():
            found[name] = os.readlink(path)
        elif path.is_file():
            found[name] = path.read_bytes()
    return found


def test_a_directory_of_the_users_is_never_swept(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """QTOOL_CACHE_DIR naming a directory of the user's: an export deleted their own 2-day-old
    `.tmp-notes`. Whatever is in it, however it is named, stays; qtool writes only inside its
    own subdirectory."""
    mine = tmp_path / "notes"
    mine.mkdir(mode=0o700)
    _aged(mine / ".tmp-notes", b"my notes")
    _aged(mine / f"{usercache.TEMP_PREFIX}1-{'a' * 16}", DOC + b"looks like qtool's")
    _aged(mine / usercache.TAG, b"Signature: 8a477f597d28d172789f06886806bc55\n")  # not qtool's
    before = _snapshot(mine)
    monkeypatch.setenv(usercache.ENV, str(mine))
    usercache.store(KEY, {"x": 1})
    usercache.store(usercache.key_of("test", 2), {"x": 2})
    assert usercache.load(KEY) == {"x": 1}
    after = _snapshot(mine)
    assert {k: v for k, v in after.items() if not k.startswith(f"{usercache.SUBDIR}/")} == before


def test_in_qtools_own_directory_only_its_temp_files_are_swept(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cache = tmp_path / "made-by-qtool"
    monkeypatch.setenv(usercache.ENV, str(cache))
    usercache.store(KEY, {"x": 1})  # qtool makes the directory and tags it
    assert (cache / usercache.TAG).read_bytes() == usercache.TAG_TEXT
    outside = _aged(tmp_path / "outside", DOC + b"a file of the user's")
    stale = _aged(cache / f"{usercache.TEMP_PREFIX}7-{'b' * 16}", DOC + b"{")
    kept = {
        ".tmp-notes": _aged(cache / ".tmp-notes", b"the user's"),
        "no marker": _aged(cache / f"{usercache.TEMP_PREFIX}8-{'c' * 16}", b"the user's"),
        "not qtool's name": _aged(cache / f"{usercache.TEMP_PREFIX}9-xyz", DOC),
        "fresh": cache / f"{usercache.TEMP_PREFIX}10-{'d' * 16}",
        "a link": cache / f"{usercache.TEMP_PREFIX}11-{'e' * 16}",
    }
    kept["fresh"].write_bytes(DOC)
    kept["a link"].symlink_to(outside)
    os.utime(kept["a link"], (DAYS_AGO, DAYS_AGO), follow_symlinks=False)
    usercache.store(usercache.key_of("test", 2), {"x": 2})
    assert not stale.exists()
    assert all(p.is_symlink() or p.exists() for p in kept.values())
    assert outside.read_bytes() == DOC + b"a file of the user's"


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's link needs root")
@pytest.mark.parametrize("where", ["the cache itself", "a parent of the cache", "the home"])
def test_another_users_link_in_a_sticky_directory_is_not_followed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, where: str
) -> None:
    """Root runs an export with QTOOL_CACHE_DIR (or HOME) through /tmp, where another user
    planted a link to a directory private to root: root wrote its entry there and swept it."""
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    target = tmp_path / "roots-private"
    target.mkdir(mode=0o700)
    _aged(target / ".tmp-notes", b"root's notes")
    link = sticky / "cache"
    link.symlink_to(target)
    os.lchown(link, OTHER_UID, OTHER_UID)
    before = _snapshot(target)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    if where == "the home":
        monkeypatch.delenv(usercache.ENV)
        monkeypatch.setenv("HOME", str(link))
        assert usercache.location() is None
    else:
        named = link if where == "the cache itself" else link / "qtool"
        monkeypatch.setenv(usercache.ENV, str(named))
    usercache.store(KEY, {"x": 1})
    assert usercache.load(KEY) is None
    assert _snapshot(target) == before
    os.lchown(link, 0, 0)  # the same link, root's own: followed
    if where != "the home":
        usercache.store(KEY, {"x": 1})
        assert usercache.load(KEY) == {"x": 1}
