"""A logits file (`qtool eval --save-logits`, read by `--logits`) is read within bounds: a
hostile or damaged file is refused with one InputError naming it, before any array it
describes is allocated (a header may claim any count), and never yields a value out of range
(an id past the vocabulary would index out of bounds; a NaN would pass every gate as NaN)."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from qtool.errors import InputError
from qtool.formats import logits_file as lf
from qtool.formats.logits_file import LogitsInfo, read_logits, tokens_digest, write_logits
from qtool.numerics.logits import float_rows

VOCAB = 40
WINDOWS = (6, 6, 3)


def valid() -> bytes:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (sum(WINDOWS),), generator=gen)
    rows, start = [], 0
    for n in WINDOWS:
        window = ids[start : start + n]
        rows.append(float_rows(torch.randn(n, VOCAB, generator=gen) * 3, window, coded=True))
        start += n
    info = LogitsInfo(
        "a" * 64, "t.txt", tokens_digest(ids.tolist()), len(ids), 6, "float32", "c" * 64,
        "d" * 64, "LlamaForCausalLM", VOCAB, WINDOWS,
    )  # fmt: skip
    out = io.BytesIO()
    write_logits(out, info, ids.tolist(), rows, {"w": "e" * 64})
    return out.getvalue()


def split(data: bytes) -> tuple[bytes, dict[str, object], bytes]:
    length = struct.unpack_from("<Q", data, 16)[0]
    return data[:24], json.loads(data[24 : 24 + length]), data[24 + length :]


def join(header: dict[str, object], payload: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<8sIIQ", lf.MAGIC, lf.VERSION, 0, len(text)) + text + payload


def refused(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "x.qlogits"
    path.write_bytes(data)
    with pytest.raises(InputError, match=message) as err:
        read_logits(path)
    assert err.value.path == str(path) and "\n" not in str(err.value)


def test_a_valid_file_reads_back_what_was_written(tmp_path: Path) -> None:
    path = tmp_path / "ok.qlogits"
    path.write_bytes(valid())
    info, ids, rows, digests = read_logits(path)
    assert info.windows == WINDOWS and len(ids) == sum(WINDOWS) and digests == {"w": "e" * 64}
    assert [r.nll.shape[0] for r in rows] == [n - 1 for n in WINDOWS]
    assert all(r.coded is not None and r.coded.codes.shape == (r.nll.shape[0], VOCAB)
               for r in rows)  # fmt: skip


def test_wrong_magic_version_and_truncation_are_refused(tmp_path: Path) -> None:
    data = valid()
    refused(tmp_path, b"NOTQTOOL" + data[8:], "not a qtool logits file")
    refused(tmp_path, data[:8] + struct.pack("<I", 9) + data[12:], "version 9")
    refused(tmp_path, data[:-1], "size is not what its header describes")
    refused(tmp_path, data + b"\0", "size is not what its header describes")
    refused(tmp_path, data[:30], "header ends early|invalid JSON")
    refused(tmp_path, b"", "not a qtool logits file")


def test_a_huge_header_or_payload_claim_is_refused_before_reading(tmp_path: Path) -> None:
    """Counts are checked against the bounds before any array is read or allocated."""
    data = valid()
    refused(tmp_path, data[:16] + struct.pack("<Q", 1 << 40) + data[24:], "header of")
    _, header, payload = split(data)
    big = 1 << 31  # one window of 2^31 tokens: 64 PiB of arrays, claimed in a small header
    huge = dict(header, windows=[big], ctx=big)
    huge["tokens"] = {**header["tokens"], "count": big}  # type: ignore[dict-item]
    huge["model"] = {**header["model"], "vocab": lf.MAX_VOCAB}  # type: ignore[dict-item]
    refused(tmp_path, join(huge, payload), "arrays of .* bytes are over")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"coding": {"bits": 8, "range_nats": 24.0, "steps": 254}}, "coding"),
        ({"model": {"vocab": 0}}, "model.vocab|config_sha256"),
        ({"windows": [6, 6, 2]}, "do not add up"),
        ({"windows": [1, 11, 3]}, "windows"),
        ({"ctx": 5}, "longer than ctx"),
        ({"version": 2}, "version 1"),
        ({"parameters": ["w"]}, "parameters"),
        ({"dtype": 5}, "dtype|expected a string"),
    ],
    ids=["coding", "vocab", "windows-sum", "window-of-1", "ctx", "version", "params", "dtype"],
)
def test_header_fields_out_of_range_are_refused(
    tmp_path: Path, change: dict[str, object], message: str
) -> None:
    _, header, payload = split(valid())
    refused(tmp_path, join(dict(header, **change), payload), message)


def payload_offsets() -> dict[str, int]:
    n_tok = sum(WINDOWS)
    n = n_tok - len(WINDOWS)
    return {"ids": 0, "nll": 4 * n_tok, "argmax": 4 * (n_tok + n), "scale": 4 * (n_tok + 2 * n),
            "floor": 4 * (n_tok + 3 * n), "codes": 4 * (n_tok + 4 * n)}  # fmt: skip


@pytest.mark.parametrize(
    ("array", "value", "message"),
    [
        ("ids", struct.pack("<i", VOCAB), "token id is outside the vocabulary"),
        ("argmax", struct.pack("<i", -1), "argmax is outside the vocabulary"),
        ("nll", struct.pack("<f", float("nan")), "NLL is negative, infinite or NaN"),
        ("nll", struct.pack("<f", -1.0), "NLL is negative, infinite or NaN"),
        ("scale", struct.pack("<f", float("nan")), "scale or floor is out of range"),
        ("scale", struct.pack("<f", -1.0), "scale or floor is out of range"),
        ("floor", struct.pack("<f", 3.0), "scale or floor is out of range"),
        ("floor", struct.pack("<f", -80.0), "do not sum to 1"),
        ("codes", struct.pack("<40H", *[65535] * 40), "do not sum to 1"),
    ],
)
def test_values_out_of_range_are_refused(
    tmp_path: Path, array: str, value: bytes, message: str
) -> None:
    prefix, header, payload = split(valid())
    at = payload_offsets()[array]
    bad = payload[:at] + value + payload[at + len(value) :]
    refused(tmp_path, join(header, bad), message)


def test_token_ids_changed_after_writing_are_refused(tmp_path: Path) -> None:
    _, header, payload = split(valid())
    first = struct.unpack_from("<i", payload)[0]
    bad = struct.pack("<i", (first + 1) % VOCAB) + payload[4:]
    refused(tmp_path, join(header, bad), "token ids do not match")


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "f.qlogits"
    os.mkfifo(fifo)
    with pytest.raises(InputError):
        read_logits(fifo)


def patched(payload: bytes, array: str, index: int, value: bytes) -> bytes:
    at = payload_offsets()[array] + index * len(value)
    return payload[:at] + value + payload[at + len(value) :]


@pytest.mark.parametrize(
    ("array", "index", "value", "message"),
    [
        ("nll", 2, struct.pack("<f", float("inf")), "NLL is negative, infinite or NaN"),
        ("nll", 2, struct.pack("<f", 1e30), "NLL disagrees"),
        ("nll", 7, struct.pack("<f", 0.0), "NLL disagrees"),
        ("argmax", 3, None, "argmax is not"),
    ],
    ids=["nll-inf", "nll-huge", "nll-zero", "argmax-not-the-top"],
)
def test_figures_that_disagree_with_the_codes_are_refused(
    tmp_path: Path, array: str, index: int, value: bytes | None, message: str
) -> None:
    """The NLL and argmax are stored beside the codes, so a file can make them say anything
    (an NLL of +inf once made ln(PPL ratio) -inf and passed a gate): each is checked against
    the codes it was written with."""
    _, header, payload = split(valid())
    if value is None:  # the argmax moved to the position's least probable token
        codes = torch.frombuffer(
            bytearray(payload[payload_offsets()["codes"] :]), dtype=torch.int16
        )
        row = codes.view(-1, VOCAB)[index].to(torch.int32) & 0xFFFF
        value = struct.pack("<i", int(row.argmin()))
    refused(tmp_path, join(header, patched(payload, array, index, value)), message)


def test_every_nll_and_argmax_of_a_valid_file_agrees_with_its_codes(tmp_path: Path) -> None:
    """The cross-check holds for what write_logits writes (no false refusal), at every scored
    position of several random windows, including near-ties and near-certain positions."""
    gen = torch.Generator().manual_seed(1)
    windows = (64, 64, 17)
    ids = torch.randint(0, VOCAB, (sum(windows),), generator=gen)
    rows, start = [], 0
    for i, n in enumerate(windows):
        logits = torch.randn(n, VOCAB, generator=gen) * (0.01, 3.0, 40.0)[i]
        rows.append(float_rows(logits, ids[start : start + n], coded=True))
        start += n
    info = LogitsInfo("a" * 64, "t", tokens_digest(ids.tolist()), len(ids), 64, "float32",
                      "c" * 64, "d" * 64, "X", VOCAB, windows)  # fmt: skip
    path = tmp_path / "ok.qlogits"
    with path.open("wb") as f:
        write_logits(f, info, ids.tolist(), rows, {})
    assert len(read_logits(path)[2]) == 3


def test_the_header_is_checked_against_the_run_before_any_array_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A big file made for another text (or with a size its header does not describe, e.g.
    sparse) is refused having read its header only: what the arrays take is never allocated
    for a file this run cannot use."""
    reads: list[int] = []
    real = lf._read_exactly

    def counted(f: Any, n: int, p: Path) -> bytearray:
        reads.append(n)
        return real(f, n, p)

    monkeypatch.setattr(lf, "_read_exactly", counted)
    path = tmp_path / "x.qlogits"
    path.write_bytes(valid())

    def other_text(info: LogitsInfo) -> None:
        raise InputError(path, "its text (SHA-256) differs")

    with pytest.raises(InputError, match="text"):
        read_logits(path, other_text)
    with path.open("r+b") as f:  # a hole: the size says more than the header does
        f.truncate(path.stat().st_size + (1 << 30))
    with pytest.raises(InputError, match="size is not what its header describes"):
        read_logits(path)
    assert reads == []


def test_a_huge_vocabulary_is_checked_in_bounded_steps(tmp_path: Path) -> None:
    """A file claiming 2^24 tokens of vocabulary (sparse on disk, 256 MiB of codes) is refused
    with an InputError within 1.5 GiB more address space than the interpreter holds: the
    probability checks go a bounded number of codes at a time (256 rows at once was 4 GiB of
    float64 temporaries, a MemoryError)."""
    import subprocess
    import sys

    _, header, _ = split(valid())
    n, vocab = 8, lf.MAX_VOCAB
    big = dict(header, windows=[n + 1], ctx=n + 1)
    big["tokens"] = {"count": n + 1, "sha256": tokens_digest([0] * (n + 1))}
    big["model"] = {**header["model"], "vocab": vocab}  # type: ignore[dict-item]
    path = tmp_path / "huge.qlogits"
    with path.open("wb") as f:
        f.write(join(big, b""))
        f.truncate(f.tell() + 4 * (n + 1) + 16 * n + 2 * n * vocab)
    script = f"""
import resource, sys
from pathlib import Path
from qtool.errors import InputError
from qtool.formats.logits_file import read_logits
size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + (3 << 29), size + (3 << 29)))
try:
    read_logits(Path({str(path)!r}))
except InputError as err:
    print("refused:", err)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert "refused:" in done.stdout and "do not sum to 1" in done.stdout, done.stderr[-2000:]
