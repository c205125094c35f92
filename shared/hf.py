"""Finding Hugging Face checkpoints on disk or in the hub cache (no torch)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

from gridserve.shared.errors import ModelNotFoundError
from gridserve.shared.gguf_config import is_gguf

logger = logging.getLogger(__name__)


def resolve_model_path(model: str, revision: Optional[str] = None) -> Path:
    """Return the local folder of ``model``: a path on disk, or a hub id fetched or found in the cache.

    A ``.gguf`` file is returned as itself (its metadata stands in for config.json).

    Offline (no network, or ``HF_HUB_OFFLINE=1``), a hub id resolves only from the local cache;
    otherwise ``ModelNotFoundError`` names the id and where it looked.
    """
    path = Path(model).expanduser()
    if path.is_file() and is_gguf(path):  # a single-file GGUF checkpoint (shared/gguf_config.py)
        return path.resolve()
    if is_gguf(model) and not path.exists():
        raise ModelNotFoundError(f"GGUF file {model!r} does not exist")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model folder {str(path)!r} has no config.json")
        return path.resolve()
    looks_like_path = model.startswith(("/", ".", "~")) or os.sep in model.strip("/").split("/", 1)[-1]
    if looks_like_path or model.count("/") > 1:
        raise ModelNotFoundError(f"model path {model!r} does not exist")
    return _from_hub(model, revision)


def _from_hub(repo_id: str, revision: Optional[str]) -> Path:
    from huggingface_hub import constants, snapshot_download

    patterns = ["*.json", "*.safetensors", "*.bin", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True, allow_patterns=patterns))
    except Exception:  # noqa: BLE001 - not cached: try the network below
        pass
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local folder and is not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); the hub is offline (HF_HUB_OFFLINE=1)"
        )
    try:
        logger.info("downloading %s from the Hugging Face hub", repo_id)
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, etag_timeout=5))
    except Exception as exc:  # noqa: BLE001 - report every hub failure the same way, with its cause
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local folder (looked for {str(Path(repo_id).resolve())!r}) "
            f"and could not be fetched from the Hugging Face hub into {constants.HF_HUB_CACHE}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
