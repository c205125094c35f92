"""Which quantization each linear layer gets, decided by its ``prefix`` (vLLM's non-uniform
quantization at init).

Every linear layer is built with its checkpoint prefix (``model.layers.3.self_attn.qkv_proj``,
``lm_head``). ``QuantizationConfig.method_for(prefix)`` answers the configured method, or None for
a layer listed in ``ignore``. An ``ignore`` entry is an exact prefix or ``re:<regex>`` (matched in
full); a merged layer (``qkv_proj``, ``gate_up_proj``) also answers to its checkpoint parts'
names (``q_proj``, ...). An entry that matched no layer of the model is an error naming it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from gridserve.shared.errors import ConfigError

logger = logging.getLogger(__name__)

# A merged layer's checkpoint parts: an ignore entry may name either.
_MERGED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


@dataclass
class QuantizationConfig:
    """``method`` for every linear layer except those ``ignore`` names; ``group_size`` for int4."""

    method: str
    ignore: list[str] = field(default_factory=list)
    group_size: int = 128
    # Pre-quantized checkpoints: only these checkpoint prefixes are quantized (None: all but ignore),
    # and int8 stays weight-only (no activation quantization) when ``activations`` is False.
    only: set[str] | None = None
    activations: bool = True
    # int8 on CPU: how activations are quantized. ``activation_group`` 0: one scale per row, with
    # ``activation_rows`` 2: 16-bit (the int8 x int16 C++ GEMM, or two int8 rows per activation row
    # without it: the accuracy of weight-only), 1: one int8 row (coarser); 32: int8 with one scale
    # per 32 input columns (llama.cpp q8_0's scheme, the C++ GEMM's faster mode, coarser).
    activation_rows: int = 2
    activation_group: int = 0
    _matched: set[str] = field(default_factory=set, repr=False)

    @classmethod
    def from_model_config(cls, quantization: str | None, raw: dict) -> QuantizationConfig | None:
        if quantization in (None, "compressed-tensors"):
            return None
        return cls(
            quantization,
            list(raw.get("ignore", [])),
            int(raw.get("group_size", 128)),
            activations=not raw.get("weight_only", False),
            activation_rows=int(raw.get("activation_rows", 2)),
            activation_group=int(raw.get("activation_group", 0)),
        )

    def method_for(self, prefix: str) -> str | None:
        """The method for the layer at ``prefix``, None when an ``ignore`` entry matches it."""
        names = _names(prefix)
        if self.only is not None:
            return self.method if any(name in self.only for name in names) else None
        hit = [entry for entry in self.ignore if any(_matches(entry, name) for name in names)]
        self._matched.update(hit)
        return None if hit else self.method

    def check_all_matched(self, elsewhere: Iterable[str] = ()) -> None:
        """Raise for ignore entries that matched no layer (a typo would silently quantize).

        ``elsewhere``: prefixes of layers other pipeline stages hold; an entry naming one of them
        is not a typo."""
        others = [name for prefix in elsewhere for name in _names(prefix)]
        unmatched = [
            entry
            for entry in self.ignore
            if entry not in self._matched and not any(_matches(entry, name) for name in others)
        ]
        if unmatched:
            raise ConfigError(
                "model.quantization_config.ignore",
                f"entries match no linear layer of this model: {unmatched}",
            )


def _names(prefix: str) -> list[str]:
    """``prefix`` and, for a merged layer, its checkpoint parts' prefixes."""
    names = [prefix]
    head, _, last = prefix.rpartition(".")
    for part in _MERGED_PARTS.get(last, ()):
        names.append(f"{head}.{part}" if head else part)
    return names


def _matches(entry: str, name: str) -> bool:
    if entry.startswith("re:"):
        return re.fullmatch(entry[3:], name) is not None
    return entry == name
