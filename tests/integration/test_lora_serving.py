"""Multi-LoRA serving end to end: worker, engine, gateway and the Envoy edge on loopback, a tiny Llama
from the zoo and random PEFT adapters made here (``LoraConfig(init_lora_weights=False)``: PEFT's
default B = 0 would let any fake pass), driven with the official ``openai`` client.

An adapter named as ``model`` changes the output and gives what ``LLM(enable_lora=True)`` gives
offline; ``/v1/models`` lists it with its ``parent``; an adapter loaded at run time serves, and once
unloaded its name is OpenAI's 404; a bad adapter (rank above the maximum, a missing file, a target
module the model lacks, a path outside ``--lora-dir``) is a 400 naming the field, and nothing is
loaded.
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gridserve.launcher import free_port
from tests.zoo import zoo_checkpoint

from .services import ENGINE_ARGS, KV_BYTES, deployment

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")
peft = pytest.importorskip("peft")

KEY = "lora-test-key"
# The tiny Llama of the worker's LoRA tests (the same zoo entry: one cached checkpoint).
BASE_CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 24, "max_position_embeddings": 512,
               "tie_word_embeddings": False}
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
PROMPT = [5, 17, 300, 41, 2000, 9, 77, 8]
MAX_TOKENS = 8


def _base() -> Path:
    return zoo_checkpoint("lora-llama", "LlamaConfig", **BASE_CONFIG)


def _adapter(base: Path, folder: Path, rank: int, targets: list[str], seed: int, **extra) -> Path:
    """A random PEFT adapter of ``base`` saved as ``save_pretrained`` saves it."""
    import torch
    from transformers import AutoModelForCausalLM

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False, **extra)
    torch.manual_seed(seed)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), config)
    model.save_pretrained(folder)
    return folder


def _renamed(src: Path, out: Path, module: str, other: str) -> Path:
    """``src`` with its ``module`` weights (and target) renamed ``other``: an adapter of another model."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    weights = load_file(out / "adapter_model.safetensors")
    save_file({k.replace(f".{module}.", f".{other}."): v for k, v in weights.items()}, out / "adapter_model.safetensors")
    config = json.loads((out / "adapter_config.json").read_text())
    config["target_modules"] = [other if m == module else m for m in config["target_modules"]]
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    """``sql`` (served from the start), ``chat`` (loaded at run time) and the bad ones, in the
    adapters folder; ``outside``: a good adapter outside it."""
    base = _base()
    root = tmp_path_factory.mktemp("adapters")
    made = {
        "sql": _adapter(base, root / "sql", 8, ATTENTION, seed=1),
        "chat": _adapter(base, root / "chat", 16, ATTENTION + MLP, seed=2, use_rslora=True),
        "big": _adapter(base, root / "big", 32, ATTENTION, seed=3),  # above --max-lora-rank 16
    }
    made["nofile"] = root / "nofile"
    shutil.copytree(made["sql"], made["nofile"])
    (made["nofile"] / "adapter_model.safetensors").unlink()
    made["alien"] = _renamed(made["sql"], root / "alien", "q_proj", "c_attn")  # GPT-2's: this Llama has none
    made["outside"] = tmp_path_factory.mktemp("elsewhere") / "sql"
    shutil.copytree(made["sql"], made["outside"])
    made["root"] = root
    return made


@pytest.fixture(scope="module")
def stack(adapters, tmp_path_factory):
    engine_args = [*ENGINE_ARGS, "--enable-lora", "--lora-modules", f"sql={adapters['sql']}", "--max-loras", "2",
                   "--max-lora-rank", "16", "--lora-dir", str(adapters["root"]), "--allow-runtime-lora-updating"]
    with deployment(_base(), tmp_path_factory.mktemp("logs"), edge_port=free_port(), engine_args=engine_args,
                    api_key=KEY, served_model_name="base") as launcher:
        yield launcher


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=f"http://{stack.edge_address}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def _post(stack, path: str, body: dict, key: str = KEY) -> tuple[int, str, str]:
    """Status, content type and body of a POST through the edge."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(f"http://{stack.edge_address}{path}", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.headers.get("content-type", ""), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("content-type", ""), exc.read().decode()


def _complete(client, model: str) -> str:
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                      extra_body={"min_tokens": MAX_TOKENS})
    assert reply.model == model
    return reply.choices[0].text


def _offline(adapters: dict[str, Path]) -> dict[str, str]:
    """The base model's (``"base"``) and each adapter's greedy text, offline (``LLM(enable_lora=True)``)."""
    from gridserve import LLM, LoRARequest, SamplingParams

    llm = LLM(model=str(_base()), kv_cache_memory_bytes=KV_BYTES, enable_lora=True, max_loras=2, max_lora_rank=16)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
        names = ["base", *adapters]
        loras = [None] + [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())]
        outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(names), params, use_tqdm=False, lora_request=loras)
    finally:
        llm.shutdown()
    return {name: out.outputs[0].text for name, out in zip(names, outs)}


@pytest.fixture(scope="module")
def offline(adapters) -> dict[str, str]:
    return _offline({"sql": adapters["sql"], "chat": adapters["chat"]})


def test_models_lists_the_served_adapter_after_the_base_model(client, adapters):
    cards = client.models.list().data
    assert [c.id for c in cards][:2] == ["base", "sql"]
    assert cards[0].model_extra.get("parent") is None
    assert cards[1].owned_by == "gridserve" and cards[1].model_extra["parent"] == "base"
    assert Path(cards[1].model_extra["root"]).resolve() == adapters["sql"].resolve()


def test_an_adapter_named_as_model_changes_the_output_and_equals_offline(client, offline):
    base, sql = _complete(client, "base"), _complete(client, "sql")
    assert sql != base
    assert {"base": base, "sql": sql} == {k: offline[k] for k in ("base", "sql")}
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0.0, stream=True)
    chunks = list(chat)
    assert chunks and all(c.model == "sql" for c in chunks)


def test_load_use_unload_then_the_name_is_openais_404(stack, client, adapters, offline):
    status, kind, text = _post(stack, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(adapters["chat"])})
    assert (status, text) == (200, "Success: LoRA adapter 'chat' added successfully."), text
    assert kind.startswith("text/plain")
    assert "chat" in [c.id for c in client.models.list().data]
    base, chat = _complete(client, "base"), _complete(client, "chat")
    assert chat != base and chat != _complete(client, "sql") and chat == offline["chat"]
    status, _, text = _post(stack, "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert (status, text) == (200, "Success: LoRA adapter 'chat' removed successfully."), text
    with pytest.raises(openai.NotFoundError) as gone:
        _complete(client, "chat")
    assert gone.value.response.json() == {"error": {"message": "The model `chat` does not exist.",
                                                    "type": "NotFoundError", "param": "model", "code": 404}}
    status, _, text = _post(stack, "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert status == 404 and json.loads(text)["error"]["type"] == "NotFoundError"


@pytest.mark.parametrize("name, field, words", [
    ("big", "adapter_config.r", "max_lora_rank=16"),
    ("nofile", "lora_path", "adapter_model.safetensors"),
    ("alien", "adapter_config.target_modules", "c_attn"),
    ("outside", "lora_path", "--lora-dir"),
])
def test_a_bad_adapter_is_400_naming_the_field_and_nothing_is_loaded(stack, client, adapters, name, field, words):
    status, _, text = _post(stack, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapters[name])})
    error = json.loads(text)["error"]
    assert (status, error["code"], error["type"], error["param"]) == (400, 400, "BadRequestError", field), text
    assert error["message"].startswith(f"{field}: ") and words in error["message"], error
    assert name not in [c.id for c in client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        _complete(client, name)


def test_the_load_routes_need_the_key_and_check_the_body(stack):
    status, _, text = _post(stack, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "x"}, key="")
    assert status == 401 and json.loads(text)["error"]["type"] == "AuthenticationError"
    status, _, text = _post(stack, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": 5})
    assert status == 400 and json.loads(text)["error"]["param"] == "lora_path"
    status, _, text = _post(stack, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "sql"})
    assert status == 400 and "already been loaded" in json.loads(text)["error"]["message"]


def test_the_engines_lora_metric_reaches_the_edge(stack, client):
    _complete(client, "sql")
    with urllib.request.urlopen(f"http://{stack.edge_address}/metrics", timeout=30) as response:
        text = response.read().decode()
    assert "vllm:lora_requests_info" in text


def test_with_two_engines_a_load_reaches_both_and_a_bad_adapter_neither(adapters, tmp_path_factory):
    """Data parallel: every engine loads every adapter (requests pinned to each engine use it), and
    a bad adapter is loaded on none."""
    engine_args = [*ENGINE_ARGS, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                   "--lora-dir", str(adapters["root"]), "--allow-runtime-lora-updating"]
    with deployment(_base(), tmp_path_factory.mktemp("dp-logs"), edge_port=free_port(), engine_args=engine_args,
                    api_key=KEY, served_model_name="base", data_parallel_size=2) as stack:
        with openai.OpenAI(base_url=f"http://{stack.edge_address}/v1", api_key=KEY, max_retries=0,
                           timeout=120) as client:
            status, _, text = _post(stack, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "sql"})
            assert status == 200, text
            texts = {client.completions.create(model="sql", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                               extra_body={"min_tokens": MAX_TOKENS, "data_parallel_rank": rank}
                                               ).choices[0].text for rank in (0, 1)}
            assert len(texts) == 1 and texts != {_complete(client, "base")}
            status, _, text = _post(stack, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": "big"})
            assert status == 400 and json.loads(text)["error"]["param"] == "adapter_config.r"
            assert [c.id for c in client.models.list().data] == ["base", "sql"]
