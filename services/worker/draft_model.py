"""Speculative decoding with a draft model: a small model of the target's vocabulary proposes the
next ``k`` tokens, which the target verifies in its next step (``spec_decode.accepted_run``).

**Where it lives.** The draft is loaded by the target's driver worker (TP rank 0: the rank that
samples, proposes and verifies), with the target's dtype, whole: with tensor parallelism it is
built unsharded (under a one-rank ``ParallelState``, so its layers run no collectives) and the
other TP ranks hold none of it; they receive its drafts with the engine's next step, like n-gram
drafts. Its attention layers are reported with the target's in
``get_kv_cache_spec`` under ``draft.``-prefixed names, so the engine plans one pool for both: with
a target of one kind the draft's layers join its single KV cache group (a tensor per layer, the
same block table); with a hybrid target they join the full-attention groups (their page must then
match the target's, as ``plan_kv_cache`` requires). A draft layer of another kind (a sliding window)
is refused. (Under TP the draft's page holds all its KV heads, the target's a rank's share: the
driver's pages are the larger, which sizes the pool for every rank; a hybrid target's groups need
equal pages, which a TP draft then rarely has.) The draft's K / V of position ``p`` therefore sits in the same block and offset as the
target's: a request's blocks, its prefix-cache hits and its rejected drafts' blocks are the same
for both, and nothing else needs allocating.

**Lookahead.** Proposing writes K / V past the request's tokens (the target's newest sample and
the first ``k - 1`` drafts): the engine reserves ``k`` slots past each step's tokens
(``SpeculativeConfig.num_lookahead_tokens``), and a request whose blocks end sooner gets fewer drafts.

**Each step.** After the target verified and sampled, for every request that takes drafts:

1. *catch up*: the draft runs over the tokens it has not seen yet, from the first position whose
   draft K / V it has not written (``computed``) through the target's newest sample, in one packed
   pass; the last row's greedy token is draft 1. The accepted tokens are thereby in the draft's
   cache; rejected drafts' slots are simply overwritten;
2. *propose*: ``k - 1`` one-token passes, each feeding the previous draft, give drafts 2..k.

A greedy, structured or seeded request's proposals are the draft's argmax (a point mass
``q = 1{d}``): the target accepts draft ``d`` iff its own sample at that position is ``d``, which
is Leviathan et al.'s rejection sampling for a point mass, so greedy outputs are exactly the
target's, and a seeded request's are exactly those of plain decoding (its counter-based draw at
each position is the same with and without drafts). An unseeded request that samples
(``DraftRequest.params``) gets proposals drawn from the draft's own distribution ``q`` (its
temperature, top-k / top-p / min-p applied to the draft's logits; one uniform per position),
which a good draft gets accepted more often: each kept with its ``q`` in ``proposals`` until the verify
step takes it (``take_distribution``) for ``spec_decode.rejection_sample``. A proposal the engine
did not schedule as proposed (another position, other tokens) is verified as point masses.

The draft's K / V are written lazily (only for requests that take drafts): a new request, a
resumed (preempted) one, or one that ran while speculation was off by batch size is caught up from
its first token the next time it proposes. A prefix-cache hit is therefore never trusted for the
draft; rewriting a shared block writes the values it already holds (the same tokens at the same
positions). Wrong draft K / V could only lower acceptance: every emitted token is the target's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from gridserve.services.worker import cpu_packed_linear
from gridserve.services.worker.attention import AttentionMetadata, PagedAttention
from gridserve.services.worker.loader import load_model
from gridserve.services.worker.parallel_state import (
    ParallelState,
    get_parallel_state,
    set_parallel_state,
)
from gridserve.services.worker.sampler import greedy_argmax, inverse_cdf_sample, sampling_probs
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import ConfigError
from gridserve.shared.kv_cache_spec import FULL, LayerKVCacheSpec
from gridserve.shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PREFIX = "draft."  # the draft's layer names in the KV cache spec and plan


@dataclass
class DraftRequest:
    """What the draft needs of one request: its tokens (the target's newest sample last), its block
    ids per KV cache group and, for a request whose drafts are sampled, its sampling parameters and
    one uniform per draft position (``None``: greedy drafts)."""

    req_id: str
    token_ids: Sequence[int]
    block_ids: Sequence[Sequence[int]]
    params: Optional[SamplingParams] = None
    uniforms: Sequence[float] = ()

    @property
    def samples(self) -> bool:
        return self.params is not None and not self.params.greedy


@dataclass
class Proposal:
    """Sampled drafts of one request, kept for its verify step: where they start (the request's
    length when proposed), the tokens and their distributions ``q`` ([k, V])."""

    position: int
    tokens: list[int]
    probs: torch.Tensor


@contextlib.contextmanager
def one_rank() -> Iterator[None]:
    """Build modules as a single worker would: unsharded, with no collectives in their forward."""
    outer = get_parallel_state()
    set_parallel_state(ParallelState.single())
    try:
        yield
    finally:
        set_parallel_state(outer)


class DraftModelProposer:
    """The draft model of ``speculative_config.model`` and the positions of each request whose
    K / V it has written."""

    def __init__(self, config: GridserveConfig, device: torch.device) -> None:
        spec = config.scheduler.speculative
        if spec is None or spec.model is None:
            raise ConfigError("speculative_config.model", "no draft model configured")
        self.k = spec.num_speculative_tokens
        draft = spec.draft_model_config(config.model)
        self.config = dataclasses.replace(config, model=draft)
        self.device = device
        self.block_size = config.cache.block_size
        self.max_model_len = config.max_model_len
        self.vocab_size = config.model.vocab_size
        self.model: torch.nn.Module | None = None
        self.computed: dict[str, int] = {}  # request -> positions whose draft K / V are written
        self.proposals: dict[str, Proposal] = {}  # sampled drafts awaiting their verify step

    def load(self) -> None:
        with one_rank():  # the whole draft on this rank, whatever the target's tensor parallelism
            self.model = load_model(self.config, self.device)
        cpu_packed_linear.pack_model(self.model, self.device)
        logger.info("draft model %s (%d layers) for speculative decoding, k=%d",
                    self.config.model.model, self.config.model.num_layers, self.k)

    def named_attention_layers(self) -> list[tuple[str, PagedAttention]]:
        """The draft's attention layers in model order, named ``draft.<module name>``."""
        names = {id(module): name for name, module in self.model.named_modules()}
        return [(PREFIX + names[id(layer)], layer) for layer in self.model.attention_layers()]

    def kv_cache_spec(self, block_size: int, dtype_bytes: int) -> list[LayerKVCacheSpec]:
        """The draft's layers for the engine's plan: full attention only (they share the target's
        block tables; a window layer would need its own group's freeing)."""
        specs = [layer.kv_cache_spec(name, block_size, dtype_bytes) for name, layer in self.named_attention_layers()]
        for spec in specs:
            if spec.kind != FULL:
                raise ConfigError("speculative_config.model", f"draft layer {spec.layer_name} keeps a {spec.kind} "
                                                              "KV cache; a draft model's layers must be full attention")
        return specs

    def forget(self, req_id: str) -> None:
        """The request finished, or arrives anew (resumed): its draft K / V start from nothing."""
        self.computed.pop(req_id, None)
        self.proposals.pop(req_id, None)

    def clear(self) -> None:
        self.computed.clear()
        self.proposals.clear()

    def take_distribution(self, req_id: str, position: int, drafts: Sequence[int]) -> Optional[torch.Tensor]:
        """``q`` of the drafts the engine scheduled (a prefix of the request's sampled proposal at
        ``position``), or ``None``: verify them as point masses (greedy drafts, or not the proposal)."""
        proposal = self.proposals.pop(req_id, None)
        if proposal is None or proposal.position != position or list(drafts) != proposal.tokens[:len(drafts)]:
            return None
        return proposal.probs[:len(drafts)]

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        """Up to ``k`` drafts per request (fewer where its blocks or ``max_model_len`` end): greedy,
        or drawn from ``q`` for a request that samples (kept in ``proposals`` with their ``q``)."""
        runs = []  # (request, first position to run, drafts it may have)
        for r in requests:
            length = len(r.token_ids)
            capacity = min(len(ids) for ids in r.block_ids) * self.block_size
            room = min(self.k, capacity - length + 1, self.max_model_len - length + 1)
            if room >= 1:
                runs.append((r, min(self.computed.get(r.req_id, 0), length - 1), room))
        if not runs:
            return {}
        logits = self._step([r.block_ids for r, _, _ in runs], [start for _, start, _ in runs],
                            [list(r.token_ids[start:]) for r, start, _ in runs])
        first, probs = self._choose(logits, [r for r, _, _ in runs], 0)
        drafts = {r.req_id: [token] for (r, _, _), token in zip(runs, first)}
        dists = {r.req_id: [q] for (r, _, _), q in zip(runs, probs) if q is not None}
        for r, _, _ in runs:
            self.computed[r.req_id] = len(r.token_ids)
        for j in range(1, max(room for _, _, room in runs)):
            active = [r for r, _, room in runs if room > j]
            logits = self._step([r.block_ids for r in active], [len(r.token_ids) + j - 1 for r in active],
                                [[drafts[r.req_id][-1]] for r in active])
            nexts, probs = self._choose(logits, active, j)
            for r, token, q in zip(active, nexts, probs):
                drafts[r.req_id].append(token)
                if q is not None:
                    dists[r.req_id].append(q)
        for r, _, _ in runs:
            if r.req_id in dists:
                self.proposals[r.req_id] = Proposal(len(r.token_ids), drafts[r.req_id], torch.stack(dists[r.req_id]))
            else:
                self.proposals.pop(r.req_id, None)
        return drafts

    def _choose(self, logits: torch.Tensor, requests: Sequence[DraftRequest],
                j: int) -> tuple[list[int], list[Optional[torch.Tensor]]]:
        """Each row's draft ``j``: the argmax, or a draw from the request's ``q`` (returned with it)."""
        tokens = greedy_argmax(logits)
        probs: list[Optional[torch.Tensor]] = [None] * len(requests)
        rows = [i for i, r in enumerate(requests) if r.samples]
        if rows:
            params = [requests[i].params for i in rows]
            vocab = logits.shape[-1]
            top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
            device = logits.device
            q = sampling_probs(logits[rows], torch.tensor([p.temperature for p in params], device=device),
                               torch.tensor(top_k, device=device),
                               torch.tensor([p.top_p for p in params], device=device),
                               torch.tensor([p.min_p for p in params], device=device),
                               any(p.top_p < 1.0 for p in params) or any(k < vocab for k in top_k),
                               any(p.min_p > 0 for p in params))
            uniforms = torch.tensor([requests[i].uniforms[j] for i in rows], dtype=torch.float64, device=device)
            tokens[rows] = inverse_cdf_sample(q, uniforms)
            for n, i in enumerate(rows):
                probs[i] = q[n]
        return tokens.tolist(), probs

    def _step(self, tables: list[Sequence[Sequence[int]]], starts: list[int],
              tokens: list[list[int]]) -> torch.Tensor:
        """One packed forward of the draft (``tokens[i]`` at positions ``starts[i]..``, their K / V
        written); each sequence's next-token logits (float32, the vocabulary's columns)."""
        q_lens = [len(t) for t in tokens]
        meta, positions = attention_metadata(tables, starts, q_lens, self.block_size, self.device)
        input_ids = torch.tensor([t for seq in tokens for t in seq], dtype=torch.int64, device=self.device)
        hidden = self.model(input_ids, positions, meta)
        last_rows = torch.tensor(q_lens, dtype=torch.int64).cumsum(0) - 1
        logits = self.model.compute_logits(hidden.index_select(0, last_rows.to(self.device)))
        return logits[:, :self.vocab_size].float()


def attention_metadata(tables: list[Sequence[Sequence[int]]], starts: list[int], q_lens: list[int],
                       block_size: int, device: torch.device) -> tuple[AttentionMetadata, torch.Tensor]:
    """The metadata of a packed batch (sequence ``i``: ``q_lens[i]`` tokens from position
    ``starts[i]``, block ids ``tables[i][g]`` per KV cache group) and its positions."""
    q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
    starts_t = torch.tensor(starts, dtype=torch.int64)
    query_start_loc = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    torch.cumsum(q_lens_t, 0, out=query_start_loc[1:])
    row_of_token = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens_t)
    positions = torch.arange(int(query_start_loc[-1])) + torch.repeat_interleave(starts_t - query_start_loc[:-1],
                                                                                  q_lens_t)
    block_index, offset = positions // block_size, positions % block_size
    metas = []
    for g in range(len(tables[0])):
        group = [list(t[g]) for t in tables]
        width = max(len(ids) for ids in group)
        table = torch.tensor([ids + [0] * (width - len(ids)) for ids in group], dtype=torch.int32)
        metas.append(AttentionMetadata(
            query_start_loc=query_start_loc.to(torch.int32).to(device),
            seq_lens=(starts_t + q_lens_t).to(torch.int32).to(device),
            block_table=table.to(device),
            slot_mapping=(table[row_of_token, block_index].long() * block_size + offset).to(device),
            max_query_len=max(q_lens),
        ))
    meta = metas[0]
    meta.other_groups = tuple(metas[1:])
    return meta, positions.to(device)
