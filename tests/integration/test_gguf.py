"""GGUF checkpoints through ``LLM(model="....gguf")``: token-exact (greedy) against the same
weights loaded from safetensors — float32 GGUFs of the recipe's Llama and Qwen2, a Q8_0 one
against a safetensors folder of its dequantized weights — with the embedded tokenizer and chat
template, ``tokenizer=`` / ``--tokenizer`` overriding it (in-process and through the services), and
``quantization="int8"`` re-quantizing as usual."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from gridserve import LLM, SamplingParams
from tests.gguf_files import permute_qk, write_gguf

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def push(self",
           "for i in range(10):\n    print("]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
MESSAGES = [[{"role": "user", "content": "def f(x): return"}], [{"role": "system", "content": "hi"},
                                                                 {"role": "user", "content": "import"}]]


def _llm(path, **kwargs) -> LLM:
    return LLM(model=str(path), kv_cache_memory_bytes=16 << 20, max_model_len=256, **kwargs)


def _outputs(llm: LLM, chat: bool = True) -> tuple[list[list[int]], ...]:
    gen = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    out: tuple[list[list[int]], ...] = ([o.prompt_token_ids for o in gen], [o.outputs[0].token_ids for o in gen])
    if chat:
        out += ([o.prompt_token_ids + o.outputs[0].token_ids for o in llm.chat(MESSAGES, GREEDY, use_tqdm=False)],)
    return out


def _token_outputs(llm: LLM, folder) -> list[list[int]]:
    """Greedy tokens for the prompts as tokenizer.json encodes them (independent of the tokenizer
    class: transformers 5 rebuilds qwen2's pre-tokenizer, which tokenizer.json does not have)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    prompts = [{"prompt_token_ids": tok.encode(p).ids} for p in PROMPTS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


ARCHITECTURES = {"llama_tiny": "LlamaForCausalLM", "qwen2_tiny": "Qwen2ForCausalLM",
                 "mistral_tiny": "LlamaForCausalLM", "mixtral_tiny": "MixtralForCausalLM"}


@pytest.mark.parametrize("fixture", sorted(ARCHITECTURES))
def test_float32_gguf_serves_like_safetensors(request, tmp_path, fixture):
    """Mistral is written as llama.cpp does (general.architecture "llama"), Mixtral as "llama" with
    experts (stacked ``ffn_*_exps``)."""
    folder = request.getfixturevalue(fixture)
    path = write_gguf(folder, tmp_path / f"{fixture}.gguf")
    reference = _llm(folder)
    llm = _llm(path)
    assert llm.config.model.architecture == ARCHITECTURES[fixture]
    assert _token_outputs(llm, folder) == _token_outputs(reference, folder)
    if fixture == "llama_tiny":  # text prompts and chat: the same tokenizer on both sides
        assert _outputs(llm) == _outputs(reference)


def _dequantized_folder(src, dst, qtype_name: str):
    """A safetensors copy of ``src`` whose 2-D weights went through ``qtype_name`` and back (the
    gguf package's own quantize / dequantize, llama.cpp's Q/K permutation on the way)."""
    import gguf
    from safetensors.numpy import load_file, save_file

    dst.mkdir()
    for file in src.iterdir():
        if file.name != "model.safetensors":
            shutil.copy(file, dst / file.name)
    qtype = gguf.GGMLQuantizationType[qtype_name]
    heads, kv_heads = 4, 2  # llama-tiny
    out = {}
    for name, value in load_file(str(src / "model.safetensors")).items():
        value = value.astype(np.float32)
        if value.ndim == 2:
            n = heads if ".q_proj." in name else kv_heads if ".k_proj." in name else None
            stored = permute_qk(value, n) if n else value
            stored = gguf.quants.dequantize(gguf.quants.quantize(stored, qtype), qtype).astype(np.float32)
            if n:  # undo the permutation: permute's inverse is reshape(n, d/2, 2) -> swap
                shape = stored.shape
                stored = stored.reshape(n, shape[0] // n // 2, 2, shape[1]).swapaxes(1, 2).reshape(shape)
            value = stored
        out[name] = np.ascontiguousarray(value)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_quantized_gguf_serves_like_its_dequantized_weights(llama_tiny, tmp_path, qtype):
    path = write_gguf(llama_tiny, tmp_path / f"llama-{qtype}.gguf", tensor_type=qtype)
    reference = _dequantized_folder(llama_tiny, tmp_path / "dequantized", qtype)
    assert _outputs(_llm(path)) == _outputs(_llm(reference))


def _gguf_with_a_coarser_tokenizer(folder, path):
    """``folder``'s weights in a GGUF whose embedded tokenizer keeps only the first 100 merges (the
    same vocabulary, other ids for every prompt here), so which tokenizer served is observable."""
    data = json.loads((folder / "tokenizer.json").read_text())
    data["model"]["merges"] = data["model"]["merges"][:100]
    path = write_gguf(folder, path, tokenizer_json=data)
    assert all(a != b for a, b in zip(_encodings(path), _encodings(folder)))
    return path


def _encodings(path_or_folder) -> list[list[int]]:
    from tokenizers import Tokenizer

    from gridserve.shared.gguf_tokenizer import tokenizer_from_gguf

    path = str(path_or_folder)
    tok = tokenizer_from_gguf(path).tokenizer if path.endswith(".gguf") else Tokenizer.from_file(
        str(path_or_folder / "tokenizer.json"))
    return [tok.encode(p).ids for p in PROMPTS]


def test_tokenizer_override_and_int8(llama_tiny, tmp_path):
    """``LLM(model=....gguf, tokenizer=FOLDER)`` encodes with the folder's tokenizer, not the file's."""
    path = _gguf_with_a_coarser_tokenizer(llama_tiny, tmp_path / "llama.gguf")
    folder_ids = _encodings(llama_tiny)
    llm = _llm(path, tokenizer=str(llama_tiny))
    assert llm.config.model.tokenizer_path == str(llama_tiny)
    assert llm.get_tokenizer().name_or_path == str(llama_tiny)
    assert [llm.get_tokenizer().encode(p) for p in PROMPTS] == folder_ids
    assert _outputs(llm) == _outputs(_llm(llama_tiny))
    assert [o.prompt_token_ids for o in _llm(path).generate(PROMPTS, GREEDY, use_tqdm=False)] == _encodings(path)
    int8 = _llm(path, tokenizer=str(llama_tiny), quantization="int8")
    assert _outputs(int8) == _outputs(_llm(llama_tiny, quantization="int8"))


def test_tokenizer_flag_reaches_the_engine_config(llama_tiny, tmp_path):
    """``gridserve serve x.gguf --tokenizer F`` forwards the flag to its engine, and ``gridserve
    engine --tokenizer F`` (or ``GRIDSERVE_TOKENIZER``) makes F the tokenizer the engine reports."""
    from gridserve.cli import _parser
    from gridserve.roles import engine_argv, engine_config

    path = write_gguf(llama_tiny, tmp_path / "llama.gguf")
    serve = _parser().parse_args(["serve", str(path), "--tokenizer", str(llama_tiny)])
    argv = engine_argv(serve)
    assert argv[argv.index("--tokenizer") + 1] == str(llama_tiny)
    engine = _parser().parse_args(["engine", "--model", str(path), "--workers", "127.0.0.1:1", *argv])
    config = engine_config(engine, ["127.0.0.1:1"])
    assert config.model.tokenizer_path == str(llama_tiny)
    assert config.model.architecture == "LlamaForCausalLM" and config.model.model_path == str(path)


def test_tokenizer_flag_through_the_services(llama_tiny, tmp_path):
    """``gridserve serve x.gguf --tokenizer FOLDER``'s processes: the gateway tokenizes with the
    folder's tokenizer (not the file's coarser one) and text requests answer as the in-process LLM on
    the safetensors folder."""
    import grpc

    from gridserve.api.gateway.v1 import gateway_pb2
    from gridserve.cli import _parser
    from gridserve.roles import engine_argv
    from tests.integration.services import (
        ENGINE_ARGS,
        address,
        deployment,
        gateway_stub,
        greedy,
        stream_tokens,
    )

    path = _gguf_with_a_coarser_tokenizer(llama_tiny, tmp_path / "llama.gguf")
    folder_ids, embedded_ids = _encodings(llama_tiny), _encodings(path)
    args = _parser().parse_args(["serve", str(path), "--tokenizer", str(llama_tiny), *ENGINE_ARGS])
    expected = [o.outputs[0] for o in _llm(llama_tiny).generate(
        PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8, min_tokens=8), use_tqdm=False)]
    with deployment(path, tmp_path / "logs", engine_args=engine_argv(args)) as launcher:
        with grpc.insecure_channel(address(launcher, "gateway")) as channel:
            stub = gateway_stub(channel)
            for prompt, want, embedded in zip(PROMPTS, folder_ids, embedded_ids):
                got = list(stub.Tokenize(gateway_pb2.TokenizeRequest(text=prompt), timeout=30).token_ids)
                assert got == want != embedded, prompt
            for prompt, want in zip(PROMPTS, expected):
                ids, text, _ = stream_tokens(stub, gateway_pb2.GenerateRequest(text=prompt, sampling_params=greedy(8)))
                assert ids == list(want.token_ids) and text == want.text


def test_gguf_through_the_services(llama_tiny, tmp_path):
    """``gridserve serve model.gguf``'s processes: the engine reads the config from the file, the
    worker its tensors, the gateway (no torch) its tokenizer and chat template; text and chat
    requests answer as the in-process LLM on the safetensors folder."""
    import grpc

    from gridserve.api.common.v1 import common_pb2
    from gridserve.api.gateway.v1 import gateway_pb2
    from tests.integration.services import address, deployment, gateway_stub, greedy, stream_tokens

    path = write_gguf(llama_tiny, tmp_path / "llama.gguf")
    reference = _llm(llama_tiny)
    expected = [o.outputs[0] for o in reference.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8,
                                                                                       min_tokens=8), use_tqdm=False)]
    chat = reference.chat(MESSAGES[0], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    with deployment(path, tmp_path / "logs") as launcher:
        with grpc.insecure_channel(address(launcher, "gateway")) as channel:
            stub = gateway_stub(channel)
            for prompt, want in zip(PROMPTS, expected):
                ids, text, _ = stream_tokens(stub, gateway_pb2.GenerateRequest(text=prompt, sampling_params=greedy(8)))
                assert ids == list(want.token_ids) and text == want.text
            reply = stub.Chat(gateway_pb2.ChatRequest(
                messages=[gateway_pb2.ChatMessage(**m) for m in MESSAGES[0]],
                sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=8)), timeout=60)
            assert reply.message.content == chat.text


def test_structured_output_with_the_embedded_tokenizer(llama_tiny, tmp_path):
    """The worker's grammar masks come from the GGUF's converted tokenizer: the same constrained
    outputs as the safetensors folder's."""
    import re

    from gridserve.shared.sampling_params import StructuredOutputsParams

    path = write_gguf(llama_tiny, tmp_path / "llama.gguf")
    regex = r"[A-Z][a-z]{2,5}-[0-9]{3}"
    params = [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(**spec))
              for spec in ({"regex": regex}, {"choice": ["red", "green", "héllo wörld"]}, {"json_object": True})]
    prompts = ["Describe a user as JSON:"] * len(params)
    got = [o.outputs[0] for o in _llm(path).generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0] for o in _llm(llama_tiny).generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert re.fullmatch(regex, got[0].text) and got[1].text in ("red", "green", "héllo wörld")


def test_qwen3_gguf_serves_like_safetensors(tmp_path):
    """Qwen3's per-head Q/K norms (``attn_q_norm`` / ``attn_k_norm``) and a head size that is not
    hidden / heads (``attention.key_length``); no Q/K row permutation (llama.cpp permutes only llama)."""
    from tests.zoo import zoo_checkpoint

    folder = zoo_checkpoint("qwen3-gguf", "Qwen3Config", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                            tie_word_embeddings=False)
    path = write_gguf(folder, tmp_path / "qwen3.gguf")
    llm = _llm(path)
    assert llm.config.model.architecture == "Qwen3ForCausalLM"
    assert _token_outputs(llm, folder) == _token_outputs(_llm(folder), folder)
