"""An imatrix read is tried once more after a change of the file's status alone only when the
read failed because the file changed (a ChangedError, raised by every site that means it:
the readers' short reads and their stamp checks), whatever the message's words; any other
error is reported at once. The retry was decided by "changed while" in the message: a reworded
message lost the retry, and another error whose text held those words was read again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import qtool.formats.imatrix as imatrix_format
from qtool.errors import ChangedError, InputError
from qtool.formats.imatrix import dat as dat_format
from tests.reliability.test_imatrix_hostile import ONE, TAIL, dat


def _chmod(path: Path) -> None:
    """A change of the status alone: the ctime moves (waiting for the clock to tick)."""
    before = os.stat(path).st_ctime_ns
    mode = os.stat(path).st_mode & 0o777
    while os.stat(path).st_ctime_ns == before:
        os.chmod(path, mode ^ 0o040)
        os.chmod(path, mode)


@pytest.mark.parametrize(
    ("error", "retried"),
    [(ChangedError, True), (InputError, False)],
    ids=["changed-reworded", "other-error-saying-changed-while"],
)
def test_the_retry_follows_the_error_type_not_its_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: type[InputError], retried: bool
) -> None:
    path = tmp_path / "m.dat"
    path.write_bytes(dat([ONE], TAIL))
    real, calls = dat_format._trailer, []
    words = "its stamp moved" if error is ChangedError else "changed while: a bad trailer"

    def failing_once(*args: object) -> object:
        calls.append(None)
        if len(calls) == 1:
            _chmod(path)
            raise error(path, words)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(dat_format, "_trailer", failing_once)
    if retried:
        got = imatrix_format.read_imatrix_file(path)
        assert len(calls) == 2 and got.imatrix.entries
    else:
        with pytest.raises(InputError, match=words):
            imatrix_format.read_imatrix_file(path)
        assert len(calls) == 1


def test_a_rewrite_during_the_read_is_a_changed_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The readers' own checks raise the type the retry looks for."""
    path = tmp_path / "m.dat"
    path.write_bytes(dat([ONE], TAIL))
    real = dat_format._trailer

    def then_append(*args: object) -> object:
        out = real(*args)  # type: ignore[arg-type]
        with open(path, "ab") as f:
            f.write(b"\0")
        return out

    monkeypatch.setattr(dat_format, "_trailer", then_append)
    with pytest.raises(ChangedError, match="changed while qtool was reading it"):
        imatrix_format.read_imatrix_file(path)
