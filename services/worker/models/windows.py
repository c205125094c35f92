"""Sliding windows as every decoder family reads them: checked, dropped where no sequence can
outgrow them, and announced at start.

A window layer is masked to its window in every attention path, but the KV cache still keeps
every token of every layer (freeing what a window no longer sees needs a per-layer KV-cache spec,
which the cache manager does not have yet); ``warn_full_kv`` says so once per model.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional

from gridserve.shared.errors import ConfigError

logger = logging.getLogger(__name__)

WINDOW_FIELD = "model.hf_config.sliding_window"


def checked_window(window: Any) -> Optional[int]:
    """A config's ``sliding_window`` as an int, or None when it names none; a value that is not a
    positive integer is refused naming the field."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, (int, float)) or int(window) != window or window < 1:
        raise ConfigError(WINDOW_FIELD, f"must be a positive integer (or null: no window), got {window!r}")
    return int(window)


def effective_windows(windows: Sequence[Optional[int]], max_model_len: int) -> tuple[Optional[int], ...]:
    """``windows`` without the ones no sequence can outgrow (``window >= max_model_len``): full
    attention then, the same result without the window's masking."""
    return tuple(w if w is not None and w < max_model_len else None for w in windows)


def warn_full_kv(architecture: str, windows: Sequence[Optional[int]]) -> None:
    """Say at start that window layers keep every token's K/V (no per-layer KV-cache spec yet)."""
    sliding = [w for w in windows if w is not None]
    if sliding:
        logger.warning(
            "%s: %d of %d layers use a sliding window (%s tokens); they are masked to it but the KV cache "
            "keeps every token of every layer (no per-layer KV-cache spec yet)",
            architecture, len(sliding), len(windows), ", ".join(str(w) for w in sorted(set(sliding))),
        )
