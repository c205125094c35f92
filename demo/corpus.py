"""The demo model's text: Python's own standard library, split into training and held-out files.

Every machine that runs gridserve has it offline: the stdlib ``*.py`` sources (docstrings and
comments are English prose about the code) and ``pydoc_data/topics.py`` (the language reference's
topics as text). Test suites (``test/``, ``tests/``, ``idle_test/``), ``site-packages`` and
``__pycache__`` are left out, and so are the ``encodings/`` codec tables: they are large,
repetitive and not what a newcomer prompts with.

Split
    A file is **held out** when the SHA-256 of its path relative to the stdlib folder (POSIX
    form, e.g. ``json/decoder.py``) is 0 modulo :data:`HELDOUT_MODULUS`, so the split is fixed by
    the file's name alone: the same on every machine with the same Python, independent of file
    order, sizes or contents, and a file never moves between the two sides. Training never reads
    a held-out file; :func:`heldout_files` is the default input of ``gridserve eval perplexity``.

Documents
    A file becomes one document: ``<s>`` (BOS) followed by its BPE tokens (the tokenizer adds no
    BOS by itself). The trainer packs documents into one stream; the evaluator scores each file on
    its own.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: One file in this many is held out (about 5%).
HELDOUT_MODULUS = 20
#: Path parts that exclude a file from the corpus.
EXCLUDED_PARTS = frozenset({"test", "tests", "idle_test", "encodings", "site-packages", "dist-packages",
                            "__pycache__"})


def stdlib_dir() -> Path:
    """The running Python's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def relative_name(path: Path, root: Path | None = None) -> str:
    """``path`` relative to the stdlib folder (POSIX form); the key of the split."""
    root = root if root is not None else stdlib_dir()
    return Path(path).resolve().relative_to(root.resolve()).as_posix()


def is_heldout(name: str) -> bool:
    """True when the file with stdlib-relative ``name`` is held out (see the module docstring)."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_MODULUS == 0


def corpus_files(root: Path | None = None) -> list[Path]:
    """Every corpus file under ``root`` (the stdlib by default), sorted by relative name."""
    return list(_listing(root if root is not None else stdlib_dir()))


@functools.lru_cache(maxsize=4)
def _listing(root: Path) -> tuple[Path, ...]:
    files = [
        path for path in root.rglob("*.py")
        if path.is_file() and not EXCLUDED_PARTS.intersection(path.relative_to(root).parts)
    ]
    if not files:
        raise RuntimeError(f"no *.py files under the folder {root}")
    return tuple(sorted(files, key=lambda p: p.relative_to(root).as_posix()))


def train_files(root: Path | None = None) -> list[Path]:
    """The files the demo model trains on (sorted)."""
    root = root if root is not None else stdlib_dir()
    return [p for p in corpus_files(root) if not is_heldout(p.relative_to(root).as_posix())]


def heldout_files(root: Path | None = None) -> list[Path]:
    """The files kept apart for evaluation (sorted)."""
    root = root if root is not None else stdlib_dir()
    return [p for p in corpus_files(root) if is_heldout(p.relative_to(root).as_posix())]


def read_text(path: Path) -> str:
    """A file's text (undecodable bytes dropped, as the tokenizer's training does)."""
    return Path(path).read_text(encoding="utf-8", errors="ignore")


def encode_documents(tokenizer: Any, files: Sequence[Path], bos_id: int | None) -> list[list[int]]:
    """Each file as one document: ``[bos_id] + tokens`` (no BOS when ``bos_id`` is None; empty
    files are skipped).

    ``tokenizer`` is a ``tokenizers.Tokenizer`` or a transformers fast tokenizer (no special
    tokens are added by either: BOS is put in here).
    """
    texts = [text for text in (read_text(p) for p in files) if text]
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if hasattr(backend, "encode_batch"):
        ids = [enc.ids for enc in backend.encode_batch(texts, add_special_tokens=False)]
    else:  # a slow (pure Python) transformers tokenizer
        ids = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    bos = [] if bos_id is None else [bos_id]
    docs = [[*bos, *row] for row in ids]
    logger.debug("encoded %d files into %d tokens", len(docs), sum(len(d) for d in docs))
    return docs
