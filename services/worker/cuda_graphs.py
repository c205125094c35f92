"""CUDA-graph capture of decode-only steps (vLLM V1's full-graph decode, without piecewise capture).

A decode-only step (every request schedules exactly one token: no prefill, no drafts, no images,
no LoRA, no pooling) is launch-bound at small batches: one Python-issued kernel per layer call.
``CudaGraphRunner`` captures the model's forward once per batch size in ``cuda_graph_sizes``
(default ``[1, 2, 4, 8] + multiples of 8 up to min(512, max_num_seqs)``) and replays it:

* a batch of ``n`` rows is padded up to the next captured size; a padded row has token id 0,
  position 0, seq_len 1, a block table row of zeros and a slot mapping into block 0 (the null block,
  which the KV cache manager never hands to a request), so real rows' outputs are unchanged;
* the graph reads static input buffers (input ids, positions, per-KV-cache-group block tables and
  slot mappings, seq lens, query start locations) allocated once at the largest size; before a
  replay the step's values are ``copy_``'d into them in place (same storage, same ``data_ptr``);
* the output is the graph's static output sliced to the real rows.

Sampling runs after the graph, eagerly, on the sliced hidden states (its tensors are per step).

Only used on CUDA with neither ``enforce_eager`` nor ``batch_invariant`` (``uses_cuda_graphs``); on CPU
the model runner has no graph runner. The capture itself is behind ``graph_factory`` so the CPU
tests drive the same padding, bucketing and buffer bookkeeping with a fake graph that records the
captured function and re-runs it on replay.

Memory: graphs are captured lazily, on the first qualifying step of each size, after the worker's
profile run has sized the KV cache; the profile therefore does not see them. ``GRAPH_MEMORY_RESERVE``
(an estimate: the captured graphs share one memory pool whose size is about one forward pass's
activations at the largest size, far below the profile run's prefill peak) is subtracted from the
KV cache budget on CUDA (``Worker._profile_gpu_memory``). ``release()`` drops every graph and the pool
(sleep, recovery); the next qualifying step re-captures.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from gridserve.kernels.attention_backend import AttentionMetadata

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512
GRAPH_MEMORY_RESERVE = 512 * 2**20  # bytes kept out of the KV cache on CUDA for the graphs' pool


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM-like: 1, 2, 4, 8, then every multiple of 8 up to min(512, max_num_seqs)."""
    top = min(MAX_CAPTURE_SIZE, max_num_seqs)
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 8))
    return sizes


def capture_sizes(configured: Optional[list[int]], max_num_seqs: int) -> list[int]:
    """The sizes to capture: ``--cuda-graph-sizes`` (sorted, deduplicated, capped at max_num_seqs)
    or the default list."""
    if not configured:
        return default_capture_sizes(max_num_seqs)
    sizes = sorted({int(s) for s in configured if 0 < int(s) <= max_num_seqs})
    return sizes or default_capture_sizes(max_num_seqs)


def uses_cuda_graphs(device: torch.device, enforce_eager: bool, batch_invariant: bool) -> bool:
    return device.type == "cuda" and not enforce_eager and not batch_invariant


class _TorchCudaGraph:
    """The real capture: a warm-up run on a side stream, then ``torch.cuda.graph`` into a shared pool."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.graph = torch.cuda.CUDAGraph()
        self.output: Optional[torch.Tensor] = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up: lazy inits, autotuning and allocator growth happen outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.output = fn()
        return self.output

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


def _cuda_graph_factory(pool: Any) -> _TorchCudaGraph:
    return _TorchCudaGraph(pool)


@dataclass
class _Buffers:
    input_ids: torch.Tensor  # [max_size] int64
    positions: torch.Tensor  # [max_size] int64
    seq_lens: torch.Tensor  # [max_size] int32
    query_start_loc: torch.Tensor  # [max_size + 1] int32
    block_tables: list[torch.Tensor]  # per KV cache group: [max_size, max_blocks] int32
    slot_mappings: list[torch.Tensor]  # per KV cache group: [max_size] int64


class CudaGraphRunner:
    """Decode-step graphs by padded batch size; see the module docstring."""

    def __init__(self, model: Callable, sizes: list[int], num_groups: int, max_blocks_per_seq: int,
                 device: torch.device, graph_factory: Optional[Callable[[Any], Any]] = None,
                 pool_factory: Optional[Callable[[], Any]] = None) -> None:
        self.model = model
        self.sizes = sorted(sizes)
        self.max_size = self.sizes[-1]
        self.num_groups = num_groups
        self.max_blocks = max_blocks_per_seq
        self.device = device
        self.graph_factory = graph_factory or _cuda_graph_factory
        self.pool_factory = pool_factory or (torch.cuda.graph_pool_handle if device.type == "cuda" else (lambda: None))
        self.graphs: dict[int, Any] = {}
        self.pool: Any = None
        # A forward that cannot be captured (e.g. a host sync such as the MoE layer's expert counts)
        # turns graphs off for this runner: every later step runs eagerly.
        self.disabled = False
        n = self.max_size
        self.buffers = _Buffers(
            input_ids=torch.zeros(n, dtype=torch.int64, device=device),
            positions=torch.zeros(n, dtype=torch.int64, device=device),
            seq_lens=torch.ones(n, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
            block_tables=[torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
                          for _ in range(num_groups)],
            slot_mappings=[torch.zeros(n, dtype=torch.int64, device=device) for _ in range(num_groups)],
        )

    # ---- bucketing -----------------------------------------------------------------------
    def padded_size(self, num_rows: int) -> Optional[int]:
        """The smallest captured size >= ``num_rows``; ``None`` beyond the largest (run eagerly)."""
        for size in self.sizes:
            if size >= num_rows:
                return size
        return None

    def can_run(self, num_rows: int, meta: AttentionMetadata) -> bool:
        if self.disabled or self.padded_size(num_rows) is None:
            return False
        groups = (meta,) + tuple(meta.other_groups)
        return len(groups) == self.num_groups and all(g.block_table.shape[1] <= self.max_blocks for g in groups)

    # ---- buffers ----------------------------------------------------------------------------
    def _meta(self, size: int) -> AttentionMetadata:
        """Views of the static buffers for a batch of ``size`` rows (what the graph captures)."""
        b = self.buffers
        metas = [AttentionMetadata(query_start_loc=b.query_start_loc[:size + 1], seq_lens=b.seq_lens[:size],
                                   block_table=b.block_tables[g][:size], slot_mapping=b.slot_mappings[g][:size],
                                   max_query_len=1)
                 for g in range(self.num_groups)]
        metas[0].other_groups = tuple(metas[1:])
        return metas[0]

    def _load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, size: int) -> None:
        """Copy the step into the static buffers in place; rows ``n..size`` become padding."""
        b, n = self.buffers, input_ids.shape[0]
        b.input_ids[:n].copy_(input_ids)
        b.input_ids[n:size].zero_()
        b.positions[:n].copy_(positions)
        b.positions[n:size].zero_()
        b.seq_lens[:n].copy_(meta.seq_lens)
        b.seq_lens[n:size].fill_(1)
        # one token per row: query_start_loc is 0..size whatever the step; it never changes
        for g, group in enumerate((meta,) + tuple(meta.other_groups)):
            width = group.block_table.shape[1]
            b.block_tables[g][:n, :width].copy_(group.block_table)
            b.block_tables[g][:n, width:].zero_()
            b.block_tables[g][n:size].zero_()
            b.slot_mappings[g][:n].copy_(group.slot_mapping)
            b.slot_mappings[g][n:size].zero_()  # block 0, offset 0: the null block nobody reads

    # ---- run ---------------------------------------------------------------------------------
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's hidden states ([num_rows, hidden]) through the graph of its padded size."""
        n = input_ids.shape[0]
        size = self.padded_size(n)
        assert size is not None, "run() beyond the largest captured size; check can_run first"
        self._load(input_ids, positions, meta, size)
        graph = self.graphs.get(size)
        if graph is None:
            try:
                graph = self._capture(size)
            except Exception:  # noqa: BLE001 - any capture failure: eager from now on
                logger.warning("CUDA graph capture failed at batch size %d; decode steps run eagerly", size,
                               exc_info=True)
                self.disabled = True
                self.release()
                return self.model(input_ids, positions, meta)
        return graph.replay()[:n]

    def _capture(self, size: int) -> Any:
        if self.pool is None:
            self.pool = self.pool_factory()
        b = self.buffers
        ids, pos, meta = b.input_ids[:size], b.positions[:size], self._meta(size)
        graph = self.graph_factory(self.pool)
        graph.capture(lambda: self.model(ids, pos, meta))
        self.graphs[size] = graph
        return graph

    def release(self) -> None:
        """Drop every graph and the memory pool (sleep, recovery); the next step re-captures."""
        self.graphs.clear()
        self.pool = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
