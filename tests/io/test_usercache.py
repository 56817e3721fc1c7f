"""io/usercache.py: a miss, never an error, for anything but a sound entry of the user's own in
a directory no one else can write; atomic writes whose failures are silent."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from qtool.io import usercache

KEY = usercache.key_of("test", {"a": 1}, [1, 2])


def _entries(private_cache: Path) -> Path:
    """Where entries go: QTOOL_CACHE_DIR names an empty directory, which a first store tags as
    qtool's."""
    usercache.store(usercache.key_of("warm-up"), {})
    assert (private_cache / usercache.TAG).is_file()
    return private_cache


def test_a_stored_value_comes_back_under_its_key_only(private_cache: Path) -> None:
    usercache.store(KEY, {"x": [1, "two"]})
    assert usercache.load(KEY) == {"x": [1, "two"]}
    assert usercache.load(usercache.key_of("test", {"a": 2}, [1, 2])) is None
    (tag, entry) = sorted(private_cache.iterdir())  # the empty directory became qtool's
    assert entry.name == f"{KEY}.json" and entry.stat().st_mode & 0o777 == 0o600
    assert tag.name == usercache.TAG and tag.read_bytes() == usercache.TAG_TEXT


def test_keys_differ_by_every_part_and_not_by_dict_order() -> None:
    assert usercache.key_of("k", {"a": 1, "b": 2}) == usercache.key_of("k", {"b": 2, "a": 1})
    keys = {usercache.key_of(*p) for p in [("k", 1), ("k", 2), ("j", 1), ("k", 1, None)]}
    assert len(keys) == 4


@pytest.mark.parametrize("value", ["off", "OFF", "relative/dir", "~/x"])
def test_off_or_a_relative_path_turns_it_off(
    monkeypatch: pytest.MonkeyPatch, private_cache: Path, value: str
) -> None:
    monkeypatch.setenv(usercache.ENV, value)
    usercache.store(KEY, {"x": 1})
    assert usercache.load(KEY) is None and not list(private_cache.iterdir())


def test_the_default_place_follows_xdg_then_home_when_they_are_the_users(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(usercache.ENV)
    (tmp_path / "xdg").mkdir()
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert usercache.location() == (tmp_path / "xdg", ("qtool",))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/is/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert usercache.location() == (tmp_path / "home", (".cache", "qtool"))
    for home in ("", "relative", str(tmp_path / "missing")):
        monkeypatch.setenv("HOME", home)
        assert usercache.location() is None


def test_no_cache_in_a_home_of_another_user(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """root under sudo with the caller's HOME must not write where that user points it."""
    monkeypatch.delenv(usercache.ENV)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(usercache.os, "geteuid", lambda: os.stat(tmp_path).st_uid + 1)
    assert usercache.location() is None


def test_a_directory_others_can_write_is_not_read(private_cache: Path) -> None:
    usercache.store(KEY, {"x": 1})
    private_cache.chmod(0o777)
    assert usercache.load(KEY) is None
    private_cache.chmod(0o700)
    assert usercache.load(KEY) == {"x": 1}


def test_a_linked_entry_is_not_followed_but_a_named_directory_is(
    monkeypatch: pytest.MonkeyPatch, private_cache: Path, tmp_path: Path
) -> None:
    usercache.store(KEY, {"x": 1})
    link = tmp_path / "link"
    link.symlink_to(private_cache)
    monkeypatch.setenv(usercache.ENV, str(link))  # the user's own link: its target is the cache
    assert usercache.load(KEY) == {"x": 1}
    monkeypatch.setenv(usercache.ENV, str(private_cache))
    elsewhere = tmp_path / "elsewhere.json"
    entries = _entries(private_cache)
    (entries / f"{KEY}.json").rename(elsewhere)
    (entries / f"{KEY}.json").symlink_to(elsewhere)
    assert usercache.load(KEY) is None


def test_a_document_that_does_not_begin_with_its_key_is_never_parsed(
    monkeypatch: pytest.MonkeyPatch, private_cache: Path
) -> None:
    parsed: list[object] = []
    entries = _entries(private_cache)
    monkeypatch.setattr(usercache.json, "loads", lambda raw: parsed.append(raw))
    for doc in ("[" * 100_000, json.dumps({"value": {}, "key": KEY}), "not json"):
        (entries / f"{KEY}.json").write_text(doc)
        assert usercache.load(KEY) is None
    assert parsed == []


def test_a_fifo_or_huge_entry_is_a_miss_that_never_blocks(
    monkeypatch: pytest.MonkeyPatch, private_cache: Path
) -> None:
    entries = _entries(private_cache)
    os.mkfifo(entries / f"{KEY}.json")
    assert usercache.load(KEY) is None  # would hang on a blocking open of a FIFO
    (entries / f"{KEY}.json").unlink()
    monkeypatch.setattr(usercache, "MAX_BYTES", 100)
    usercache.store(KEY, {"x": "y" * 200})  # too big to keep
    assert not (entries / f"{KEY}.json").exists()
    big = json.dumps({"key": KEY, "value": {"x": "y" * 200}})
    (entries / f"{KEY}.json").write_text(big)
    assert usercache.load(KEY) is None


def test_a_cache_that_cannot_be_written_is_silently_skipped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(usercache.ENV, str(blocker / "cache"))
    usercache.store(KEY, {"x": 1})
    assert usercache.load(KEY) is None


def test_temp_files_of_killed_runs_are_swept_after_a_day(private_cache: Path) -> None:
    entries = _entries(private_cache)
    old, new = (entries / f"{usercache.TEMP_PREFIX}{n}-{n * 16}" for n in ("1", "2"))
    empty = entries / f"{usercache.TEMP_PREFIX}3-{'3' * 16}"  # killed before its first byte
    for path in (old, new):
        path.write_bytes(b'{"key":"linears-' + b"0" * 40 + b'","val')
    empty.write_bytes(b"")
    day_ago = time.time() - 2 * usercache.TEMP_MAX_AGE_S
    for path in (old, empty):
        os.utime(path, (day_ago, day_ago))
    usercache.store(KEY, {"x": 1})
    assert not old.exists() and not empty.exists() and new.exists()


def test_a_home_others_can_write_keeps_no_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """root with HOME=/tmp: whoever can write there could point .cache anywhere."""
    monkeypatch.delenv(usercache.ENV)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    home = tmp_path / "home"
    home.mkdir(mode=0o777)
    home.chmod(0o1777)
    monkeypatch.setenv("HOME", str(home))
    assert usercache.location() is None


def test_below_a_home_no_link_is_followed_and_new_levels_are_private(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(usercache.ENV)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    home, target = tmp_path / "home", tmp_path / "target"
    home.mkdir(mode=0o700)
    target.mkdir(mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    (home / ".cache").symlink_to(target)
    usercache.store(KEY, {"x": 1})
    assert not list(target.iterdir()) and usercache.load(KEY) is None
    (home / ".cache").unlink()
    old = os.umask(0o000)
    try:
        usercache.store(KEY, {"x": 1})
    finally:
        os.umask(old)
    for level in (home / ".cache", home / ".cache" / "qtool"):
        assert level.stat().st_mode & 0o777 == 0o700
    assert usercache.load(KEY) == {"x": 1}
