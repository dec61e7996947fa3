"""Host values to the device without making the host wait for the GPU, and host copies that keep
the GIL."""
from __future__ import annotations

import ctypes

import numpy as np
import torch

# ctypes' PYFUNCTYPE calls keep the GIL (CFUNCTYPE ones let it go, as numpy does for any copy of
# more than a few hundred elements).
_memmove_keeping_gil = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes.cast(ctypes.memmove, ctypes.c_void_p).value)


def copy_keeping_gil(dst: np.ndarray, start: int, src: np.ndarray) -> None:
    """dst[start:start + len(src)] = src, for contiguous 1-D arrays of one dtype, without letting go
    of the GIL. A thread that lets go of it for each of many small copies waits each time to take it
    back, up to the interpreter's switch interval (5 ms) when another thread runs Python: the engine's
    512 copies of a window's PCM took 23-37 ms a window in `tts synth` beside its writer threads,
    3-15 ms alone (H200 host, 2026-12-04; docs/bench.md)."""
    if not (dst.dtype == src.dtype and dst.ndim == src.ndim == 1 and dst.flags.c_contiguous
            and src.flags.c_contiguous and 0 <= start and start + len(src) <= len(dst)):
        raise ValueError(f"cannot copy {src.dtype}{src.shape} into {dst.dtype}{dst.shape} at {start}")
    _memmove_keeping_gil(dst.ctypes.data + start * dst.itemsize, src.ctypes.data, src.nbytes)


def to_device(values: list | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`values` (a list, or a tensor of any device) on `device`. A copy to the GPU from pageable
    memory first waits for the stream's queued work: the engine's host would stall behind the step
    in flight (and building 4096 prompts took 3.4 s on the H200, 2026-12-03). From pinned memory
    the copy is queued like a kernel."""
    device = torch.device(device)
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values)
    if device.type != "cuda" or host.device.type != "cpu":   # (e.g. a speaker embedding made on the GPU)
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
