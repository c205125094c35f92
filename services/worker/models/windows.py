"""Sliding windows as every decoder family reads them: checked, dropped where no sequence can
outgrow them, and announced at start.

A window layer is masked to its window in every attention path, and reports a ``sliding_window``
KV cache spec: the engine puts it in a window group, whose blocks go back to the pool once the
window has passed them (``gridserve.shared.kv_cache_spec``). ``announce_windows`` says so once per
model.
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


def announce_windows(architecture: str, windows: Sequence[Optional[int]]) -> None:
    """Say at start which layers use a window (their KV cache keeps only the window)."""
    sliding = [w for w in windows if w is not None]
    if sliding:
        logger.info(
            "%s: %d of %d layers use a sliding window (%s tokens); their KV cache group keeps only the window",
            architecture, len(sliding), len(windows), ", ".join(str(w) for w in sorted(set(sliding))),
        )
