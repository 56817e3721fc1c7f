"""The torch kernels' error path (numerics/kernels.py): the error of a slab's codes as
restored, fed to the measure (numerics/metrics.py) in the tensor's flat order."""

from __future__ import annotations

import torch

from qtool.numerics.metrics import Measure
from qtool.numerics.workspace import Workspace
from qtool.spec import QSpec


class Sink:
    """The errors of the parts of whole rows, gathered in row order before they are measured."""

    def __init__(self, meas: Measure | None, x_rows: torch.Tensor, ws: Workspace) -> None:
        self.meas, self.x_rows = meas, x_rows
        shape = tuple(x_rows.shape)
        self.error = ws.rows(0, shape)
        self.minmax = ws.rows(1, shape) if meas is not None and meas.searching else None

    def put(self, work: torch.Tensor, where: tuple[int, int], minmax: bool) -> None:
        start, width = where
        target = self.minmax if minmax else self.error
        assert target is not None
        target[:, start : start + width].copy_(work.reshape(target.shape[0], width))

    def flush(self) -> None:
        if self.meas is None:
            return
        if self.minmax is not None:
            self.meas.add_minmax(self.minmax)
        self.meas.add(self.x_rows, self.error)


def feed(
    meas: Measure, sink: Sink | None, xf: torch.Tensor, work: torch.Tensor,
    where: tuple[int, int], *, minmax: bool,
) -> None:  # fmt: skip
    """Measure a slab's errors now (it is a flat run of the tensor) or gather them (`sink`)."""
    if sink is not None:
        sink.put(work, where, minmax)
    elif minmax:
        meas.add_minmax(work)
    else:
        meas.add(xf, work)


def error_of(
    xf: torch.Tensor,
    work: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    spec: QSpec,
    ws: Workspace,
) -> None:
    """work = x - x_hat as restored for the codes qparams (scale, zero_point) give (not stored)."""
    torch.div(xf, scale, out=work)
    work.round_().add_(zero_point).clamp_(spec.qmin, spec.qmax).sub_(zero_point)
    restored_error(xf, work, scale, ws)


def restored_error(
    xf: torch.Tensor, work: torch.Tensor, scale: torch.Tensor, ws: Workspace
) -> None:
    """work holds q - zero_point: make it x - x_hat, x_hat = (q - zp) * scale in float32 rounded
    to x's own dtype (what dequantize restores and a loader loads; metrics.py)."""
    work.mul_(scale)
    ws.restore_(work)
    torch.sub(xf, work, out=work)
