"""This worker's place among its peers, and the torch.distributed collectives between them.

``ParallelState`` is set once per process by ``Worker.init_device`` (like torch.distributed's own
default group, it is process-wide): model layers read it while they are built to know which shard
they hold, and call its collectives in ``forward``. A single worker gets ``ParallelState.single()``
and never touches torch.distributed (the single-rank fast path).

Backend: NCCL on CUDA, gloo on CPU. Every group is created with a timeout, so a peer that dies or
hangs turns a collective into an error instead of a hang forever.

Expert parallelism (``--enable-expert-parallel``) adds ``ParallelState.ep``, an
``ExpertParallelGroup`` across the DP engines (its own rendezvous and process group beside the
engine's TP / PP world, ``EP_TIMEOUT_S`` = 30 s), which ``FusedMoE`` uses to send tokens to the
rank holding their experts and bring the results back.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from gridserve.shared import envs
from gridserve.shared.errors import ConfigError
from gridserve.shared.parallel import RankLayout, expert_parallel_rank

logger = logging.getLogger(__name__)

# Seconds an expert-parallel rendezvous or collective waits for a peer (an engine in another
# process, maybe dead) before the step fails.
EP_TIMEOUT_S = 30.0


@dataclass
class ParallelState:
    """Ranks and process groups of this worker (``None`` groups when the dimension is 1)."""

    layout: RankLayout
    tp_group: Optional[Any] = None
    pp_group: Optional[Any] = None
    ep: Optional[ExpertParallelGroup] = None  # expert parallelism across DP engines (None: off)
    world_cpu_group: Optional[Any] = None  # every worker of the engine, gloo (host-side agreement)

    @classmethod
    def single(cls) -> ParallelState:
        return cls(RankLayout(rank=0, tp_size=1, pp_size=1))

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank

    @property
    def pp_size(self) -> int:
        return self.layout.pp_size

    @property
    def pp_rank(self) -> int:
        return self.layout.pp_rank

    # ---- tensor parallel -------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the TP group, in place."""
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def gather_to_first(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Concatenate every TP rank's ``x`` along the last dim on TP rank 0; ``None`` elsewhere."""
        if self.tp_size == 1:
            return x
        x = x.contiguous()
        first = self.layout.tp_group_ranks()[0]
        if self.tp_rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.tp_size)]
            dist.gather(x, parts, dst=first, group=self.tp_group)
            return torch.cat(parts, dim=-1)
        dist.gather(x, None, dst=first, group=self.tp_group)
        return None

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """TP rank 0's ``x`` on every TP rank (in place)."""
        if self.tp_size > 1:
            dist.broadcast(x, src=self.layout.tp_group_ranks()[0], group=self.tp_group)
        return x

    # ---- the whole worker group ------------------------------------------------------------------
    def any_across_workers(self, flags: list[bool]) -> list[bool]:
        """Each flag OR-ed over every worker of the engine (all must call this with as many flags,
        in the same step): how ranks agree on a host-side decision, e.g. a request whose KV pull
        failed on one rank is left out of the step on all of them."""
        if self.world_cpu_group is None or not flags:
            return flags
        values = torch.tensor([int(f) for f in flags], dtype=torch.int32)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.world_cpu_group)
        return [bool(v) for v in values.tolist()]

    # ---- pipeline parallel -----------------------------------------------------------------------
    def send_to_next_stage(self, tensors: list[torch.Tensor]) -> None:
        """Send activations to the same TP rank of the next stage (blocking until handed over)."""
        dst = self.layout.rank + self.tp_size
        for t in tensors:
            dist.send(t.contiguous(), dst=dst, group=self.pp_group)

    def recv_from_prev_stage(self, shapes: list[tuple[int, ...]], dtype: torch.dtype,
                             device: torch.device) -> list[torch.Tensor]:
        src = self.layout.rank - self.tp_size
        out = []
        for shape in shapes:
            t = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(t, src=src, group=self.pp_group)
            out.append(t)
        return out


class ExpertParallelGroup:
    """This worker's expert-parallel peers: the workers of every DP engine with its TP rank.

    The DP-wide world has ``DP x TP`` ranks (``dp_rank * TP + tp_rank``); the collectives run in
    the ``DP`` ranks of one TP column (``size``, ``rank`` = the DP rank), each holding a different
    1 / DP of the experts and the same TP shard of each. ``group`` is a torch process group made
    directly on the rendezvous store (gloo on CPU, NCCL on CUDA), apart from the engine's own TP /
    PP world, with the collective timeout.
    """

    def __init__(self, group: Any, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size

    def max_of(self, values: list[int], device: torch.device) -> list[int]:
        """The element-wise maximum of ``values`` over the peers (token counts every rank pads to)."""
        t = torch.tensor(values, dtype=torch.int64, device=device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self.group.allreduce([t], opts).wait()
        return t.tolist()

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every peer's ``x`` (all the same shape) stacked along dim 0, in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the peers, in place."""
        self.group.allreduce([x]).wait()
        return x


def init_expert_parallel(layout: RankLayout, dp_rank: int, dp_size: int, init_address: str,
                         device: torch.device) -> ExpertParallelGroup:
    """Join the DP-wide expert-parallel rendezvous at ``init_address`` (served by the first worker
    of DP rank 0) and make this worker's group: the ``dp_size`` workers with its TP rank."""
    if not init_address:
        raise ConfigError("parallel.expert_parallel_init_address",
                          "expert parallelism needs the DP-wide rendezvous address (host:port)")
    timeout = timedelta(seconds=EP_TIMEOUT_S)
    world = RankLayout(expert_parallel_rank(dp_rank, layout.tp_size, layout.tp_rank),
                       layout.tp_size * dp_size, 1)
    logger.info("expert parallel: dp %d/%d, tp %d: rendezvous at %s", dp_rank, dp_size, layout.tp_rank,
                init_address)
    store = dist.PrefixStore(f"ep-tp{layout.tp_rank}", _rendezvous_store(init_address, world, timeout))
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(store, dp_rank, dp_size, opts)
    else:
        group = dist.ProcessGroupGloo(store, dp_rank, dp_size, timeout)
    return ExpertParallelGroup(group, dp_rank, dp_size)


_state = ParallelState.single()


def get_parallel_state() -> ParallelState:
    return _state


def set_parallel_state(state: ParallelState) -> None:
    """Used by ``Worker.init_device`` (and by tests that build one rank's shard without peers)."""
    global _state
    _state = state


def _rendezvous_store(init_address: str, layout: RankLayout, timeout: timedelta) -> dist.TCPStore:
    """The rendezvous key-value store (unauthenticated, like gloo itself). torch's TCPStore listens
    on every address whatever host it is given; on loopback rank 0 hands it a socket bound to that
    address instead, so the store is not reachable from the network."""
    host, _, port = init_address.rpartition(":")
    host = host.strip("[]")
    if layout.rank != 0 or not _is_loopback(host):
        return dist.TCPStore(host, int(port), layout.world_size, is_master=layout.rank == 0, timeout=timeout,
                             use_libuv=False)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, int(port)))
    listener.listen(layout.world_size)
    return dist.TCPStore(host, int(port), layout.world_size, is_master=True, timeout=timeout,
                         master_listen_fd=listener.detach(), use_libuv=False)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def init_distributed(layout: RankLayout, init_address: str, device: torch.device) -> ParallelState:
    """Join the workers' rendezvous at ``init_address`` and create every TP and PP group.

    All ranks create all groups in the same order (a torch.distributed requirement).
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=envs.GRIDSERVE_DIST_TIMEOUT_S)
    logger.info("rank %d/%d (tp %d, pp %d): %s rendezvous at %s", layout.rank, layout.world_size,
                layout.tp_rank, layout.pp_rank, backend, init_address)
    dist.init_process_group(backend, store=_rendezvous_store(init_address, layout, timeout), rank=layout.rank,
                            world_size=layout.world_size, timeout=timeout)
    from gridserve.shared.parallel import pp_group_ranks, tp_group_ranks

    tp_group = pp_group = None
    for ranks in tp_group_ranks(layout.tp_size, layout.pp_size):
        group = dist.new_group(ranks, timeout=timeout, backend=backend)
        if layout.rank in ranks:
            tp_group = group
    for ranks in pp_group_ranks(layout.tp_size, layout.pp_size):
        group = dist.new_group(ranks, timeout=timeout, backend=backend)
        if layout.rank in ranks:
            pp_group = group
    # A gloo group of every rank, for host-side agreement (the default group is NCCL on CUDA).
    world_cpu_group = dist.new_group(list(range(layout.world_size)), timeout=timeout, backend="gloo")
    state = ParallelState(layout, tp_group if layout.tp_size > 1 else None,
                          pp_group if layout.pp_size > 1 else None, world_cpu_group=world_cpu_group)
    set_parallel_state(state)
    return state

