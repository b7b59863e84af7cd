"""Helpers of the paged-attention kernel tests (GQA and MLA, interpreter and GPU): page tables, graph capture."""

from __future__ import annotations

from collections.abc import Callable

import torch


def shuffled_page_table(
    lengths: list[int], page_size: int, gen: torch.Generator, spare_pages: int
) -> tuple[torch.Tensor, int]:
    """A CPU int32 page table giving each row its own shuffled pages (unused entries 0), and the page count.

    The pool has `spare_pages` pages beyond those the rows need; the caller draws the caches after this.
    """
    need = [-(-n // page_size) for n in lengths]
    num_pages = sum(need) + spare_pages
    order = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(len(lengths), max(max(need), 1), dtype=torch.int32)
    used = 0
    for row, n in enumerate(need):
        table[row, :n] = order[used : used + n]
        used += n
    return table, num_pages


def capture_cuda_graph(step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Run `step` once on a side stream (compiling outside the capture), then capture it; (graph, its output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
