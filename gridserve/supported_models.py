"""The supported-models table, from the model registry's metadata alone.

One row per architecture a worker can build: the built-ins (``ARCHITECTURES`` in
``shared/model_registry.py``: example checkpoints and what each supports) and the ones plugins
registered (``ModelRegistry``; their features are the plugin's business, shown as unknown, except
tensor / pipeline parallelism, which the engine refuses for an architecture it has no metadata
for). Nothing here imports torch or a model module. ``gridserve models`` prints the table;
``python -m gridserve.reference`` writes the built-in rows to ``docs/serving/supported-models.md``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Optional, Union

from gridserve.shared.model_registry import ARCHITECTURES, ModelRegistry, architecture_info

BUILT_IN = "built-in"
COLUMNS = ("architecture", "TP", "PP", "quantization", "multimodal", "KV cache", "source",
           "example checkpoints")
_UNKNOWN = "—"


@dataclass(frozen=True)
class ModelRow:
    """One architecture; a feature is None when only the plugin's model knows it."""

    architecture: str
    examples: tuple[str, ...]
    tensor_parallel: bool
    pipeline_parallel: bool
    quantization: Optional[bool]
    multimodal: Optional[bool]
    kv_kind: Optional[str]
    source: str  # "built-in", or "plugin" with the registered "module:Class"


def _builtin_row(name: str) -> ModelRow:
    a = ARCHITECTURES[name]
    return ModelRow(name, a.examples, a.tensor_parallel, a.pipeline_parallel, a.quantization, a.multimodal,
                    a.kv_kind, BUILT_IN)


def _plugin_row(name: str, target: Union[str, type]) -> ModelRow:
    info = architecture_info(name)  # a plugin may replace a built-in: the engine's checks stay its
    where = target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"
    return ModelRow(name, info.examples if info else (), bool(info and info.tensor_parallel),
                    bool(info and info.pipeline_parallel), None, None, None, f"plugin ({where})")


def model_rows(plugins: bool = True) -> list[ModelRow]:
    """Every architecture, sorted by name; ``plugins``: with the ones plugins registered (call
    ``load_general_plugins()`` first to run the installed plugins)."""
    rows = {name: _builtin_row(name) for name in ARCHITECTURES}
    if plugins:
        for name in ModelRegistry.get_supported_archs():
            target = ModelRegistry.registered(name)
            if target is not None:
                rows[name] = _plugin_row(name, target)
    return [rows[name] for name in sorted(rows, key=str.lower)]


def _flag(value: Optional[bool]) -> str:
    return _UNKNOWN if value is None else ("yes" if value else "no")


def _cells(row: ModelRow, examples: str) -> list[str]:
    return [row.architecture, _flag(row.tensor_parallel), _flag(row.pipeline_parallel), _flag(row.quantization),
            _flag(row.multimodal), row.kv_kind or _UNKNOWN, row.source, examples or _UNKNOWN]


def text_table(rows: list[ModelRow]) -> str:
    """Aligned columns for a terminal."""
    table = [list(COLUMNS), *(_cells(r, ", ".join(r.examples)) for r in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in table) + "\n"


def markdown_table(rows: list[ModelRow], source: bool = True) -> str:
    """A markdown table, each example linked to its Hugging Face page; ``source``: with that column."""
    keep = [i for i, c in enumerate(COLUMNS) if source or c != "source"]
    lines = ["| " + " | ".join(COLUMNS[i] for i in keep) + " |", "|" + "---|" * len(keep)]
    for r in rows:
        examples = ", ".join(f"[{e}](https://huggingface.co/{e})" for e in r.examples)
        cells = _cells(r, examples)
        cells[0] = f"`{cells[0]}`"
        lines.append("| " + " | ".join(cells[i] for i in keep) + " |")
    return "\n".join(lines) + "\n"


def json_rows(rows: list[ModelRow]) -> str:
    """One JSON object per architecture (features null when unknown)."""
    return json.dumps([{**asdict(r), "examples": list(r.examples)} for r in rows], indent=2) + "\n"


FORMATS = {"text": text_table, "markdown": markdown_table, "json": json_rows}
