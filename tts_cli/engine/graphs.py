"""CUDA graph capture shared by the decode step and the prefill."""
from __future__ import annotations

import gc
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def capture(fn: Callable[[], T], pool=None, stream: torch.cuda.Stream | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """fn() captured as a CUDA graph (warm it up first) on `stream` (default: torch's capture
    stream): (graph, what fn returned, its tensors living in the graph's pool). Python's garbage
    collector is held off meanwhile: a collection could free an older engine's graph, and destroying
    a graph while a stream captures invalidates the capture (seen on the H200 as cuBLAS failing
    inside it). An older engine's garbage is collected once, when the next is built (Engine), not
    before each capture: with the model loaded a full collection takes ~0.1 s, and an engine
    captures several graphs (py-spy: 0.64 s of a 4096-row `tts synth` on the H200, 2026-12-03)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            out = fn()
    finally:
        if was_enabled:
            gc.enable()
    return graph, out
