"""Capturing one CUDA graph, the way both runners do it (talker step, decoder call)."""
from __future__ import annotations

from typing import Any, Callable

import torch


def capture(run: Callable[[], Any], device: torch.device, pool: Any = None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """A graph of `run` and what its capture returned (replay refreshes it in place). `run` runs once on a side
    stream first, so lazy initialisation (cuBLAS workspaces, cuDNN plans) happens outside the capture. `pool`: an
    earlier graph's `pool()`, shared (capture the largest shape first so the smaller ones reuse its memory)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out
