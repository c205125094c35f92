"""gridserve.demo.recipe: deterministic tiny HF checkpoints, their tokenizer, the cache and the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gridserve.demo import recipe  # noqa: E402

TINY_FIXTURES = ["llama_tiny", "opt_tiny", "qwen2_tiny", "mistral_tiny"]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hi."},
]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != recipe.MARKER}


def _tokenizer(folder: Path):
    return transformers.AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture
def seeded_cache(tmp_path: Path, llama_tiny: Path) -> Path:
    """A fresh cache folder holding a copy of the already trained 4096-token tokenizer."""
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copytree(recipe.ensure_tokenizer(4096), cache / "tokenizer-4096")
    return cache


def test_special_token_ids(llama_tiny: Path) -> None:
    tok = _tokenizer(llama_tiny)
    expected = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "<|im_start|>": 4, "<|im_end|>": 5}
    assert {t: tok.convert_tokens_to_ids(t) for t in expected} == expected
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 3)
    assert {4, 5} <= set(tok.all_special_ids)
    assert (recipe.BOS_ID, recipe.EOS_ID, recipe.PAD_ID) == (1, 2, 3)


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "  leading spaces, trailing tabs\t\n",
        "def f(x):\n    return x ** 2  # comment\n",
        "naïve café — Grüße, 你好, こんにちは, 🤖🚀",
        "",
    ],
)
def test_tokenizer_round_trips_text(llama_tiny: Path, text: str) -> None:
    tok = _tokenizer(llama_tiny)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(i >= len(recipe.SPECIAL_TOKENS) for i in ids)  # plain text: no special tokens


def test_tokenizer_adds_no_bos_or_eos(llama_tiny: Path) -> None:
    tok = _tokenizer(llama_tiny)
    ids = tok("hello there")["input_ids"]
    assert ids and ids[0] != recipe.BOS_ID and ids[-1] != recipe.EOS_ID
    assert tok.encode("hello there") == ids
    assert tok.encode("<|im_start|>user")[0] == recipe.IM_START_ID


def test_chat_template_ends_with_generation_prompt(llama_tiny: Path) -> None:
    tok = _tokenizer(llama_tiny)
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert prompt == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nSay hi.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tok.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)
    assert without.endswith("Say hi.<|im_end|>\n")
    ids = tok.encode(prompt)
    assert ids[0] == recipe.IM_START_ID and ids.count(recipe.IM_END_ID) == 2


@pytest.mark.parametrize("fixture", TINY_FIXTURES)
def test_loads_offline_with_auto_classes(
    fixture: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    folder: Path = request.getfixturevalue(fixture)
    arch = fixture.split("_")[0]
    assert folder.name == f"{arch}-tiny"
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", recipe.MARKER):
        assert (folder / name).is_file(), name

    tok = _tokenizer(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    config = model.config
    assert config.model_type == arch
    assert config.vocab_size == len(tok) == 4096
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 3)
    gen = model.generation_config
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (1, 2, 3)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert config.tie_word_embeddings == (arch in ("qwen2", "opt"))
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode("hello world")])).logits
    assert logits.shape[-1] == config.vocab_size and torch.isfinite(logits).all()


@pytest.mark.parametrize("fixture", TINY_FIXTURES)
def test_greedy_output_is_varied_and_logits_spread(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    folder: Path = request.getfixturevalue(fixture)
    tok = _tokenizer(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    ids = torch.tensor([tok.encode("Hello, my name is")])
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=recipe.PAD_ID
        )
        logits = model(out).logits[0]
    new = out[0, ids.shape[1]:].tolist()
    assert len(new) == 20 and len(set(new)) >= 5, new
    assert logits.std(dim=-1).min() > 1.0  # not near-uniform
    top2 = logits.log_softmax(-1).topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.1  # top logprobs separated


def test_build_is_deterministic(tmp_path: Path, llama_tiny: Path) -> None:
    tok_dir = recipe.ensure_tokenizer(4096)
    a = recipe.build_checkpoint(tmp_path / "a", "llama", "tiny", tokenizer_dir=tok_dir)
    b = recipe.build_checkpoint(tmp_path / "b", "llama", "tiny", tokenizer_dir=tok_dir)
    assert a == tmp_path / "a"
    files_a = _files(a)
    assert {"config.json", "model.safetensors", "generation_config.json",
            "tokenizer.json", "tokenizer_config.json"} <= set(files_a)
    assert files_a == _files(b)
    assert files_a == _files(llama_tiny)  # the cached folder is the same build


def test_llava_build_is_deterministic_with_its_processor(tmp_path: Path, llava_tiny: Path) -> None:
    tok_dir = recipe.ensure_tokenizer(4096)
    built = recipe.build_checkpoint(tmp_path / "a", "llava", "tiny", tokenizer_dir=tok_dir)
    files = _files(built)
    assert {"preprocessor_config.json", "processor_config.json", "chat_template.jinja"} <= set(files)
    assert files == _files(llava_tiny)
    config = json.loads((built / "config.json").read_text())
    tokenizer = json.loads((built / "tokenizer.json").read_text())
    image = next(t for t in tokenizer["added_tokens"] if t["content"] == "<image>")
    assert config["image_token_index"] == image["id"] < config["text_config"]["vocab_size"]
    assert config["image_seq_length"] == (30 // 6) ** 2


def test_tokenizer_training_is_deterministic(tmp_path: Path, llama_tiny: Path) -> None:
    recipe.build_tokenizer(tmp_path, 4096)
    cached = recipe.ensure_tokenizer(4096)
    assert (tmp_path / "tokenizer.json").read_bytes() == (cached / "tokenizer.json").read_bytes()
    assert (tmp_path / "tokenizer.json").read_bytes() == (llama_tiny / "tokenizer.json").read_bytes()


def test_ensure_checkpoint_caches_and_rebuilds_on_recipe_change(
    seeded_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    real_build = recipe.build_checkpoint

    def counting_build(out_dir: Path, arch: str, size: str, **kwargs) -> Path:
        calls.append(out_dir)
        return real_build(out_dir, arch, size, **kwargs)

    monkeypatch.setattr(recipe, "build_checkpoint", counting_build)
    path = recipe.ensure_checkpoint("opt", "tiny", cache_dir=seeded_cache)
    assert path == seeded_cache / "opt-tiny"
    assert len(calls) == 1 and calls[0].parent == seeded_cache and calls[0] != path
    marker = json.loads((path / recipe.MARKER).read_text())
    assert marker["recipe"] == recipe.RECIPE_VERSION
    assert {k: marker[k] for k in recipe.fingerprint()} == recipe.fingerprint()
    assert (marker["arch"], marker["size"]) == ("opt", "tiny")
    # Only finished folders (and lock files) are left in the cache.
    assert sorted(p.name for p in seeded_cache.iterdir() if p.is_dir()) == [
        "opt-tiny", "tokenizer-4096"
    ]

    assert recipe.ensure_checkpoint("opt", "tiny", cache_dir=seeded_cache) == path
    assert len(calls) == 1  # cached

    (path / recipe.MARKER).write_text(json.dumps({"recipe": "old"}))
    before = _files(path)
    assert recipe.ensure_checkpoint("opt", "tiny", cache_dir=seeded_cache) == path
    assert len(calls) == 2  # stale recipe version: rebuilt
    assert _files(path) == before
    assert json.loads((path / recipe.MARKER).read_text())["recipe"] == recipe.RECIPE_VERSION


def test_failed_build_leaves_no_folder(seeded_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_build(out_dir: Path, arch: str, size: str, **kwargs) -> Path:
        (out_dir / "partial").write_text("x")
        raise RuntimeError("boom")

    monkeypatch.setattr(recipe, "build_checkpoint", failing_build)
    with pytest.raises(RuntimeError, match="boom"):
        recipe.ensure_checkpoint("llama", "tiny", cache_dir=seeded_cache)
    assert sorted(p.name for p in seeded_cache.iterdir() if p.is_dir()) == ["tokenizer-4096"]


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(recipe.CACHE_ENV, str(tmp_path / "models"))
    assert recipe.default_cache_dir() == tmp_path / "models"
    monkeypatch.delenv(recipe.CACHE_ENV)
    assert recipe.default_cache_dir() == Path.home() / ".cache" / "gridserve" / "models"


def test_unknown_recipe_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="known: .*llama/tiny"):
        recipe.ensure_checkpoint("llama", "huge", cache_dir=tmp_path)
    with pytest.raises(ValueError):
        recipe.build_checkpoint(tmp_path / "x", "gpt2", "tiny")
    assert not any(tmp_path.iterdir())


def test_cli_prints_checkpoint_path(seeded_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe.main(["--arch", "qwen2", "--size", "tiny", "--cache-dir", str(seeded_cache)])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == str(seeded_cache / "qwen2-tiny")
    assert (seeded_cache / "qwen2-tiny" / recipe.MARKER).is_file()
