"""engine/imatrix_hooks.py and numerics/imatrix_sums.py: the statistics the pre-hooks gather on a
tiny model equal a plain hand computation (each Linear's inputs rebuilt step by step, squared
and summed in float64 numpy); rows count every call; batches merge; every device."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from qtool.engine.imatrix_hooks import ImatrixProbe
from qtool.numerics.imatrix import merge
from qtool.numerics.imatrix_sums import column_squares


class Tiny(nn.Module):
    """embed -> up -> relu -> down, and `down` applied twice (a shared Linear)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.up = nn.Linear(6, 10)
        self.down = nn.Linear(10, 6, bias=False)
        self.head = nn.Linear(6, 11)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.down(torch.relu(self.up(h)))
        h = h + self.down(torch.relu(self.up(h)) * 0.5)
        return self.head(h)  # type: ignore[no-any-return]


def by_hand(model: Tiny, tokens: torch.Tensor) -> dict[str, tuple[np.ndarray, int]]:
    """Each Linear's inputs rebuilt without hooks, squared and summed per column in float64."""
    seen: dict[str, list[np.ndarray]] = {"up": [], "down": [], "head": []}
    with torch.no_grad():
        h = model.embed(tokens)
        for scale in (1.0, 0.5):
            seen["up"].append(h.numpy())
            a = torch.relu(model.up(h)) * scale
            seen["down"].append(a.numpy())
            h = h + model.down(a)
        seen["head"].append(h.numpy())
    out = {}
    for name, xs in seen.items():
        rows = np.concatenate([x.reshape(-1, x.shape[-1]) for x in xs]).astype(np.float64)
        out[f"{name}.weight"] = ((rows**2).sum(axis=0), rows.shape[0])
    return out


@pytest.fixture
def model() -> Tiny:
    torch.manual_seed(0)
    return Tiny().eval()


def test_hooks_gather_what_the_hand_computation_gives(model: Tiny) -> None:
    tokens = torch.randint(0, 11, (3, 7))
    with ImatrixProbe(model) as probe, torch.no_grad():
        model(tokens)
    got = probe.stats()
    want = by_hand(model, tokens)
    assert list(got) == ["up.weight", "down.weight", "head.weight"]
    for name, (sums, rows) in want.items():
        np.testing.assert_array_equal(got[name].counts, [rows])
        np.testing.assert_allclose(got[name].sums[0], sums.astype(np.float32), rtol=1e-6)
    assert want["down.weight"][1] == 2 * 21  # called twice per pass: its rows count twice


def test_the_hooks_are_removed_on_exit(model: Tiny) -> None:
    tokens = torch.randint(0, 11, (1, 5))
    with ImatrixProbe(model) as probe, torch.no_grad():
        model(tokens)
    with torch.no_grad():
        model(tokens)  # outside: not counted
    assert int(probe.stats()["head.weight"].counts[0]) == 5


def test_batches_merge_to_one_run(model: Tiny) -> None:
    """Two probes over two batches, merged, equal one probe over both (counts exactly)."""
    a, b = torch.randint(0, 11, (2, 8)), torch.randint(0, 11, (3, 8))
    probes = []
    for batches in ([a], [b], [a, b]):
        with ImatrixProbe(model) as probe, torch.no_grad():
            for batch in batches:
                model(batch)
        probes.append(probe.imatrix(chunk_size=8, datasets=(f"{len(batches)}",)))
    joined, whole = merge(probes[0], probes[1]), probes[2]
    assert joined.chunk_count == whole.chunk_count == 2 * 40 // 8  # down: 2 calls x 40 rows
    for name, s in whole.entries.items():
        np.testing.assert_array_equal(joined.entries[name].counts, s.counts)
        np.testing.assert_allclose(joined.entries[name].sums, s.sums, rtol=1e-6)


def test_include_chooses_the_linears(model: Tiny) -> None:
    with ImatrixProbe(model, include=lambda name: name != "head") as probe, torch.no_grad():
        model(torch.randint(0, 11, (1, 4)))
    assert list(probe.stats()) == ["up.weight", "down.weight"]


def test_nothing_ran_is_refused(model: Tiny) -> None:
    with pytest.raises(ValueError, match="holds no statistics"):
        ImatrixProbe(model).imatrix(512)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_column_squares(device: str, dtype: torch.dtype) -> None:
    """Any float dtype, any leading shape, chunked or not: float64 sums of the values as given."""
    x = torch.randn(4, 5, 3, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = (x.double().reshape(-1, 3) ** 2).sum(0)
    for chunk in (1, 7, 4096):
        sums, rows = column_squares(x.to(device), chunk_rows=chunk)
        assert rows == 20 and sums.dtype == torch.float64
        torch.testing.assert_close(sums.cpu(), want, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="floating point"):
        column_squares(torch.ones(3, dtype=torch.int64))
