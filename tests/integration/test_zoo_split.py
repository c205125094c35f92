"""Every zoo architecture the registry marks ``TP`` / ``PP`` computes the single model's logits when
split in two, checked in one process for each of them (the gloo-backed runs of
``test_zoo_llama_family`` / ``test_zoo_gpt_family`` / ``test_parallel`` cover a sample end to end).

Tensor parallelism: both ranks' models (each loads only its shards) run the same forward in two
threads whose collectives (all-reduce, the logits gather) meet at a barrier, so every sharded
layer, its all-reduce and the vocab-parallel LM head (biased or tied) are exercised. Pipeline
parallelism: stage 0's ``(hidden, residual)`` is handed to stage 1 by hand. Prompts are longer than
the windows, so window masks, soft caps and ALiBi slopes per rank all count.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import pytest
import torch

from gridserve.services.worker.attention import AttentionMetadata
from gridserve.services.worker.loader import load_model
from gridserve.services.worker.parallel_state import ParallelState, set_parallel_state
from gridserve.shared.config import GridserveConfig
from gridserve.shared.model_registry import ARCHITECTURES
from gridserve.shared.parallel import RankLayout
from tests.zoo import zoo_checkpoint

from .test_zoo_gpt_family import CHECKPOINTS as GPT_FAMILY
from .test_zoo_llama_family import checkpoint as llama_family
from .test_zoo_moe import checkpoint as moe_family

# architecture -> its zoo checkpoint (test_zoo_llama_family's ZOO, test_zoo_gpt_family's CHECKPOINTS or
# test_zoo_moe's ZOO)
CASES = {
    "MistralForCausalLM": ("llama", "mistral"), "Qwen3ForCausalLM": ("llama", "qwen3"),
    "SmolLM3ForCausalLM": ("llama", "smollm3"), "Olmo2ForCausalLM": ("llama", "olmo2"),
    "GraniteForCausalLM": ("llama", "granite"), "Phi3ForCausalLM": ("llama", "phi3"),
    "Glm4ForCausalLM": ("llama", "glm4"), "CohereForCausalLM": ("llama", "cohere"),
    "GemmaForCausalLM": ("llama", "gemma"), "Gemma2ForCausalLM": ("llama", "gemma2"),
    "Gemma3ForCausalLM": ("llama", "gemma3"), "GPT2LMHeadModel": ("gpt", "gpt2"),
    "GPTJForCausalLM": ("gpt", "gptj"), "GPTNeoXForCausalLM": ("gpt", "gpt_neox"),
    "PhiForCausalLM": ("gpt", "phi"), "StableLmForCausalLM": ("gpt", "stablelm"),
    "Starcoder2ForCausalLM": ("gpt", "starcoder2"), "FalconForCausalLM": ("gpt", "falcon-new"),
    "BloomForCausalLM": ("gpt", "bloom"),
    "Qwen2MoeForCausalLM": ("moe", "qwen2_moe"), "Qwen3MoeForCausalLM": ("moe", "qwen3_moe"),
}
# split by their own tests (test_parallel, test_mixtral, test_llava_matches_hf end to end; test_zoo_deepseek's
# and test_zoo_gpt_oss's TP=2 / PP=2 logits in process)
ELSEWHERE = {"LlamaForCausalLM", "Qwen2ForCausalLM", "OPTForCausalLM", "MixtralForCausalLM",
             "LlavaForConditionalGeneration", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
             "GptOssForCausalLM",
             # the encoders (issue 37): TP=2 vectors and scores in process in test_pooling_models
             "BertModel", "BertForSequenceClassification", "XLMRobertaModel",
             "XLMRobertaForSequenceClassification",
             # EmbeddingGemma's architecture: TP=2 vectors in test_embeddinggemma_dense
             "Gemma3TextModel"}
PROMPTS = [list(range(100, 140)), [7, 300, 301, 302, 4000, 9, 11]]  # 40 tokens: past every window (24, 32)


def _path(architecture: str) -> str:
    family, name = CASES[architecture]
    if family == "llama":
        return llama_family(name)
    if family == "moe":
        return moe_family(name)
    config_class, config = GPT_FAMILY[name]
    return str(zoo_checkpoint(f"gpt-family-{name}", config_class, **config))


class _Exchange:
    """Where two in-process ranks meet: each puts its tensor in, both read every rank's."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[Optional[torch.Tensor]] = [None] * size

    def all(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = x.clone()
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read them
        return parts


@dataclass
class ThreadRank(ParallelState):
    """A TP rank whose collectives meet its peer threads at an ``_Exchange`` (sums in rank order)."""

    exchange: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x.copy_(torch.stack(self.exchange.all(self.tp_rank, x)).sum(0))

    def gather_to_first(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        parts = self.exchange.all(self.tp_rank, x.contiguous())
        return torch.cat(parts, dim=-1) if self.tp_rank == 0 else None

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        return x.copy_(self.exchange.all(self.tp_rank, x)[0])


def _load(path: str, state: ParallelState, **parallel: int) -> torch.nn.Module:
    config = GridserveConfig.from_kwargs(model=path, **parallel).finalize()  # refuses what the registry says no to
    set_parallel_state(state)
    try:
        return load_model(config, torch.device("cpu"))
    finally:
        set_parallel_state(ParallelState.single())


def _inputs() -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    lens = [len(p) for p in PROMPTS]
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(query_start_loc=starts, seq_lens=torch.tensor(lens, dtype=torch.int32),
                             block_table=torch.zeros(len(lens), 1, dtype=torch.int32),
                             slot_mapping=torch.zeros(sum(lens), dtype=torch.int64), max_query_len=max(lens))
    ids = torch.tensor([t for p in PROMPTS for t in p])
    positions = torch.cat([torch.arange(n) for n in lens])
    return ids, positions, meta  # no KV cache bound: each prompt attends as a fresh prefill


@torch.inference_mode()
def _logits(model: torch.nn.Module, intermediate=None) -> Any:
    ids, positions, meta = _inputs()
    out = model(ids, positions, meta, intermediate)
    return out if isinstance(out, tuple) else model.compute_logits(out)


@pytest.fixture(scope="module")
def single_logits():
    cache: dict[str, torch.Tensor] = {}

    def get(architecture: str) -> torch.Tensor:
        if architecture not in cache:
            cache[architecture] = _logits(_load(_path(architecture), ParallelState.single()))
        return cache[architecture]

    return get


def test_every_architecture_marked_tp_or_pp_is_split_here_or_end_to_end_elsewhere():
    marked = {name for name, info in ARCHITECTURES.items() if info.tensor_parallel or info.pipeline_parallel}
    assert marked <= set(CASES) | ELSEWHERE
    assert all(ARCHITECTURES[name].tensor_parallel and ARCHITECTURES[name].pipeline_parallel for name in CASES)


@pytest.mark.parametrize("architecture", list(CASES))
def test_tensor_parallel_2_gives_the_single_models_logits(architecture, single_logits):
    path, exchange = _path(architecture), _Exchange(2)
    ranks = [_load(path, ThreadRank(RankLayout(rank, 2, 1), exchange=exchange), tensor_parallel_size=2)
             for rank in (0, 1)]
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(_logits, ranks)
    assert second is None
    torch.testing.assert_close(first, single_logits(architecture), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("architecture", list(CASES))
def test_pipeline_parallel_2_gives_the_single_models_logits(architecture, single_logits):
    path = _path(architecture)
    first, last = (_load(path, ParallelState(RankLayout(rank, 1, 2)), pipeline_parallel_size=2) for rank in (0, 1))
    handed = _logits(first)
    assert isinstance(handed, tuple) and first.logits_head is None
    torch.testing.assert_close(_logits(last, handed), single_logits(architecture), rtol=1e-4, atol=1e-4)
