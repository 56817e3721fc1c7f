"""Memory the torch kernels reuse across slabs and tensors (numerics/kernels.py)."""

from __future__ import annotations

import math

import torch

from qtool.numerics.metrics import RESTORE_ROUNDED, restore_


class Workspace:
    """Memory reused across slabs and tensors: a fresh allocation costs page faults on first
    touch, which for a cache-sized slab cost as much as the arithmetic itself."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._codes = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._floats = torch.empty(0, dtype=torch.float32, device=self.device)
        self._rows = [torch.empty(0, dtype=torch.float32, device=self.device) for _ in range(2)]
        self._restored: dict[torch.dtype, torch.Tensor] = {}
        self.original = torch.float32  # the dtype of the slab `take` saw last

    def codes(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised 1-byte tensor of `shape`, valid until the next call."""
        self._codes = at_least(self._codes, math.prod(shape))
        return self._codes[: math.prod(shape)].view(dtype).view(shape)

    def take(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(xf, work): the slab `like` as float32 (itself when it already is; else upcast once
        into reused memory, exact for f16/bf16) and a float32 scratch of its shape."""
        n = like.numel()
        upcast = like.dtype != torch.float32
        self._floats = at_least(self._floats, n * (2 if upcast else 1))
        work = self._floats[:n].view(like.shape)
        self.original = like.dtype
        if not upcast:
            return like, work
        xf = self._floats[n : 2 * n].view(like.shape)
        xf.copy_(like)
        return xf, work

    def rows(self, which: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Float32 scratch `which` (0 or 1) of `shape`, apart from `take`'s memory."""
        self._rows[which] = at_least(self._rows[which], math.prod(shape))
        return self._rows[which][: math.prod(shape)].view(shape)

    def restore_(self, x_hat: torch.Tensor) -> None:
        """Round a float32 reconstruction in place to the dtype of the last slab `take` saw
        (bf16, fp16: the dtype the tensor is restored in; numerics/metrics.py)."""
        dtype = self.original
        if dtype not in RESTORE_ROUNDED:
            return
        buf = self._restored.get(dtype)
        if buf is None or buf.numel() < x_hat.numel():
            buf = self._restored[dtype] = torch.empty(
                x_hat.numel(), dtype=dtype, device=x_hat.device
            )
        restore_(x_hat, dtype, buf)


def at_least(buf: torch.Tensor, numel: int) -> torch.Tensor:
    return buf if buf.numel() >= numel else torch.empty(numel, dtype=buf.dtype, device=buf.device)
