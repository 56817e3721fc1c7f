from __future__ import annotations

import pytest
import torch

from qtool.numerics.granularity import (
    Granularity,
    PerChannel,
    PerGroup,
    PerTensor,
    from_json,
)

CASES: list[tuple[Granularity, tuple[int, ...], tuple[int, ...]]] = [
    (PerTensor(), (6, 8), ()),
    (PerTensor(), (7,), ()),
    (PerChannel(0), (6, 8), (6,)),
    (PerChannel(1), (3, 4, 5), (4,)),
    (PerChannel(-1), (3, 4, 5), (5,)),
    (PerGroup(4), (6, 8), (6, 2)),
    (PerGroup(3), (6, 8), (6, 3)),
    (PerGroup(5), (3, 4, 5), (3, 4)),
    (PerGroup(64), (6, 8), (6, 1)),
]


def _id(case: tuple[Granularity, tuple[int, ...], tuple[int, ...]]) -> str:
    return f"{case[0].describe().replace(' ', '')}-{'x'.join(map(str, case[1]))}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_qparam_shape(case: tuple[Granularity, tuple[int, ...], tuple[int, ...]]) -> None:
    granularity, shape, expected = case
    assert granularity.qparam_shape(shape) == expected


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_view_covers_every_element_once_in_its_group(
    case: tuple[Granularity, tuple[int, ...], tuple[int, ...]], device: str
) -> None:
    """Writing each group's grid index through the blocks labels every element exactly as
    DESIGN.md 3.1 groups it (checked against an index computation done here)."""
    granularity, shape, qshape = case
    label = torch.full(shape, -1, dtype=torch.int64, device=device)
    view = granularity.view(label)
    rows, n = view.grid
    for block in view.blocks:
        r, s = block.values.shape[:2]
        ids = (
            torch.arange(rows, device=device)[:, None] * n
            + block.col0
            + torch.arange(s, device=device)
        )
        block.values.copy_(ids[:, :, None, None].expand(block.values.shape))
    assert rows * n == max(1, torch.Size(qshape).numel())
    assert torch.equal(label.cpu(), _expected_labels(granularity, shape))


def _expected_labels(granularity: Granularity, shape: tuple[int, ...]) -> torch.Tensor:
    idx = torch.arange(torch.Size(shape).numel()).reshape(shape)
    if isinstance(granularity, PerTensor):
        return torch.zeros(shape, dtype=torch.int64)
    if isinstance(granularity, PerChannel):
        axis = granularity.axis % len(shape)
        channel = torch.arange(shape[axis]).reshape(
            [-1 if d == axis else 1 for d in range(len(shape))]
        )
        return channel.expand(shape).clone()
    cols = idx.reshape(shape[0], -1).shape[1]
    n = -(-cols // granularity.size)
    row = torch.arange(shape[0])[:, None]
    group = torch.arange(cols)[None, :] // granularity.size
    return (row * n + group).reshape(shape)


def test_views_are_views_not_copies() -> None:
    x = torch.zeros(4, 7)
    for granularity in (PerTensor(), PerChannel(1), PerGroup(3)):
        for block in granularity.view(x).blocks:
            assert block.values.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def test_shorter_last_group_is_its_own_block() -> None:
    view = PerGroup(3).view(torch.zeros(2, 7))
    assert [tuple(b.values.shape) for b in view.blocks] == [(2, 2, 1, 3), (2, 1, 1, 1)]
    assert [b.col0 for b in view.blocks] == [0, 2]
    assert view.grid == (2, 3)


@pytest.mark.parametrize(
    "granularity, label, data",
    [
        (PerTensor(), "tensor", {"kind": "tensor"}),
        (PerChannel(0), "axis 0", {"kind": "channel", "axis": 0}),
        (PerChannel(-1), "axis -1", {"kind": "channel", "axis": -1}),
        (PerGroup(128), "group 128", {"kind": "group", "size": 128}),
    ],
    ids=["tensor", "axis0", "axis-1", "group128"],
)
def test_describe_and_json_round_trip(
    granularity: Granularity, label: str, data: dict[str, object]
) -> None:
    assert granularity.describe() == label
    assert granularity.to_json() == data
    assert from_json(granularity.to_json()) == granularity


@pytest.mark.parametrize("size", [0, 1, -3], ids=["zero", "one", "negative"])
def test_group_size_below_two_is_refused(size: int) -> None:
    with pytest.raises(ValueError, match="at least 2"):
        PerGroup(size)


@pytest.mark.parametrize("bad", ["32", 3.0, True], ids=["string", "float", "bool"])
def test_non_integer_sizes_and_axes_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="integer"):
        PerGroup(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="integer"):
        PerChannel(bad)  # type: ignore[arg-type]


def test_axis_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="axis 2 is out of range for a 2-D tensor"):
        PerChannel(2).qparam_shape((3, 4))
    with pytest.raises(ValueError, match="out of range"):
        PerChannel(-3).view(torch.zeros(3, 4))


def test_group_of_a_scalar_and_non_contiguous_input_are_refused() -> None:
    with pytest.raises(ValueError, match="0-d"):
        PerGroup(2).view(torch.tensor(1.0))
    with pytest.raises(ValueError, match="contiguous"):
        PerGroup(2).view(torch.zeros(4, 6).t())


@pytest.mark.parametrize(
    "data",
    [{"kind": "block"}, {"kind": "group"}, {"kind": "channel"}, {"kind": "group", "size": 1}, []],
    ids=["unknown-kind", "group-no-size", "channel-no-axis", "group-size-1", "not-a-dict"],
)
def test_from_json_refuses_bad_data(data: object) -> None:
    with pytest.raises(ValueError):
        from_json(data)  # type: ignore[arg-type]


def test_group_larger_than_a_row_is_one_group_per_row() -> None:
    assert PerGroup(128).n_groups((6, 8)) == 1
    assert PerGroup(8).n_groups((6, 8)) == 1
    assert PerGroup(7).n_groups((6, 8)) == 2
