"""Reads into one reused buffer (io/readbuffer.py, Checkpoint.rows): the same bytes as fresh
reads, memory that does not grow past the largest read, and a file truncated under the reader
an error (never SIGBUS: nothing is mapped from the file)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qtool.errors import InputError
from qtool.io.checkpoint import open_checkpoint
from qtool.io.readbuffer import ReadBuffer


@pytest.fixture
def model(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "m.safetensors"
    tensors = {"a": torch.randn(300, 7, generator=g), "b": torch.randn(5, 3, 2, generator=g)}
    tensors |= {"c": torch.randn(40, generator=g).bfloat16(), "d": torch.tensor(2.5)}
    save_file(tensors, path)
    return path


def test_rows_read_into_a_reused_buffer_equal_fresh_reads(model: Path) -> None:
    ckpt = open_checkpoint(model)
    buffer = ReadBuffer()
    for entry in ckpt.entries:
        whole = ckpt.tensor(entry)
        assert torch.equal(ckpt.tensor(entry, buffer), whole)
        n = entry.shape[0] if entry.shape else 1
        for start, stop in [(0, n), (0, max(1, n // 2)), (n // 3, n)]:
            got = ckpt.rows(entry, start, stop, buffer)
            assert got.dtype == whole.dtype
            assert torch.equal(got, whole[start:stop] if entry.shape else whole)
    ckpt.close()


def test_the_buffer_is_reused_and_grows_only_to_the_largest_read() -> None:
    buffer = ReadBuffer()
    first = buffer.take(1000)
    assert buffer.capacity >= 1000
    again = buffer.take(500)
    assert again.data_ptr() == first.data_ptr()  # the same memory, no new allocation
    capacity = buffer.capacity
    buffer.take(capacity)
    assert buffer.capacity == capacity


def test_a_file_truncated_under_the_reader_is_an_error(model: Path) -> None:
    ckpt = open_checkpoint(model)
    entry = ckpt.by_name()["a"]
    os.truncate(model, ckpt.data_start + entry.begin + 100)
    with pytest.raises(InputError, match="changed while reading"):
        ckpt.rows(entry, 0, 300, ReadBuffer())
    ckpt.close()
