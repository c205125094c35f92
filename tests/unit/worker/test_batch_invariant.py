"""Batch-invariant mode (``batch_invariant=True``): a sequence's logits are bitwise the same alone or
in any batch, at any place of it, and whether its tokens were prefilled in one chunk, in several,
or decoded one by one; seeded sampling then gives the same tokens in any batch mix.

The tiny Llama runs in-process: the model with a paged KV cache and hand-built step metadata (each
sequence copy gets its own blocks), and ``LLM`` for sampling.
"""

from __future__ import annotations

import pytest
import torch

from gridserve.services.worker.attention import AttentionMetadata
from gridserve.services.worker.batch_invariant import BLOCK_ROWS, check_available, fixed_row_blocks
from gridserve.services.worker.model_runner import ModelRunner
from gridserve.services.worker.parallel_state import ParallelState, set_parallel_state
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import ConfigError
from gridserve.shared.kv_cache_spec import single_group

BLOCK = 16
BLOCKS_PER_SEQ = 8  # 128 positions per sequence copy


def _runner(model_path, batch_invariant: bool) -> ModelRunner:
    set_parallel_state(ParallelState.single())
    config = GridserveConfig.from_kwargs(model=str(model_path), device="cpu", block_size=BLOCK,
                                         batch_invariant=batch_invariant).finalize()
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    runner.initialize_cache(single_group(64 * BLOCKS_PER_SEQ, config.cache.block_size))
    return runner


@pytest.fixture(scope="module")
def invariant(llama_tiny):
    return _runner(llama_tiny, True)


class Seq:
    """One sequence copy: its tokens, how many are in the cache, its own blocks."""

    def __init__(self, tokens: list[int], slot: int) -> None:
        self.tokens = tokens
        self.done = 0
        self.blocks = list(range(slot * BLOCKS_PER_SEQ, (slot + 1) * BLOCKS_PER_SEQ))


def _step(runner: ModelRunner, work: list[tuple[Seq, int]]) -> list[torch.Tensor]:
    """One forward over ``(sequence, new tokens)`` pairs packed in this order; each one's last logits."""
    ids, positions, slots, qsl, lens, last = [], [], [], [0], [], []
    for seq, n in work:
        for p in range(seq.done, seq.done + n):
            ids.append(seq.tokens[p])
            positions.append(p)
            slots.append(seq.blocks[p // BLOCK] * BLOCK + p % BLOCK)
        qsl.append(qsl[-1] + n)
        lens.append(seq.done + n)
        last.append(qsl[-1] - 1)
        seq.done += n
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_table=torch.tensor([s.blocks for s, _ in work], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), max_query_len=max(n for _, n in work))
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(ids), torch.tensor(positions), meta)
        logits = runner.model.compute_logits(hidden[torch.tensor(last)])
    return list(logits)


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(4, 4096, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


TARGET = _prompt(0, 40)


def _alone(runner, tokens: list[int], slot: int = 0, decode: int = 0) -> list[torch.Tensor]:
    """Prefill ``tokens[:len - decode]`` alone, then decode the rest one by one; every step's logits."""
    seq = Seq(tokens, slot)
    out = _step(runner, [(seq, len(tokens) - decode)])
    for _ in range(decode):
        out += _step(runner, [(seq, 1)])
    return out


@pytest.mark.parametrize("batch_size,place", [(2, 0), (2, 1), (5, 3), (16, 0), (16, 9), (33, 32)])
def test_prefill_logits_do_not_depend_on_the_batch(invariant, batch_size, place):
    expected = _alone(invariant, TARGET)[0]
    target = Seq(TARGET, 0)
    others = [(Seq(_prompt(100 + i, 3 + 7 * i % 50), 1 + i), 3 + 7 * i % 50) for i in range(batch_size - 1)]
    work = others[:place] + [(target, len(TARGET))] + others[place:]
    assert torch.equal(_step(invariant, work)[place], expected)


@pytest.mark.parametrize("batch_size,place", [(4, 2), (17, 0), (64, 40)])
def test_decode_logits_do_not_depend_on_the_batch(invariant, batch_size, place):
    expected = _alone(invariant, TARGET, decode=3)
    target = Seq(TARGET, 0)
    _step(invariant, [(target, len(TARGET) - 3)])
    others = [Seq(_prompt(200 + i, 60), 1 + i) for i in range(batch_size - 1)]
    _step(invariant, [(s, 50 + i % 7) for i, s in enumerate(others)])
    for k in range(3):  # decodes next to other decodes (and, at k = 1, a prefill chunk too)
        mix = [(s, 1 if k != 1 or i % 3 else 2) for i, s in enumerate(others)]
        work = mix[:place] + [(target, 1)] + mix[place:]
        assert torch.equal(_step(invariant, work)[place], expected[1 + k]), k


@pytest.mark.parametrize("split", [[40], [7, 33], [16, 16, 8], [1] * 40, [20] + [1] * 20, [3, 1, 30, 1, 5]])
def test_chunked_prefill_and_decode_give_the_same_last_logits(invariant, split):
    expected = _alone(invariant, TARGET)[0]
    seq = Seq(TARGET, 0)
    logits = [_step(invariant, [(seq, n)])[0] for n in split]
    assert torch.equal(logits[-1], expected)


def test_the_kv_written_by_prefill_and_by_decode_is_the_same(invariant):
    whole = _alone(invariant, TARGET + [9, 9, 9], slot=0)[0]
    decoded = _alone(invariant, TARGET + [9, 9, 9], slot=1, decode=20)[-1]
    assert torch.equal(whole, decoded)
    for cache in invariant.kv_caches:  # [2, blocks, BLOCK, kv heads, d]: the 43 positions of each copy
        first = cache[:, :BLOCKS_PER_SEQ].flatten(1, 2)[:, :43]
        second = cache[:, BLOCKS_PER_SEQ : 2 * BLOCKS_PER_SEQ].flatten(1, 2)[:, :43]
        assert torch.equal(first, second)


def test_fixed_row_blocks_is_the_function_applied_per_block():
    weight = torch.randn(48, 32)
    x = torch.randn(2 * BLOCK_ROWS + 3, 32)
    out = fixed_row_blocks(lambda t: t @ weight.T, x)
    assert out.shape == (x.shape[0], 48)
    torch.testing.assert_close(out, x @ weight.T)
    assert torch.equal(out[5], fixed_row_blocks(lambda t: t @ weight.T, x[5:6])[0])
    assert fixed_row_blocks(lambda t: t @ weight.T, x[:0]).shape == (0, 48)


def test_the_mode_is_off_by_default_and_cpu_only(llama_tiny, monkeypatch):
    monkeypatch.delenv("GRIDSERVE_BATCH_INVARIANT", raising=False)
    assert GridserveConfig.from_kwargs(model=str(llama_tiny)).device.batch_invariant is False
    monkeypatch.setenv("GRIDSERVE_BATCH_INVARIANT", "1")
    assert GridserveConfig.from_kwargs(model=str(llama_tiny)).device.batch_invariant is True
    with pytest.raises(ConfigError, match="device.batch_invariant"):
        GridserveConfig.from_kwargs(model=str(llama_tiny), device="cuda", batch_invariant=True)
    with pytest.raises(ConfigError, match="CPU only"):  # device "auto" that resolved to a GPU
        check_available(torch.device("cuda", 0))


def test_seeded_sampling_is_the_same_in_any_batch_mix(llama_tiny):
    from gridserve import LLM, SamplingParams

    llm = LLM(model=str(llama_tiny), batch_invariant=True, kv_cache_memory_bytes=16 << 20,
              max_num_batched_tokens=64, max_model_len=256)
    try:
        prompts = [{"prompt_token_ids": _prompt(300 + i, 5 + 11 * i % 37)} for i in range(12)]
        params = [SamplingParams(temperature=1.3, seed=7 + i, max_tokens=24, ignore_eos=True, logprobs=1)
                  for i in range(12)]

        def tokens(order: list[int]) -> dict[int, tuple[list[int], list[float]]]:
            """Each request's tokens and their logprobs (floats: they show any difference in the logits)."""
            outs = llm.generate([prompts[i] for i in order], [params[i] for i in order], use_tqdm=False)
            return {i: (list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
                    for i, c in ((i, o.outputs[0]) for i, o in zip(order, outs))}

        alone = {i: tokens([i])[i] for i in (0, 5, 11)}
        everything = tokens(list(range(12)))  # chunked prefills (64-token budget) next to decodes
        reversed_mix = tokens(list(reversed(range(12))))
        assert everything == reversed_mix
        assert all(everything[i] == alone[i] for i in alone)
    finally:
        llm.shutdown()


def test_the_sampler_treats_each_row_alone():
    from gridserve.services.worker.sampler import apply_top_k_top_p

    logits = torch.randn(64, 4096, generator=torch.Generator().manual_seed(3)) * 3

    def probs(x: torch.Tensor) -> torch.Tensor:  # what a seeded draw reads: the row's CDF
        top_k, top_p = torch.full((x.shape[0],), 50), torch.full((x.shape[0],), 0.9)
        return apply_top_k_top_p(x / 0.9, top_k, top_p).softmax(-1).cumsum(-1)

    for row in (0, 17, 63):
        assert torch.equal(probs(logits)[row], probs(logits[row : row + 1])[0])
        assert torch.equal(torch.log_softmax(logits, -1)[row], torch.log_softmax(logits[row : row + 1], -1)[0])


@pytest.mark.parametrize("arch", ["qwen2_tiny", "mistral_tiny"])  # Qwen2: biases on Q/K/V
def test_other_llama_family_models_are_invariant_too(request, arch):
    runner = _runner(request.getfixturevalue(arch), True)
    expected = _alone(runner, TARGET)[0]
    by_token = Seq(TARGET, 1)
    assert torch.equal([_step(runner, [(by_token, 1)])[0] for _ in TARGET][-1], expected)
    others = [(Seq(_prompt(400 + i, 9 + i), 2 + i), 9 + i) for i in range(5)]
    assert torch.equal(_step(runner, others[:2] + [(Seq(TARGET, 0), len(TARGET))] + others[2:])[2], expected)


def test_the_flag_travels_from_serve_to_the_engine_and_in_the_worker_config(llama_tiny, monkeypatch):
    import argparse

    from gridserve.roles import (
        add_batch_invariant_argument,
        add_engine_arguments,
        engine_argv,
        engine_config,
    )
    from gridserve.shared.rpc.worker_convert import config_from_pb, config_to_pb

    monkeypatch.delenv("GRIDSERVE_BATCH_INVARIANT", raising=False)
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    add_engine_arguments(parser)
    args = parser.parse_args(["--model", str(llama_tiny), "--batch-invariant"])
    assert "--batch-invariant" in engine_argv(args)  # serve -> its engines
    assert "--batch-invariant" not in engine_argv(parser.parse_args(["--model", str(llama_tiny)]))
    config = engine_config(args, ["127.0.0.1:1"])
    assert config.device.batch_invariant is True
    assert config_from_pb(config_to_pb(config)).device.batch_invariant is True  # engine -> workers
    monkeypatch.setenv("GRIDSERVE_BATCH_INVARIANT", "1")
    worker = argparse.ArgumentParser()
    add_batch_invariant_argument(worker)  # gridserve worker's own flag, from the environment
    assert worker.parse_args([]).batch_invariant is True


@pytest.mark.parametrize("engine_says,worker_flag", [(False, True), (True, False), (False, False)])
def test_a_worker_started_with_the_flag_turns_the_mode_on_whatever_its_engine_says(
        llama_tiny, engine_says, worker_flag):
    from gridserve.api.worker.v1 import worker_pb2
    from gridserve.services.worker.servicer import WorkerServicer
    from gridserve.shared.rpc.worker_convert import config_to_pb

    config = GridserveConfig.from_kwargs(model=str(llama_tiny), device="cpu", batch_invariant=engine_says).finalize()
    servicer = WorkerServicer(on_ready=lambda ok: None, batch_invariant=worker_flag)
    request = worker_pb2.CollectiveRPCRequest(call_id=1, init_device=worker_pb2.InitDeviceArgs(
        config=config_to_pb(config), world_size=1))
    response = servicer._call(request)
    assert not response.HasField("error"), response.error.message
    assert servicer.worker.config.device.batch_invariant is (engine_says or worker_flag)
