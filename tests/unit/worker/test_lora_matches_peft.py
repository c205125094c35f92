"""Multi-LoRA serving computes what transformers + PEFT compute, request by request, in one batch.

Random PEFT adapters are made here with ``LoraConfig(init_lora_weights=False)`` (PEFT's default
B = 0 would let any fake pass): on a tiny Llama (separate q/k/v and gate/up merged here) and a tiny
Phi-3 (whose checkpoint holds q/k/v and gate/up pre-fused), adapter "attn" is rank 8 on the
attention projections (rank 4 on o_proj by ``rank_pattern``) and adapter "all" is rank 16 rsLoRA on
every projection (``alpha_pattern`` on down_proj). A batch mixing base-model, "attn" and "all"
requests gives each request PEFT's (unmerged ``PeftModel``) logits within 1e-4 (fp32), greedy
tokens through the ``ModelRunner`` equal PEFT's, and every adapter changes the base model's output.
Tensor parallelism (two ranks in threads) and pipeline parallelism (two stages by hand) give the
single model's logits with adapters; int8 base weights keep the adapters' deltas.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import pytest
import torch

from gridserve.services.worker.attention import AttentionMetadata
from gridserve.services.worker.loader import load_model
from gridserve.services.worker.lora import LoRAManager
from gridserve.services.worker.model_runner import ModelRunner
from gridserve.services.worker.parallel_state import ParallelState, set_parallel_state
from gridserve.shared.config import GridserveConfig, LoRAConfig
from gridserve.shared.kv_cache_spec import single_group
from gridserve.shared.lora import LoRARequest
from gridserve.shared.parallel import RankLayout
from gridserve.shared.sampling_params import SamplingParams
from gridserve.shared.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tests.zoo import zoo_checkpoint

_BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 24, "max_position_embeddings": 512, "tie_word_embeddings": False}
ARCHS = {
    "llama": ("LlamaConfig", {}, ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]),
    "phi3": ("Phi3Config", {"pad_token_id": 0}, ["qkv_proj", "o_proj"], ["gate_up_proj", "down_proj"]),
}
ADAPTERS = ("attn", "all")
PROMPTS = [[5, 17, 300, 41, 2000, 9, 77, 8], [100, 200, 300, 400, 500], list(range(600, 640)), [7, 8, 9, 10, 11, 12]]
LORA = LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=16)
CPU = torch.device("cpu")


@functools.cache
def checkpoint(arch: str) -> str:
    config_class, extra, _, _ = ARCHS[arch]
    return str(zoo_checkpoint(f"lora-{arch}", config_class, **{**_BASE, **extra}))


@functools.cache
def adapter(arch: str, kind: str, root: str) -> str:
    """A random PEFT adapter of ``arch`` saved as PEFT saves it (cached for the session)."""
    import peft
    from transformers import AutoModelForCausalLM

    _, _, attention, mlp = ARCHS[arch]
    if kind == "attn":
        config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=attention, rank_pattern={"o_proj": 4},
                                 init_lora_weights=False)
    else:
        config = peft.LoraConfig(r=16, lora_alpha=32, use_rslora=True, target_modules=attention + mlp,
                                 alpha_pattern={"down_proj": 8}, init_lora_weights=False)
    torch.manual_seed(1 + ADAPTERS.index(kind))
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(checkpoint(arch), dtype=torch.float32), config)
    folder = Path(root) / f"{arch}-{kind}"
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("adapters"))

    def get(arch: str, kind: str) -> LoRARequest:
        return LoRARequest(f"{arch}-{kind}", 1 + ADAPTERS.index(kind), adapter(arch, kind, root))

    return get


@torch.inference_mode()
def hf_logits(arch: str, lora: Optional[LoRARequest], prompt: list[int]) -> torch.Tensor:
    return _hf_model(arch, lora.lora_path if lora else None)(torch.tensor([prompt])).logits[0]


@functools.cache
def _hf_model(arch: str, adapter_path: Optional[str]):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(checkpoint(arch), dtype=torch.float32).eval()
    return PeftModel.from_pretrained(base, adapter_path).eval() if adapter_path else base


def _load(arch: str, state: ParallelState, **kwargs) -> torch.nn.Module:
    config = GridserveConfig.from_kwargs(model=checkpoint(arch), device="cpu", **kwargs).finalize()
    set_parallel_state(state)
    try:
        return load_model(config, CPU)
    finally:
        set_parallel_state(ParallelState.single())


def _inputs(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    lens = [len(p) for p in prompts]
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(query_start_loc=starts, seq_lens=torch.tensor(lens, dtype=torch.int32),
                             block_table=torch.zeros(len(lens), 1, dtype=torch.int32),
                             slot_mapping=torch.zeros(sum(lens), dtype=torch.int64), max_query_len=max(lens))
    return torch.tensor([t for p in prompts for t in p]), torch.cat([torch.arange(n) for n in lens]), meta


@torch.inference_mode()
def _batch_logits(model, manager: LoRAManager, loras: list[Optional[LoRARequest]], intermediate=None):
    """Every row's logits of ``PROMPTS`` run as one batch, request ``i`` on ``loras[i]``."""
    manager.set_step(loras, [len(p) for p in PROMPTS])
    out = model(*_inputs(PROMPTS), intermediate)
    return out if isinstance(out, tuple) else model.compute_logits(out)


def _per_prompt(logits: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.split(logits, [len(p) for p in PROMPTS]))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_mixed_batch_gives_each_request_peft_logits(arch, adapters):
    attn, every = adapters(arch, "attn"), adapters(arch, "all")
    model = _load(arch, ParallelState.single())
    manager = LoRAManager(model, LORA, CPU, torch.float32)
    loras = [None, attn, every, attn]
    got = _per_prompt(_batch_logits(model, manager, loras))
    for prompt, lora, logits in zip(PROMPTS, loras, got):
        expected = hf_logits(arch, lora, prompt)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        if lora is not None:  # the adapter matters
            assert (logits - hf_logits(arch, None, prompt)).abs().max() > 0.5
    # the same adapters in other slots and places of the batch: still each request's own logits
    loras = [every, None, attn, every]
    for prompt, lora, logits in zip(PROMPTS, loras, _per_prompt(_batch_logits(model, manager, loras))):
        torch.testing.assert_close(logits, hf_logits(arch, lora, prompt), rtol=1e-4, atol=1e-4)


def _runner(arch: str, **kwargs) -> ModelRunner:
    set_parallel_state(ParallelState.single())
    config = GridserveConfig.from_kwargs(model=checkpoint(arch), device="cpu", block_size=16, enable_lora=True,
                                         max_loras=2, max_lora_rank=16, **kwargs).finalize()
    runner = ModelRunner(config, CPU)
    runner.load_model()
    runner.initialize_cache(single_group(64, 16))
    return runner


def _generate(runner: ModelRunner, requests: list[tuple[list[int], Optional[LoRARequest]]], n: int):
    """Greedy decoding of ``requests`` as one batch, steps built as the engine builds them; each
    request's tokens (and the step's failures)."""
    params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)
    new = [NewRequestData(f"r{i}", prompt, params, [list(range(8 * i, 8 * i + 8))], 0, lora_request=lora)
           for i, (prompt, lora) in enumerate(requests)]
    out = runner.execute_model(SchedulerOutput(
        scheduled_new_reqs=new, num_scheduled_tokens={r.req_id: len(r.prompt_token_ids) for r in new},
        total_num_scheduled_tokens=sum(len(r.prompt_token_ids) for r in new)))
    failed = dict(out.failed)
    tokens = {r: [t] for r, t in zip(out.req_ids, out.sampled_token_ids)}
    for step in range(n - 1):
        cached = [CachedRequestData(r.req_id, [], len(r.prompt_token_ids) + step) for r in new if r.req_id in tokens]
        out = runner.execute_model(SchedulerOutput(scheduled_cached_reqs=cached,
                                                   num_scheduled_tokens={c.req_id: 1 for c in cached},
                                                   total_num_scheduled_tokens=len(cached)))
        for r, t in zip(out.req_ids, out.sampled_token_ids):
            tokens[r].append(t)
    return [tokens.get(f"r{i}") for i in range(len(requests))], failed


@torch.inference_mode()
def _hf_greedy_check(arch: str, lora: Optional[LoRARequest], prompt: list[int], tokens: list[int]) -> list[int]:
    """PEFT's greedy choice after each prefix of ``prompt + tokens`` (EOS masked, as min_tokens does)."""
    model = _hf_model(arch, lora.lora_path if lora else None)
    logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    logits[:, model.config.eos_token_id] = -float("inf")
    return logits.argmax(-1).tolist()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_runner_greedy_tokens_equal_peft_for_base_and_two_adapters_in_one_batch(arch, adapters):
    runner = _runner(arch)
    prompt = PROMPTS[0]
    loras = [None, adapters(arch, "attn"), adapters(arch, "all"), None]
    tokens, failed = _generate(runner, [(prompt, lora) for lora in loras], 8)
    assert not failed
    for lora, got in zip(loras, tokens):
        assert got == _hf_greedy_check(arch, lora, prompt, got)
    assert tokens[0] == tokens[3] and tokens[1] != tokens[0] and tokens[2] != tokens[0]
    assert sorted(runner.list_loras()) == [1, 2]


def test_request_on_a_bad_adapter_fails_alone(adapters, tmp_path):
    runner = _runner("llama")
    bad = LoRARequest("missing", 7, str(tmp_path / "nowhere"))
    tokens, failed = _generate(runner, [(PROMPTS[1], bad), (PROMPTS[1], adapters("llama", "attn")),
                                        (PROMPTS[1], None)], 4)
    assert set(failed) == {"r0"} and "lora_path" in failed["r0"] and tokens[0] is None
    assert tokens[1] == _hf_greedy_check("llama", adapters("llama", "attn"), PROMPTS[1], tokens[1])
    assert runner.list_loras() == [1]


def test_more_adapters_than_slots_over_steps_reuse_slots(adapters):
    """max_loras=2 slots, three adapters across steps (never more than two in one): the LRU slot
    is overwritten and each step still gets each request's own adapter."""
    model = _load("llama", ParallelState.single())
    manager = LoRAManager(model, LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2),
                          CPU, torch.float32)
    attn, every = adapters("llama", "attn"), adapters("llama", "all")
    third = LoRARequest("attn-again", 3, attn.lora_path)
    for loras in ([attn, every, None, attn], [third, None, every, None], [attn, attn, None, third]):
        got = _per_prompt(_batch_logits(model, manager, loras))
        for prompt, lora, logits in zip(PROMPTS, loras, got):
            torch.testing.assert_close(logits, hf_logits("llama", lora, prompt), rtol=1e-4, atol=1e-4)
    assert manager.list() == [3, 1]  # max_cpu_loras=2: "all" (id 2), least recently used, was evicted


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tensor_parallel_2_with_adapters_gives_the_single_models_logits(arch, adapters):
    from tests.integration.test_zoo_split import ThreadRank, _Exchange

    loras = [adapters(arch, "all"), None, adapters(arch, "attn"), adapters(arch, "all")]
    single = _load(arch, ParallelState.single())
    expected = _batch_logits(single, LoRAManager(single, LORA, CPU, torch.float32), loras)
    exchange = _Exchange(2)
    ranks = [_load(arch, ThreadRank(RankLayout(rank, 2, 1), exchange=exchange), tensor_parallel_size=2)
             for rank in (0, 1)]
    managers = [LoRAManager(model, LORA, CPU, torch.float32) for model in ranks]
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda i: _batch_logits(ranks[i], managers[i], loras), (0, 1))
    assert second is None
    torch.testing.assert_close(first, expected, rtol=1e-4, atol=1e-4)
    # each rank read only its slice: half of a column layer's B and of a row layer's A
    report = managers[1].loaded[2].report
    prefix = "base_model.model.model.layers.0"
    up = "mlp.up_proj" if arch == "llama" else "mlp.gate_up_proj"
    assert report.fraction(f"{prefix}.{up}.lora_B.weight") == 0.5
    assert report.fraction(f"{prefix}.{up}.lora_A.weight") == 1.0
    assert report.fraction(f"{prefix}.self_attn.o_proj.lora_A.weight") == 0.5
    assert report.fraction(f"{prefix}.self_attn.o_proj.lora_B.weight") == 1.0


def test_pipeline_parallel_2_with_adapters_gives_the_single_models_logits(adapters):
    loras = [adapters("llama", "all"), None, adapters("llama", "attn"), adapters("llama", "all")]
    single = _load("llama", ParallelState.single())
    expected = _batch_logits(single, LoRAManager(single, LORA, CPU, torch.float32), loras)
    first, last = (_load("llama", ParallelState(RankLayout(rank, 1, 2)), pipeline_parallel_size=2) for rank in (0, 1))
    managers = [LoRAManager(model, LORA, CPU, torch.float32) for model in (first, last)]
    handed = _batch_logits(first, managers[0], loras)
    torch.testing.assert_close(_batch_logits(last, managers[1], loras, handed), expected, rtol=1e-4, atol=1e-4)
    # each stage holds (and read) only its own layers' adapter weights
    assert all(".layers.0." in name for name in managers[0].loaded[2].weights)
    assert all(".layers.1." in name for name in managers[1].loaded[2].weights)


def test_int8_base_weights_still_get_the_adapter(adapters):
    every = adapters("llama", "all")
    model = _load("llama", ParallelState.single(), quantization="int8")
    assert model.model.layers[0].self_attn.qkv_proj.qweight is not None
    manager = LoRAManager(model, LORA, CPU, torch.float32)
    got = _per_prompt(_batch_logits(model, manager, [None, every, every, None]))
    for prompt, lora, logits in zip(PROMPTS, [None, every, every, None], got):
        error = (logits - hf_logits("llama", lora, prompt)).abs().max()
        effect = (hf_logits("llama", every, prompt) - hf_logits("llama", None, prompt)).abs().max()
        assert error < effect / 5  # int8's rounding only: the adapter's delta is all there


def test_gpt2_conv1d_adapter_matches_peft(tmp_path):
    """GPT-2's Conv1D projections (``fan_in_fan_out``; c_attn pre-fused Q/K/V) take PEFT's adapter too."""
    import peft
    from transformers import AutoModelForCausalLM

    path = str(zoo_checkpoint("lora-gpt2", "GPT2Config", n_embd=64, n_layer=2, n_head=4, n_positions=256))
    torch.manual_seed(3)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True,
                             init_lora_weights=False)
    reference = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), config).eval()
    reference.save_pretrained(tmp_path / "gpt2")
    set_parallel_state(ParallelState.single())
    model = load_model(GridserveConfig.from_kwargs(model=path, device="cpu").finalize(), CPU)
    manager = LoRAManager(model, LORA, CPU, torch.float32)
    lora = LoRARequest("gpt2", 1, str(tmp_path / "gpt2"))
    got = _per_prompt(_batch_logits(model, manager, [lora, None, lora, None]))
    with torch.inference_mode():
        for prompt, logits in zip(PROMPTS[:3:2], got[:3:2]):
            expected = reference(torch.tensor([prompt])).logits[0]
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
            with reference.disable_adapter():
                assert (logits - reference(torch.tensor([prompt])).logits[0]).abs().max() > 0.5


@pytest.mark.parametrize("max_loras", [2, 1])
def test_llm_generate_mixes_adapters_and_matches_peft(adapters, max_loras):
    """``LLM(enable_lora=True).generate(..., lora_request=[...])``: base, "attn" and "all" requests in
    one call get PEFT's greedy tokens; with one slot the engine runs the adapters in turns."""
    from gridserve import LLM

    llm = LLM(model=checkpoint("llama"), enable_lora=True, max_loras=max_loras, max_lora_rank=16,
              kv_cache_memory_bytes=32 << 20)
    try:
        loras = [None, adapters("llama", "attn"), adapters("llama", "all"), adapters("llama", "attn")]
        params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, lora, out in zip(PROMPTS, loras, outs):
        got = list(out.outputs[0].token_ids)
        assert got == _hf_greedy_check("llama", lora, prompt, got)
