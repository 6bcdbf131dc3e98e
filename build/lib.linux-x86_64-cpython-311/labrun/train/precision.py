"""Mixed precision for the trainer: autocast for bf16 and fp16, a GradScaler for fp16 only."""

from __future__ import annotations

import contextlib
import warnings

import torch

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """`precision.name` on one device: what autocast() runs under and the loss scaler."""

    def __init__(self, name: str, device: torch.device, init_scale: float):
        self.device = device
        self.dtype = AUTOCAST_DTYPES[name]
        if self.dtype is torch.float16 and device.type == "cpu":
            if not _cpu_autocast_supports(torch.float16):
                warnings.warn("precision=fp16: CPU autocast does not support float16 here; "
                              "running bf16 instead", stacklevel=3)
                self.dtype = torch.bfloat16
        self.scaler = torch.amp.GradScaler(device.type, init_scale=init_scale,
                                           enabled=self.dtype is torch.float16)

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)


def _cpu_autocast_supports(dtype: torch.dtype) -> bool:
    try:
        with torch.autocast("cpu", dtype=dtype):
            torch.ones(2, 2) @ torch.ones(2, 2)
        return True
    except (RuntimeError, AssertionError):
        return False
