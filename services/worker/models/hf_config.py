"""Attribute access to the model's Hugging Face ``config.json`` as carried in ``GridserveConfig``."""

from __future__ import annotations

from types import SimpleNamespace

from gridserve.shared.config import GridserveConfig


def hf_config_of(config: GridserveConfig) -> SimpleNamespace:
    """The checkpoint's config.json as an object (``hf.hidden_size``), missing keys read as absent."""
    return SimpleNamespace(**config.model.hf_config)
