"""The slot decoder's decode step replayed from CUDA graphs, one captured per attention span (:class:`GraphedStep`)."""

from __future__ import annotations

import torch


class GraphedStep:
    """A decode step ``step(tokens, write, pos, length, span)`` replayed from CUDA graphs, one per ``span``.

    The four ``(slots,)`` inputs are copied into fixed buffers that the graphs read; the returned logits are
    the graph's own output tensor, overwritten by the next replay (callers index it, which copies). All
    graphs share one memory pool: they never run at the same time.

    :meth:`clear` drops the graphs *and* their pool. Capturing into a pool whose graphs were all freed trips
    the CUDA caching allocator (``use_count > 0 INTERNAL ASSERT FAILED``: the freed pool's count is 0
    but its id is still known), which is how an adapter arm after the base arm crashed.

    A graph reads each weight at the address it was captured with: a parameter *replaced* (a new tensor,
    ``.data`` swapped, FSDP-style resharding) rather than updated in place would leave it reading the old one.
    :meth:`check_weights` compares the ``watched`` modules' parameter storage, and what ``reads()`` says the step
    reads (the slot decoder's projections: a merged buffer, a weight or a module), with those recorded at the
    first capture and drops the graphs when either changed (the next step captures them again)."""

    def __init__(self, step, slots: int, device, watched=(), reads=lambda: ()):
        self.step = step
        self.inputs = [torch.zeros(slots, dtype=torch.long, device=device) for _ in range(4)]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.watched = tuple(watched)
        self.reads = reads
        self.storage = None  # parameter_storage(watched) when the first graph of the pool was captured
        self.read = None  # reads() then

    def __call__(self, tokens, write, pos, length, span: int) -> torch.Tensor:
        for buffer, value in zip(self.inputs, (tokens, write, pos, length)):
            buffer.copy_(value, non_blocking=True)
        if span not in self.graphs:
            if not self.graphs:  # later graphs are checked against the first one's weights
                self.storage, self.read = parameter_storage(self.watched), self.reads()
            self.graphs[span] = self._capture(span)
        graph, logits = self.graphs[span]
        graph.replay()
        return logits

    def _capture(self, span: int):
        # One eager run first, on a side stream as capture requires: kernels and cuBLAS workspaces get
        # set up outside the capture. It writes this step's keys and values, which the replay writes again.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step(*self.inputs, span)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):  # image threads run meanwhile
            logits = self.step(*self.inputs, span)
        self.pool = graph.pool()
        return graph, logits

    def clear(self) -> None:
        """Forget every graph and the pool they shared; the next call captures into a fresh pool."""
        self.graphs.clear()
        self.pool = None
        self.storage = self.read = None

    def check_weights(self) -> bool:
        """Drop every graph if a watched parameter has moved, or the step reads other weights, since they were
        captured; True when dropped."""
        if self.graphs and (parameter_storage(self.watched) != self.storage or self.reads() != self.read):
            self.clear()
            return True
        return False


def parameter_storage(modules) -> tuple:
    """``(name, data_ptr, shape)`` of every parameter of ``modules``: what a captured CUDA graph relies on."""
    return tuple((name, p.data_ptr(), tuple(p.shape)) for m in modules for name, p in m.named_parameters())
