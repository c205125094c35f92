"""gridserve.demo.corpus: the demo model's stdlib corpus and its fixed held-out split."""

from __future__ import annotations

import hashlib
from pathlib import Path

from gridserve.demo import corpus


def test_heldout_split_is_disjoint_and_covers_the_corpus() -> None:
    train = {p.resolve() for p in corpus.train_files()}
    heldout = {p.resolve() for p in corpus.heldout_files()}
    assert train and heldout
    assert not train & heldout
    assert train | heldout == {p.resolve() for p in corpus.corpus_files()}


def test_heldout_rule_is_the_hash_of_the_relative_path() -> None:
    root = corpus.stdlib_dir()
    for path in corpus.corpus_files():
        name = path.relative_to(root).as_posix()
        digest = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")
        assert corpus.is_heldout(name) == (digest % corpus.HELDOUT_MODULUS == 0), name
    share = len(corpus.heldout_files()) / len(corpus.corpus_files())
    assert 0.02 < share < 0.1, share


def test_split_does_not_depend_on_file_order_or_location(tmp_path: Path) -> None:
    """The same relative names under another root fall on the same side of the split."""
    names = [corpus.relative_name(p) for p in corpus.corpus_files()[:40]]
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    moved = {p.relative_to(tmp_path).as_posix() for p in corpus.heldout_files(tmp_path)}
    assert moved == {n for n in names if corpus.is_heldout(n)}


def test_corpus_leaves_out_test_suites_and_codec_tables() -> None:
    root = corpus.stdlib_dir()
    parts = [set(p.relative_to(root).parts) for p in corpus.corpus_files()]
    assert not any(part & corpus.EXCLUDED_PARTS for part in parts)
    assert any(p.relative_to(root).as_posix() == "pydoc_data/topics.py" for p in corpus.corpus_files())


def test_documents_start_with_bos() -> None:
    from tokenizers import Tokenizer

    from gridserve.demo import recipe

    tok = Tokenizer.from_file(str(recipe.ensure_tokenizer(4096) / "tokenizer.json"))
    files = corpus.heldout_files()[:3]
    docs = corpus.encode_documents(tok, files, recipe.BOS_ID)
    assert [d[0] for d in docs] == [recipe.BOS_ID] * len(files)
    assert tok.decode(docs[0][1:]) == corpus.read_text(files[0])
