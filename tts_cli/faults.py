"""Test hook: make a module raise CUDA out-of-memory, to exercise the recovery path on any machine.

torch.cuda.OutOfMemoryError can be raised without CUDA, so the real model on CPU can be made to
fail mid-generation exactly as a GPU would when a batch is too big.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def out_of_memory_in(module: torch.nn.Module, *, min_rows: int, after_calls: int = 0, times: int | None = None):
    """While active, a forward call of `module` on at least `min_rows` rows (dimension 0 of its first
    input) raises torch.cuda.OutOfMemoryError, once `after_calls` such calls have passed (so it can
    hit a decoding step rather than the prefill), at most `times` times (None: always).
    Yields a dict whose "raised" counts the errors raised."""
    state = {"calls": 0, "raised": 0}

    def hook(_module, args):
        if args[0].shape[0] < min_rows:
            return
        state["calls"] += 1
        if state["calls"] > after_calls and (times is None or state["raised"] < times):
            state["raised"] += 1
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected on {args[0].shape[0]} rows)")

    handle = module.register_forward_pre_hook(hook)
    try:
        yield state
    finally:
        handle.remove()
