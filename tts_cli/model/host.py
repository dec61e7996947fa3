"""Host values to the device without making the host wait for the GPU."""
from __future__ import annotations

import torch


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
