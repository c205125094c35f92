"""The trained demo model (tiny configuration): deterministic training that learns, saved as a normal
HF Llama folder, and ``gridserve eval perplexity`` matching transformers on the same tokens."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gridserve.demo import corpus, recipe, train  # noqa: E402
from gridserve.evals import perplexity  # noqa: E402
from gridserve.shared.errors import InvalidArgumentError  # noqa: E402

# A few dozen steps of a ~0.6M-parameter Llama on four stdlib files: seconds on two cores.
TINY = train.TrainConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         seq_len=64, batch_size=4, steps=40, lr=3e-3, warmup_steps=5, max_files=4)


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    return recipe.ensure_tokenizer(TINY.vocab_size)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("demo") / "tiny"
    return train.build_atomically(out, TINY, tokenizer_dir=tokenizer_dir, progress=False)


def test_same_seed_gives_bit_identical_weights(tokenizer_dir: Path) -> None:
    config = train.TrainConfig(**{**TINY.__dict__, "steps": 6})
    first = train.train(tokenizer_dir, config, progress=False)
    second = train.train(tokenizer_dir, config, progress=False)
    a, b = first.model.state_dict(), second.model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert first.losses == second.losses
    other = train.train(tokenizer_dir, train.TrainConfig(**{**config.__dict__, "seed": 1}), progress=False)
    assert not torch.equal(other.model.state_dict()["model.embed_tokens.weight"], a["model.embed_tokens.weight"])


def test_training_reads_only_training_files(monkeypatch: pytest.MonkeyPatch, tokenizer_dir: Path) -> None:
    read: list[Path] = []
    original = corpus.read_text
    monkeypatch.setattr(corpus, "read_text", lambda p: read.append(Path(p)) or original(p))
    train.training_stream(tokenizer_dir, train.TrainConfig(max_files=30))
    heldout = {p.resolve() for p in corpus.heldout_files()}
    assert len(read) == 30 and not {p.resolve() for p in read} & heldout


def test_loss_decreases(tiny_model: Path) -> None:
    info = json.loads((tiny_model / train.TRAINING_INFO).read_text())
    losses = info["losses"]
    assert len(losses) == TINY.steps
    assert math.log(TINY.vocab_size) - 0.5 < losses[0] < math.log(TINY.vocab_size) + 1.0
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses
    assert info["num_parameters"] == sum(
        p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model)).parameters())


def test_saved_folder_is_a_normal_hf_llama(tiny_model: Path) -> None:
    names = {p.name for p in tiny_model.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", recipe.MARKER, train.TRAINING_INFO} <= names
    config = transformers.AutoConfig.from_pretrained(str(tiny_model))
    assert config.architectures == ["LlamaForCausalLM"] and config.hidden_size == TINY.hidden_size
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_model))
    assert (tok.bos_token_id, tok.eos_token_id) == (recipe.BOS_ID, recipe.EOS_ID)
    assert not list(tiny_model.parent.glob(".tiny.tmp-*"))


def test_cached_model_is_reused_until_forced(tmp_path: Path, tokenizer_dir: Path) -> None:
    import shutil

    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copytree(tokenizer_dir, cache / tokenizer_dir.name)
    config = train.TrainConfig(**{**TINY.__dict__, "steps": 2})
    folder = train.ensure_demo_model(cache, config=config, progress=False)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert train.ensure_demo_model(cache, config=config, progress=False) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    train.ensure_demo_model(cache, config=config, force=True, progress=False)
    assert (folder / "model.safetensors").stat().st_mtime_ns != stamp


def test_windows_score_every_token_once() -> None:
    for n, ctx, stride in [(1, 8, 4), (2, 8, 4), (8, 8, 4), (9, 8, 4), (37, 8, 3), (100, 16, 15)]:
        scored = [t for w in perplexity.windows(0, n, ctx, stride) for t in range(w.first, w.end)]
        assert scored == list(range(1, n))
        for w in perplexity.windows(0, n, ctx, stride):
            assert w.end - w.start <= ctx and w.start < w.first


@pytest.mark.slow
def test_perplexity_matches_transformers_exp_mean_nll(tiny_model: Path) -> None:
    files = corpus.heldout_files()[:3]
    kwargs = {"context_len": 64, "stride": 32}
    ours = perplexity.evaluate(tiny_model, files, **kwargs)
    ref = perplexity.evaluate(tiny_model, files, backend="transformers", **kwargs)
    assert ours.num_tokens == ref.num_tokens
    assert ours.num_tokens == sum(len(d) - 1 for d in perplexity.load_documents(tiny_model, files))
    assert ours.perplexity == pytest.approx(ref.perplexity, rel=1e-3)
    # Independently: exp(mean NLL) from transformers' own loss on each window's new targets.
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model)).eval()
    docs = perplexity.load_documents(tiny_model, files)
    nll, count = 0.0, 0
    with torch.inference_mode():
        for w in [w for i, d in enumerate(docs) for w in perplexity.windows(i, len(d), 64, 32)]:
            ids = torch.tensor([docs[w.doc][w.start:w.end]])
            labels = ids.clone()
            labels[:, : w.first - w.start] = -100
            n = w.end - w.first
            nll += model(input_ids=ids, labels=labels).loss.item() * n
            count += n
    assert ours.perplexity == pytest.approx(math.exp(nll / count), rel=1e-3)
    assert ours.perplexity < TINY.vocab_size  # trained: better than uniform


def test_bad_arguments_name_the_field(tiny_model: Path) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        perplexity.evaluate(tiny_model, context_len=64, stride=64)
    assert err.value.field == "stride"
    with pytest.raises(InvalidArgumentError) as err:
        perplexity.evaluate(tiny_model, [tiny_model / "missing.py"])
    assert err.value.field == "files"
    with pytest.raises(InvalidArgumentError) as err:
        perplexity.evaluate(tiny_model.parent, corpus.heldout_files()[:1])
    assert err.value.field == "model"


@pytest.mark.slow
def test_eval_perplexity_cli(tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from gridserve.cli import main

    out = tmp_path / "ppl.json"
    files = [str(p) for p in corpus.heldout_files()[:2]]
    assert main(["eval", "perplexity", str(tiny_model), *files, "--context-len", "64",
                 "--compare-transformers", "--output-json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "gridserve: perplexity" in printed and "transformers: perplexity" in printed
    report = json.loads(out.read_text())
    a, b = (r["perplexity"] for r in report["results"])
    assert a == pytest.approx(b, rel=1e-3)
    assert main(["eval", "perplexity", str(tiny_model), files[0], "--stride", "0"]) == 2
