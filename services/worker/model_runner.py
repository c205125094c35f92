"""ModelRunner: keeps the worker's per-request state, builds each step's input tensors, runs the
model and the sampler.

The worker mirrors the engine's requests: a new request arrives whole (tokens, sampling params,
blocks); afterwards only new blocks and the computed-token count travel. Tokens the worker
samples are appended to its own copy, so the engine never sends them back. A request that fails on
its own (a token id out of range, its grammar) is reported in the output's ``failed`` and its samples
withheld (``RequestFailures``); the rest of the batch goes on.

With LoRA serving on (``lora.enable_lora``) a request may run on an adapter: it is read when the
request arrives (an adapter that cannot be served rejects that request on every rank) and each
step's adapters are put into the layers' slots before the forward (``services/worker/lora``).

Speculative decoding: a step verifies each request's drafts (``spec_decode.accepted_run``), then
proposes the next ones, by n-gram lookup or with a draft model (``draft_model.py``, its layers in
this runner's KV cache plan); the rejected drafts' blocks are dropped after the draft has run. Each
draft row is sampled as plain decoding samples its position: its draw, ``min_tokens``, bad words
and penalties count the drafts before it as output (``_sampling_metadata``). A
draft model lives on the driver only (whole, also under TP): it samples a sampling request's drafts
from its distribution ``q``, which the driver's sampler verifies by rejection sampling
(``_draft_distributions``) and whose verified rows the other TP ranks receive by broadcast.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from gridserve.kernels.dispatch import one_thread
from gridserve.services.worker import batch_invariant, cpu_packed_linear
from gridserve.services.worker.attention import AttentionMetadata, PagedAttention
from gridserve.services.worker.cuda_graphs import CudaGraphRunner, capture_sizes, uses_cuda_graphs
from gridserve.services.worker.draft_model import DraftModelProposer, DraftRequest
from gridserve.services.worker.encoder_cache import EncoderCache, ImageRows
from gridserve.services.worker.fused_moe import expert_parallel_dummy_step
from gridserve.services.worker.loader import KV_CACHE_TORCH_DTYPES, TORCH_DTYPES, load_model
from gridserve.services.worker.lora import LoRAManager
from gridserve.services.worker.parallel_state import get_parallel_state
from gridserve.services.worker.pooler import run_pooling
from gridserve.services.worker.request_failures import RequestFailures, check_new_request
from gridserve.services.worker.sampler import (
    Penalties,
    Sampler,
    SamplingMetadata,
    counter_uniform,
    gather_logprobs,
    trim_logprobs,
)
from gridserve.services.worker.spec_decode import DraftDistributions, accepted_run, ngram_propose
from gridserve.services.worker.structured_output import StructuredOutputManager
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import ConfigError, InvalidArgumentError
from gridserve.shared.kv_cache_spec import KVCacheConfig, LayerKVCacheSpec, num_skipped_blocks
from gridserve.shared.lora import LoRARequest
from gridserve.shared.multimodal import ImageFeature
from gridserve.shared.pooling import PoolingParams
from gridserve.shared.sampling_params import SamplingParams
from gridserve.shared.scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class RequestState:
    """The worker's copy of one request."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[list[int]]  # per KV cache group
    num_computed_tokens: int
    stop_ids: list[int] = field(default_factory=list)
    images: list[ImageFeature] = field(default_factory=list)
    lora_request: Optional[LoRARequest] = None  # the adapter it runs on; None: the base model
    pooling_params: Optional[PoolingParams] = None  # a pooling request: pooled, not sampled
    token_type_ids: Optional[list[int]] = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states to sample from
    sampling_req_ids: list[str]  # the request of each sampled row (1 + its drafts' rows with drafts)
    req_ids: list[str]  # every scheduled request, in packed order
    starts: list[int]  # first position computed this step, per request
    row_starts: list[int]  # first packed row, per request
    images: Optional[ImageRows] = None  # image-token rows and their embeddings (VLM prefill)
    # Speculative decoding: each sampled row's position in its request's run (0 without drafts)...
    row_offsets: list[int] = field(default_factory=list)
    # ... and the drafts verified this step, by request.
    drafts: dict[str, list[int]] = field(default_factory=dict)


class ModelRunner:
    """Runs one forward pass + sampling per ``SchedulerOutput``."""

    def __init__(self, config: GridserveConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.block_size = config.cache.block_size
        self.dtype = TORCH_DTYPES[config.model.resolved_dtype]
        self.kv_cache_dtype = KV_CACHE_TORCH_DTYPES[config.kv_cache_dtype]
        self.eos_token_id = config.model.eos_token_id
        self.requests: dict[str, RequestState] = {}
        self.sampler = Sampler()
        self.model: Optional[torch.nn.Module] = None
        self.kv_caches: list[torch.Tensor] = []
        self.kv_cache_groups: list[tuple[int, ...]] = []  # per tensor: the KV cache groups using it
        self.kv_cache_config: Optional[KVCacheConfig] = None
        self.windows: tuple[int, ...] = (0,)  # each KV cache group's window (0: none)
        self.structured_output: Optional[StructuredOutputManager] = None  # built on first use
        self.encoder_cache: Optional[EncoderCache] = None  # a vision-language model's image embeddings
        self.lora: Optional[LoRAManager] = None  # the adapters, with lora.enable_lora
        self.failures = RequestFailures()
        self.parallel = get_parallel_state()
        # The rank that samples and answers the engine: TP rank 0 of the last pipeline stage.
        self.is_driver = self.parallel.layout.is_output_rank
        # With one stage every rank keeps its own samples (TP ranks get the driver's by broadcast);
        # with several, the last stage samples and the engine sends the tokens to every stage.
        self.keeps_own_samples = self.parallel.pp_size == 1
        self.spec = config.scheduler.speculative  # speculative decoding (n-gram or a draft model), or None
        self.drafter: Optional[DraftModelProposer] = None  # the draft model, loaded with the target
        # A pooling model: each step runs its requests' whole inputs without a KV cache and answers
        # their pooled vectors or scores (``pooler.run_pooling``), no tokens.
        self.pooling = config.model.runner == "pooling"
        # Decode-step CUDA graphs (``cuda_graphs.py``): CUDA only, built with the KV cache.
        self.cuda_graphs: Optional[CudaGraphRunner] = None

    # ---- setup -------------------------------------------------------------------------
    def load_model(self) -> None:
        self.model = load_model(self.config, self.device)
        if self.config.device.batch_invariant:
            batch_invariant.check_available(self.device)
            batch_invariant.enable(self.model)
        cpu_packed_linear.pack_model(self.model, self.device)
        if hasattr(self.model, "encode_images"):
            self.encoder_cache = EncoderCache(self.model, self.device)
        if self.config.lora.enable_lora:
            self.lora = LoRAManager(self.model, self.config.lora, self.device, self.dtype)
        if self.spec is not None and self.spec.model is not None and self.is_driver:
            # the driver alone proposes (and verifies); the other TP ranks get its drafts with the step
            self.drafter = DraftModelProposer(self.config, self.device)
            self.drafter.load()

    # ---- LoRA adapters (the engine's add_lora / remove_lora / list_loras) -------------------
    def add_lora(self, lora_request: LoRARequest) -> None:
        self._lora_manager().add(lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        self._lora_manager().remove(lora_int_id)

    def list_loras(self) -> list[int]:
        return self._lora_manager().list()

    def _lora_manager(self) -> LoRAManager:
        if self.lora is None:
            raise InvalidArgumentError("lora_request", "this worker serves no LoRA adapters (enable_lora is off)")
        return self.lora

    def _named_attention_layers(self) -> list[tuple[str, PagedAttention]]:
        """This rank's attention layers in model order, with their module names (global layer
        numbers, so the same on every rank that holds the layer); a draft model's after them."""
        names = {id(module): name for name, module in self.model.named_modules()}
        layers = [(names[id(layer)], layer) for layer in self.model.attention_layers()]
        return layers + (self.drafter.named_attention_layers() if self.drafter is not None else [])

    def get_kv_cache_spec(self) -> list[LayerKVCacheSpec]:
        """What each of this rank's layers keeps in the KV cache (the engine plans from it)."""
        dtype_bytes = torch.empty(0, dtype=self.kv_cache_dtype).element_size()
        if self.drafter is not None:  # checked: only full-attention draft layers
            self.drafter.kv_cache_spec(self.block_size, dtype_bytes)
        return [layer.kv_cache_spec(name, self.block_size, dtype_bytes) for name, layer in self._named_attention_layers()]

    def initialize_cache(self, plan: KVCacheConfig) -> None:
        """Allocate the planned KV cache and bind each layer to its tensor and group. One group: a
        tensor per layer. Several: one tensor per slot, shared by layer ``i`` of every group (a block
        id belongs to one group at a time, so they never write the same block)."""
        if self.pooling:  # nothing is kept between steps: attention reads each step's own K / V
            self.kv_cache_config, self.windows = plan, (0,)
            return
        single = len(plan.groups) == 1
        slots: dict[int, torch.Tensor] = {}
        self.kv_caches = []
        for name, layer in self._named_attention_layers():
            if single:
                group, tensor = 0, None
            elif name in plan.slots:
                group, slot = plan.slots[name]
                tensor = slots.get(slot)
            else:
                raise ConfigError("model", f"the engine's KV cache plan has no group for layer {name}")
            if tensor is None:
                tensor = torch.zeros(layer.kv_cache_shape(plan.num_blocks, self.block_size),
                                     dtype=self.kv_cache_dtype, device=self.device)
                self.kv_caches.append(tensor)
                if not single:
                    slots[slot] = tensor
            layer.kv_cache = tensor
            layer.kv_cache_group = group
        self.kv_cache_groups = self._groups_of_tensors()
        self.kv_cache_config = plan
        self.windows = plan.windows
        # (re)built with the cache: graphs capture its tensors (wake-up, recovery re-capture lazily)
        self.cuda_graphs = self._make_cuda_graphs(self.cuda_graphs.graph_factory if self.cuda_graphs else None)

    def _groups_of_tensors(self) -> list[tuple[int, ...]]:
        """Parallel to ``kv_caches``: the groups whose layers use each tensor (P/D moves each
        tensor's blocks of each of them)."""
        index = {id(tensor): i for i, tensor in enumerate(self.kv_caches)}
        groups: list[set[int]] = [set() for _ in self.kv_caches]
        for _, layer in self._named_attention_layers():
            groups[index[id(layer.kv_cache)]].add(layer.kv_cache_group)
        return [tuple(sorted(g)) for g in groups]

    def _make_cuda_graphs(self, graph_factory=None) -> Optional[CudaGraphRunner]:
        """The decode-step graph runner on CUDA (not ``enforce_eager`` / ``batch_invariant``, one
        rank, no LoRA, no pooling); ``None`` otherwise. Graphs are captured lazily, per size."""
        dev = self.config.device
        if dev.enforce_eager or dev.batch_invariant:
            return None
        if not uses_cuda_graphs(self.device, dev.enforce_eager, dev.batch_invariant) and graph_factory is None:
            return None  # CPU: eager (a test passes a fake ``graph_factory`` to drive the bookkeeping)
        if self.pooling or self.lora is not None or self.parallel.pp_size > 1 or self.parallel.tp_size > 1:
            return None  # (TP: collectives inside a graph are not verified yet)
        max_seqs = self.config.scheduler.max_num_seqs
        max_blocks = -(-self.config.max_model_len // self.block_size)
        return CudaGraphRunner(self.model, capture_sizes(dev.cuda_graph_sizes, max_seqs), len(self.windows),
                               max_blocks, self.device, graph_factory=graph_factory)

    def release_cache(self) -> None:
        if self.cuda_graphs is not None:  # captured against this cache: re-captured on the next step
            self.cuda_graphs.release()
        for _, layer in self._named_attention_layers():
            layer.kv_cache = torch.empty(0, device=self.device)
        self.kv_caches, self.kv_cache_groups = [], []
        self.requests.clear()
        if self.drafter is not None:
            self.drafter.clear()
        self.failures = RequestFailures()
        if self.structured_output is not None:
            self.structured_output.clear()

    # ---- one step ----------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> Optional[ModelRunnerOutput]:
        """One step; the samples on the driver rank, ``None`` on every other rank. The driver's
        output also names the requests that failed on their own since the last step."""
        out = self._execute(sched)
        failed = self.failures.take()
        if out is not None:
            out.failed = failed
            out.prompt_logprobs = {r: v for r, v in out.prompt_logprobs.items() if r not in self.failures}
        return out

    def _execute(self, sched: SchedulerOutput) -> Optional[ModelRunnerOutput]:
        self._update_states(sched)
        if sched.is_empty or all(r in self.failures.rejected for r in sched.num_scheduled_tokens):
            # expert parallelism: the MoE layers' collectives still run (zero tokens), or peers hang
            expert_parallel_dummy_step(self.model)
            return ModelRunnerOutput() if self.is_driver else None
        if self.pooling:
            return self._execute_pooling(sched)
        with one_thread():  # small tensors: no OpenMP region to wait on a descheduled thread
            inputs = self._prepare_inputs(sched)
        hidden = self._forward(inputs)
        if hidden is None:  # not the last pipeline stage: the activations went to the next one
            return None
        prompt_logprobs = self._prompt_logprobs(sched, inputs, hidden)
        if not inputs.sampling_req_ids:
            return ModelRunnerOutput(prompt_logprobs=prompt_logprobs) if self.is_driver else None
        # index_select, not hidden[...]: advanced indexing is an OpenMP region on CPU that waited
        # milliseconds for a descheduled thread when other roles shared the cores
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
        if logits is None:  # a TP rank other than the first: the driver samples
            self._receive_samples(inputs)
            return None
        if self.structured_output is not None and self.structured_output.has_requests:
            self.structured_output.apply_bitmask(logits, inputs.sampling_req_ids, inputs.drafts)
        with one_thread():
            meta = self._sampling_metadata(inputs.sampling_req_ids, logits.shape[-1],
                                           inputs.row_offsets, inputs.drafts)
            meta.draft_distributions = self._draft_distributions(inputs)
        sampled, logprobs = self.sampler(logits, meta)
        tokens = self._keep_samples(inputs, sampled)
        runs = self._runs(inputs, tokens)
        if self.structured_output is not None and self.structured_output.has_requests:
            accepted = [(req_id, token) for req_id, (_, run) in runs.items() for token in run]
            broken = self.structured_output.accept_tokens([r for r, _ in accepted], [t for _, t in accepted])
            for req_id, error in broken.items():
                self.failures.fail(req_id, f"structured outputs: {error}")
        logprobs = logprobs or [None] * len(tokens)
        out = ModelRunnerOutput(prompt_logprobs=prompt_logprobs)
        for req_id, (row, run) in runs.items():
            if req_id in self.failures:
                continue
            out.req_ids.append(req_id)
            out.sampled_token_ids.append(run[0])
            out.logprobs.append(logprobs[row])
            if len(run) > 1:
                out.extra_token_ids[req_id] = run[1:]
                if logprobs[row] is not None:
                    out.extra_logprobs[req_id] = logprobs[row + 1:row + len(run)]
        if self.spec is not None and len(out.req_ids) < self.spec.disable_by_batch_size:
            out.draft_token_ids = self._propose(out.req_ids)
        self._trim_rejected(inputs)  # after the draft model, which wrote its proposals' K / V there
        return out

    def _execute_pooling(self, sched: SchedulerOutput) -> Optional[ModelRunnerOutput]:
        """A pooling step: every scheduled request's whole input, packed, through the model and its
        pooler. Every TP rank computes the same pooled values; the driver answers them."""
        req_ids = [r for r in sched.num_scheduled_tokens if r not in self.failures.rejected]
        states = [self.requests[r] for r in req_ids]
        pooled = run_pooling(self.model, [s.token_ids for s in states], [s.pooling_params for s in states],
                             [s.token_type_ids for s in states])
        if not self.is_driver:
            return None
        return ModelRunnerOutput(pooler_output={r: p.float().tolist() for r, p in zip(req_ids, pooled)})

    def _forward(self, inputs: StepInputs) -> Optional[torch.Tensor]:
        """Run this stage's layers: activations in from the previous stage, out to the next one."""
        if self.cuda_graphs is not None and self._graph_step(inputs):
            return self.cuda_graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        if inputs.images is not None:
            embeds = self.model.embed(inputs.input_ids, inputs.images.rows, inputs.images.embeds)
            return self.model(inputs.input_ids, inputs.positions, inputs.meta, inputs_embeds=embeds)
        if self.parallel.pp_size == 1:
            return self.model(inputs.input_ids, inputs.positions, inputs.meta)
        layout = self.parallel.layout
        intermediate = None
        if not layout.is_first_stage:
            shape = (inputs.input_ids.shape[0], int(self.config.model.text_config["hidden_size"]))
            intermediate = tuple(self.parallel.recv_from_prev_stage([shape, shape], self.dtype, self.device))
        out = self.model(inputs.input_ids, inputs.positions, inputs.meta, intermediate)
        if layout.is_last_stage:
            return out
        self.parallel.send_to_next_stage(list(out))
        return None

    def _graph_step(self, inputs: StepInputs) -> bool:
        """A decode-only step a captured graph can run: one token per request, no drafts, no images."""
        return (inputs.meta.max_query_len == 1 and not inputs.drafts and inputs.images is None
                and self.cuda_graphs.can_run(inputs.input_ids.shape[0], inputs.meta))

    def _keep_samples(self, inputs: StepInputs, sampled: torch.Tensor) -> list[int]:
        """Append the driver's samples to its requests (and share them with the other TP ranks);
        every sampled row's token."""
        if self.keeps_own_samples and self.parallel.tp_size > 1:
            self.parallel.broadcast_from_first(sampled.to(torch.int64))
        tokens = sampled.tolist()
        if self.keeps_own_samples:
            self._append_samples(inputs, tokens)
        return tokens

    def _receive_samples(self, inputs: StepInputs) -> None:
        """On a TP rank other than the driver: the driver's samples, by broadcast (one stage only)."""
        if not self.keeps_own_samples:
            return  # several stages: the engine sends the tokens with the next step
        tokens = torch.empty(len(inputs.sampling_req_ids), dtype=torch.int64, device=self.device)
        self._append_samples(inputs, self.parallel.broadcast_from_first(tokens).tolist())
        self._trim_rejected(inputs)

    def _runs(self, inputs: StepInputs, tokens: list[int]) -> dict[str, tuple[int, list[int]]]:
        """Per request: its first sampled row and the tokens it gets this step (one, or the run
        its drafts' verification accepts). Every rank computes the same from the same samples."""
        runs: dict[str, tuple[int, list[int]]] = {}
        row = 0
        while row < len(tokens):
            req_id = inputs.sampling_req_ids[row]
            drafts = inputs.drafts.get(req_id)
            if drafts:
                runs[req_id] = (row, accepted_run(tokens[row:row + len(drafts) + 1], drafts))
                row += len(drafts) + 1
            else:
                runs[req_id] = (row, [tokens[row]])
                row += 1
        return runs

    def _append_samples(self, inputs: StepInputs, tokens: list[int]) -> None:
        for req_id, (_, run) in self._runs(inputs, tokens).items():
            self.requests[req_id].token_ids.extend(run)

    def _trim_rejected(self, inputs: StepInputs) -> None:
        """The engine gives back the blocks past a verified request's tokens (its rejected drafts'
        and the lookahead): so do we."""
        for req_id in inputs.drafts:
            state = self.requests.get(req_id)
            if state is None:
                continue
            keep = -(-len(state.token_ids) // self.block_size)
            for ids in state.block_ids:
                del ids[keep:]

    def _propose(self, req_ids: list[str]) -> dict[str, list[int]]:
        """Drafts (n-gram or the draft model's) for every request. Whatever depends on the tokens
        before a position is applied per draft row at verification, counting the drafts before it
        (``min_tokens``, penalties, bad words; see ``_sampling_metadata``); a grammar's mask too,
        and a structured request's drafts end before the first token its grammar refuses."""
        spec = self.spec
        states = [self.requests[r] for r in req_ids]
        if self.drafter is not None:
            drafts = self.drafter.propose([self._draft_request(s) for s in states])
        else:
            drafts = {s.req_id: ngram_propose(s.token_ids, spec.num_speculative_tokens, spec.prompt_lookup_min,
                                              spec.prompt_lookup_max) for s in states}
        if self.structured_output is not None:
            drafts = {r: d[:self.structured_output.valid_prefix(r, d)] for r, d in drafts.items()}
        return {r: d for r, d in drafts.items() if d}

    def _draft_request(self, state: RequestState) -> DraftRequest:
        """What the draft model needs of a request: an unseeded sampling one (unless a grammar cuts
        its drafts) gets drafts drawn from ``q``, one uniform per draft. Greedy, structured and
        seeded requests get the draft's argmax (point masses, verified by exact match against the
        target's own draw: a seeded request then gives exactly the tokens of plain decoding)."""
        request = DraftRequest(state.req_id, state.token_ids, state.block_ids)
        params = state.params
        if params.greedy or params.structured_outputs is not None or params.seed is not None:
            return request
        k = self.spec.num_speculative_tokens
        request.uniforms = torch.rand(k, dtype=torch.float64).clamp_(min=2.0**-53).tolist()
        request.params = params
        return request

    def _draft_distributions(self, inputs: StepInputs) -> Optional[DraftDistributions]:
        """The step's drafts that the draft model drew from ``q`` (as it proposed them), with one
        acceptance and one residual draw per draft; ``None`` when there are none."""
        if self.drafter is None or not inputs.drafts:
            return None
        first_rows: dict[str, int] = {}
        for row, req_id in enumerate(inputs.sampling_req_ids):
            first_rows.setdefault(req_id, row)
        found = DraftDistributions()
        for req_id, drafts in inputs.drafts.items():
            state = self.requests[req_id]
            q = self.drafter.take_distribution(req_id, len(state.token_ids), drafts)
            if q is None:
                continue
            # only unseeded requests have a q (seeded ones get point-mass drafts): fresh draws
            accept, resample = torch.rand(2, len(drafts), dtype=torch.float64).clamp_(min=2.0**-53).tolist()
            found.add(first_rows[req_id], list(drafts), q, accept, resample)
        return found or None

    def _structured_output_manager(self) -> StructuredOutputManager:
        """The grammar-mask manager, built (with the tokenizer) when the first structured request arrives."""
        if self.structured_output is None:
            from gridserve.services.worker.gguf_loader import load_hf_tokenizer

            tokenizer = load_hf_tokenizer(self.config.model.tokenizer_path)
            self.structured_output = StructuredOutputManager(
                tokenizer, self.config.model.vocab_size, eos_token_id=self.eos_token_id
            )
        return self.structured_output

    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
            if self.drafter is not None:
                self.drafter.forget(req_id)
            if self.encoder_cache is not None:
                self.encoder_cache.drop(req_id)
            self.failures.forget(req_id)
            if self.structured_output is not None:
                self.structured_output.remove(req_id)
        for new in sched.scheduled_new_reqs:
            try:
                check_new_request(new, self.config.model.vocab_size)
            except InvalidArgumentError as exc:  # every rank checks the same data: all leave it out
                self.failures.reject(new.req_id, str(exc))
                continue
            params = new.sampling_params
            stop_ids = list(params.stop_token_ids)
            if not params.ignore_eos and self.eos_token_id is not None:
                stop_ids.append(self.eos_token_id)
            state = RequestState(
                req_id=new.req_id,
                token_ids=[*new.prompt_token_ids, *new.output_token_ids],
                num_prompt_tokens=len(new.prompt_token_ids),
                params=params,
                block_ids=[list(ids) for ids in new.block_ids] + [[] for _ in self.windows[len(new.block_ids):]],
                num_computed_tokens=new.num_computed_tokens,
                stop_ids=stop_ids,
                images=list(new.mm_features),
                lora_request=new.lora_request,
                pooling_params=new.pooling_params,
                token_type_ids=new.token_type_ids,
            )
            if state.images and self.encoder_cache is None:  # every rank checks: all leave it out
                self.failures.reject(new.req_id, f"images: {self.config.model.architecture} takes text only")
                continue
            if new.lora_request is not None:
                try:  # every rank reads the same files: all leave a request on a bad adapter out
                    self._lora_manager().add(new.lora_request)
                except InvalidArgumentError as exc:
                    self.failures.reject(new.req_id, f"LoRA adapter {new.lora_request.lora_name!r}: {exc}")
                    continue
            self.requests[new.req_id] = state
            if self.drafter is not None:  # a resumed request's draft K / V are caught up anew
                self.drafter.forget(new.req_id)
            if params.structured_outputs is not None and self.is_driver:
                try:
                    self._structured_output_manager().add_request(
                        new.req_id, params.structured_outputs, new.output_token_ids
                    )
                except ValueError as exc:  # only this rank has grammars: the row stays in the batch
                    self.failures.fail(new.req_id, f"structured outputs: {exc}")
        for cached in sched.scheduled_cached_reqs:
            if cached.req_id in self.failures.rejected:
                continue
            state = self.requests[cached.req_id]
            for ids, new_ids in zip(state.block_ids, cached.new_block_ids):
                ids.extend(new_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            state.token_ids.extend(cached.new_token_ids)

    def _prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        req_ids = [r for r in sched.num_scheduled_tokens if r not in self.failures.rejected]
        if self.lora is not None:  # each adapter's tokens in one run of rows (kernels/lora.py)
            req_ids.sort(key=self._adapter_order)
        q_lens, starts, token_ids, tables, sampling, last_rows, offsets = [], [], [], [], [], [], []
        drafts_of: dict[str, list[int]] = {}
        total = 0
        for req_id in req_ids:
            state = self.requests[req_id]
            n = sched.num_scheduled_tokens[req_id]
            start = state.num_computed_tokens
            drafts = sched.scheduled_spec_tokens.get(req_id)
            if drafts:  # the last token, then the drafts: every position sampled
                token_ids.extend(state.token_ids[start : start + n - len(drafts)])
                token_ids.extend(drafts)
                drafts_of[req_id] = drafts
            else:
                token_ids.extend(state.token_ids[start : start + n])
            q_lens.append(n)
            starts.append(start)
            tables.append(state.block_ids)
            total += n
            if drafts:
                sampling.extend([req_id] * (len(drafts) + 1))
                last_rows.extend(range(total - len(drafts) - 1, total))
                offsets.extend(range(len(drafts) + 1))
            elif start + n >= len(state.token_ids):
                sampling.append(req_id)
                last_rows.append(total - 1)
                offsets.append(0)
        if self.lora is not None:  # each token's adapter slot, the step's adapters in slots
            self.lora.set_step([self.requests[r].lora_request for r in req_ids], q_lens)
        q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
        starts_t = torch.tensor(starts, dtype=torch.int64)
        query_start_loc = torch.zeros(len(req_ids) + 1, dtype=torch.int64)
        torch.cumsum(q_lens_t, 0, out=query_start_loc[1:])
        row_of_token = torch.repeat_interleave(torch.arange(len(req_ids)), q_lens_t)
        positions = torch.arange(total) + torch.repeat_interleave(starts_t - query_start_loc[:-1], q_lens_t)
        block_index, offset = positions // self.block_size, positions % self.block_size
        metas = []
        for g, window in enumerate(self.windows):
            group_tables = [t[g] for t in tables]
            if window:  # blocks the engine freed are the null block here too
                for ids, start in zip(group_tables, starts):
                    skipped = min(num_skipped_blocks(window, start, self.block_size), len(ids))
                    ids[:skipped] = [0] * skipped
            max_blocks = max(len(t) for t in group_tables)
            table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in group_tables], dtype=torch.int32)
            slot_mapping = table[row_of_token, block_index].long() * self.block_size + offset
            metas.append(AttentionMetadata(
                query_start_loc=query_start_loc.to(torch.int32).to(self.device),
                seq_lens=(starts_t + q_lens_t).to(torch.int32).to(self.device),
                block_table=table.to(self.device),
                slot_mapping=slot_mapping.to(self.device),
                max_query_len=max(q_lens),
            ))
        meta = metas[0]
        meta.other_groups = tuple(metas[1:])
        return StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.int64, device=self.device),
            positions=positions.to(self.device),
            meta=meta,
            logits_indices=torch.tensor(last_rows, dtype=torch.int64, device=self.device),
            sampling_req_ids=sampling,
            req_ids=req_ids,
            starts=starts,
            row_starts=query_start_loc[:-1].tolist(),
            images=self._image_rows(req_ids, starts, q_lens, query_start_loc[:-1].tolist()),
            row_offsets=offsets,
            drafts=drafts_of,
        )

    def _adapter_order(self, req_id: str) -> int:
        lora = self.requests[req_id].lora_request
        return 0 if lora is None else lora.lora_int_id

    def _image_rows(self, req_ids: list[str], starts: list[int], q_lens: list[int],
                    rows: list[int]) -> Optional[ImageRows]:
        if self.encoder_cache is None:
            return None
        scheduled = [(r, self.requests[r].images, s, n, row)
                     for r, s, n, row in zip(req_ids, starts, q_lens, rows) if self.requests[r].images]
        return self.encoder_cache.step_rows(scheduled) if scheduled else None

    def _sampling_metadata(self, req_ids: list[str], vocab_size: int,
                           offsets: Optional[list[int]] = None,
                           drafts: Optional[dict[str, list[int]]] = None) -> SamplingMetadata:
        """Per sampled row; ``offsets``: each row's position after its request's output so far
        (draft rows of speculative decoding; 0 otherwise), ``drafts``: the step's drafts by request.
        A row at offset ``j`` is sampled as plain decoding would sample that position: its draw,
        ``min_tokens``, bad words and penalties count the request's first ``j`` drafts as output."""
        states = [self.requests[r] for r in req_ids]
        offsets = offsets or [0] * len(states)
        drafts = drafts or {}
        ahead = [drafts.get(r, [])[:offset] for r, offset in zip(req_ids, offsets)]
        params = [s.params for s in states]
        temperature = [0.0 if p.greedy else p.temperature for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        num_logprobs = [p.logprobs for p in params]
        requested = [n for n in num_logprobs if n is not None]
        return SamplingMetadata(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=self.device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=self.device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=self.device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=self.device),
            all_greedy=not random_rows,
            need_top_k_top_p=any(params[i].top_p < 1.0 or top_k[i] < vocab_size for i in random_rows),
            need_min_p=any(params[i].min_p > 0 for i in random_rows),
            uniforms=self._uniforms(states, offsets) if random_rows else None,
            banned_token_ids=_banned_token_ids(states, offsets, ahead),
            max_num_logprobs=max(requested) if requested else None,
            num_logprobs=num_logprobs,
            allowed_token_ids={i: p.allowed_token_ids for i, p in enumerate(params) if p.allowed_token_ids},
            logit_bias={
                i: (list(p.logit_bias), list(p.logit_bias.values())) for i, p in enumerate(params) if p.logit_bias
            },
            penalties=self._penalties(states, ahead, vocab_size),
        )

    def _uniforms(self, states: list[RequestState], offsets: list[int]) -> torch.Tensor:
        """Each row's draw for this step: a function of (seed, output index) for seeded requests,
        torch's global generator for the others (greedy rows draw too; their value is unused). A
        draft row's output index is ``offset`` past the request's output so far: the draw it would
        have had without speculation."""
        draws = torch.rand(len(states), dtype=torch.float64).clamp_(min=2.0**-53)
        for i, (s, offset) in enumerate(zip(states, offsets)):
            if s.params.seed is not None:
                draws[i] = counter_uniform(s.params.seed, s.num_output_tokens + offset)
        return draws.to(self.device)

    def _penalties(self, states: list[RequestState], ahead: list[list[int]],
                   vocab_size: int) -> Optional[Penalties]:
        """The penalised rows' inputs: a row's output is its request's output so far, then
        ``ahead[row]`` (the drafts before a draft row); it has "seen" the prompt and that output."""
        rows = [i for i, s in enumerate(states) if s.params.has_penalties]
        if not rows:
            return None
        counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32)
        seen = torch.zeros(len(rows), vocab_size, dtype=torch.bool)
        for j, i in enumerate(rows):
            state = states[i]
            n = state.num_prompt_tokens
            output = torch.tensor([*state.token_ids[n:], *ahead[i]], dtype=torch.int64)
            counts[j].scatter_add_(0, output, torch.ones_like(output, dtype=torch.float32))
            seen[j, torch.tensor(state.token_ids[:n], dtype=torch.int64)] = True
            seen[j, output] = True
        params = [states[i].params for i in rows]
        return Penalties(
            rows=torch.tensor(rows, dtype=torch.int64, device=self.device),
            repetition=torch.tensor([p.repetition_penalty for p in params], device=self.device),
            frequency=torch.tensor([p.frequency_penalty for p in params], device=self.device),
            presence=torch.tensor([p.presence_penalty for p in params], device=self.device),
            output_counts=counts.to(self.device),
            seen=seen.to(self.device),
        )

    def _prompt_logprobs(self, sched: SchedulerOutput, inputs: StepInputs, hidden: torch.Tensor) -> dict:
        """Logprobs of each prompt token given its prefix, for requests that asked (chunk by chunk)."""
        result: dict[str, list] = {}
        for i, req_id in enumerate(inputs.req_ids):
            state = self.requests[req_id]
            k = state.params.prompt_logprobs
            start = inputs.starts[i]
            end = min(start + sched.num_scheduled_tokens[req_id], state.num_prompt_tokens - 1)
            if k is None or start >= end:
                continue
            first_row = inputs.row_starts[i]
            logits = self.model.compute_logits(hidden[first_row : first_row + end - start])
            if logits is None:  # a TP rank other than the first (it still joined the gather)
                continue
            logits = logits.float()
            targets = torch.tensor(state.token_ids[start + 1 : end + 1], dtype=torch.int64, device=self.device)
            entries = gather_logprobs(torch.log_softmax(logits, dim=-1), targets, max(k, 1))
            result[req_id] = [trim_logprobs(e, k) for e in entries]
        return result


def _banned_token_ids(states: list[RequestState], offsets: list[int],
                      ahead: list[list[int]]) -> dict[int, list[int]]:
    """Per row, the ids this step must not produce: stop ids before min_tokens (a draft row counts
    the output before it), and bad words (a draft row's output is followed by ``ahead[row]``, the
    drafts before it)."""
    banned: dict[int, list[int]] = {}
    for i, (s, offset) in enumerate(zip(states, offsets)):
        ids = list(s.stop_ids) if s.stop_ids and s.num_output_tokens + offset < s.params.min_tokens else []
        if s.params.bad_words_token_ids:
            output = [*s.token_ids[s.num_prompt_tokens :], *ahead[i]]
            ids += _bad_word_ends(s.params.bad_words_token_ids, output)
        if ids:
            banned[i] = ids
    return banned


def _bad_word_ends(words: list[list[int]], output: list[int]) -> list[int]:
    """The last token of each bad word whose other tokens end ``output`` (a one-token word's
    always)."""
    ends = []
    for word in words:
        prefix = word[:-1]
        if len(output) >= len(prefix) and output[len(output) - len(prefix) :] == prefix:
            ends.append(word[-1])
    return ends
