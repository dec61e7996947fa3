"""Programmatic dependent launch (PDL, Hopper and later) for the engine's small Triton kernels.

It pays at one row in flight, where a talker step is ~270 short kernels in a row (GEMVs, norms,
attention, SiLU), and the GPU idled between them while each launched and ramped up (0.22 ms per
step on the H200, docs/bench.md at 0bca9b7, 2026-11-30); at 2-64 rows the projections are Triton's
too (tts_kernels.linear.gemm_rows), elsewhere cuBLAS sits between the kernels and PDL changes
nothing (H200, c64: 628.1 audio-s/s with it at `85bb595`, 628.4 without at `c2a92bc`, alternated,
2026-12-01).
Launched with PDL, a kernel's CTAs may start while the kernel before it still runs: each kernel
first lets the next one launch (`let_dependents_launch`), reads what does not depend on its
predecessor (weights), then waits for the predecessor to finish and its writes to be visible
(`wait_for_predecessor`) before reading activations or writing anything.
Waiting for the predecessor's completion covers every earlier kernel too (each of those waited).
A kernel launched after a non-PDL one (cuBLAS, torch) just starts when it ends, as without PDL.

Off in Triton's interpreter and before sm_90, where the launch option does not exist, and where
`enabled` is False (tests compare the two).
"""
import functools
import logging

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tts_kernels import compiled

log = logging.getLogger(__name__)
enabled = True


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def programmatic(x: torch.Tensor) -> dict:
    """Launch options for a kernel with a `PDL` constexpr, working on x's device: PDL on where it
    can run."""
    on = enabled and x.is_cuda and compiled()
    if on:
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        on = pdl_possible(index)
    return {"PDL": on, "launch_pdl": on}


@functools.lru_cache(maxsize=None)
def pdl_possible(index: int) -> bool:
    """Whether GPU `index` takes programmatic dependent launch (sm_90 and later); says so once if not."""
    capability = _capability(index)
    if capability < (9, 0):
        log.info("kernels: launched without PDL (programmatic dependent launch needs sm_90; GPU %d is sm_%d%d)",
                 index, *capability)
    return capability >= (9, 0)


@triton.jit
def let_dependents_launch(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_for_predecessor(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
