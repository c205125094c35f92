"""Pooling models' settings, known without torch: how a model turns hidden states into one vector
(or scores) per input, and what a request may ask of it.

- ``PoolerConfig`` (vLLM's name): the model's pooling type (``LAST`` / ``MEAN`` / ``CLS``), whether
  embeddings are L2-normalised, a default Matryoshka ``dimensions`` and the classification head's
  ``activation``. Resolved by ``resolve_pooler_config`` from, in this order: the operator's
  override, the checkpoint's sentence-transformers files (``read_sentence_transformers_config``),
  the architecture's default.
- ``PoolingParams``: one request's ``task`` (``embed`` / ``classify`` / ``score``), ``dimensions``,
  ``normalize`` and ``activation``; ``verify`` refuses, naming the field, what the model cannot do
  (``dimensions`` of a model without Matryoshka support, as vLLM does).

Sentence-transformers folders hold ``modules.json`` (the module list: Transformer, Pooling,
Dense, Normalize, ...) and each module's ``config.json`` in its own folder (``1_Pooling/config.json``);
both the legacy ``pooling_mode_*_token(s)`` booleans and sentence-transformers 5+'s ``pooling_mode``
are read. ``Dense`` modules between Pooling and Normalize (EmbeddingGemma's 768 -> 3072 -> 768
projection) are ``DenseModule``s (``read_dense_modules``), which the worker applies to the pooled
rows. A module gridserve cannot reproduce (``max`` pooling, a Dense module before pooling, ...)
is refused at load, naming it, rather than served with different vectors.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Union

from gridserve.shared.errors import ConfigError, InvalidArgumentError

# Pooling types, as vLLM names them: the last token (causal embedders: Qwen3-Embedding, e5-mistral),
# the mean over every token (most sentence-transformers models), the first token (BERT's [CLS],
# RoBERTa's <s>: cross-encoders, bge).
LAST, MEAN, CLS = "LAST", "MEAN", "CLS"
POOLING_TYPES = (LAST, MEAN, CLS)
# What a pooling model serves (vLLM's task names): a vector per input, a score per label, one
# relevance score per (query, document) pair (a cross-encoder's one-label classifier).
EMBED, CLASSIFY, SCORE = "embed", "classify", "score"
POOLING_TASKS = (EMBED, CLASSIFY, SCORE)
# The classification head's activation: sigmoid (one label: a cross-encoder's relevance), softmax
# (several labels), none (the raw logits).
SIGMOID, SOFTMAX, NO_ACTIVATION = "sigmoid", "softmax", "none"
ACTIVATIONS = (SIGMOID, SOFTMAX, NO_ACTIVATION)

# sentence-transformers' pooling modes -> gridserve's pooling type (the ones it can reproduce)
_ST_MODES = {"cls": CLS, "mean": MEAN, "lasttoken": LAST}
_ST_LEGACY_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                    "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                    "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
# modules that change nothing the worker computes (the tokenizer's side, or no-ops at inference)
_ST_NEUTRAL = ("Transformer", "Dropout")
# a Dense module's ``activation_function``: the ``torch.nn`` classes (built without arguments, as
# sentence-transformers builds them) gridserve applies; Tanh when the config names none
DENSE_ACTIVATIONS = ("Identity", "Tanh", "ReLU", "GELU", "Sigmoid", "SiLU")
_DENSE_DEFAULT_ACTIVATION = "torch.nn.modules.activation.Tanh"
# activation_fn class names (sentence-transformers' CrossEncoder config) -> the head's activation
_ST_ACTIVATIONS = {"Sigmoid": SIGMOID, "Softmax": SOFTMAX, "Identity": NO_ACTIVATION}


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model pools; a field left None takes the next source's value (module docstring).

    ``dimensions``: every embedding truncated to this many leading dimensions (then normalised),
    unless a request asks for another (Matryoshka models only). ``activation`` applies to
    classification / score heads.
    """

    pooling_type: Optional[str] = None
    normalize: Optional[bool] = None
    dimensions: Optional[int] = None
    activation: Optional[str] = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            object.__setattr__(self, "pooling_type", str(self.pooling_type).upper())
            if self.pooling_type not in POOLING_TYPES:
                raise ConfigError("pooler_config.pooling_type",
                                  f"must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ConfigError("pooler_config.normalize", f"must be a boolean, got {self.normalize!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ConfigError("pooler_config.dimensions", f"must be a positive integer, got {self.dimensions!r}")
        if self.activation is not None and self.activation not in ACTIVATIONS:
            raise ConfigError("pooler_config.activation",
                              f"must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")

    @classmethod
    def of(cls, value: Union[None, dict, PoolerConfig]) -> PoolerConfig:
        """A ``PoolerConfig`` from itself, a dict (``--pooler-config '{"pooling_type": "MEAN"}'``) or None."""
        if value is None:
            return cls()
        if isinstance(value, PoolerConfig):
            return value
        if not isinstance(value, dict):
            raise ConfigError("pooler_config", f"must be a mapping, got {type(value).__name__}")
        unknown = set(value) - {"pooling_type", "normalize", "dimensions", "activation"}
        if unknown:
            raise ConfigError(f"pooler_config.{sorted(unknown)[0]}",
                              "unknown key; known: pooling_type, normalize, dimensions, activation")
        return cls(**value)

    def over(self, base: PoolerConfig) -> PoolerConfig:
        """This config's set fields, ``base``'s for the others."""
        return replace(base, **{k: v for k, v in self.__dict__.items() if v is not None})


@dataclass(frozen=True)
class DenseModule:
    """A sentence-transformers ``Dense`` module after pooling: ``activation(x @ weight.T + bias)``
    from ``in_features`` to ``out_features`` values; ``activation`` is a ``torch.nn`` class name
    (``DENSE_ACTIVATIONS``). Its weights (``linear.weight``, ``linear.bias``) are ``weights_file``."""

    folder: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str

    @property
    def weights_file(self) -> Path:
        return self.folder / "model.safetensors"


@dataclass(frozen=True)
class _Pipeline:
    """What a ``modules.json`` asks after the Transformer: pool, project, normalise."""

    pooling_type: Optional[str]
    dense: tuple[DenseModule, ...]
    normalize: bool


def read_sentence_transformers_config(model_path: Union[str, Path]) -> Optional[PoolerConfig]:
    """The pooling a sentence-transformers folder declares (``modules.json`` and its Pooling module's
    ``config.json``; a ``Normalize`` module -> ``normalize``), or None when there is no ``modules.json``.

    Without a Normalize module ``normalize`` is False, as sentence-transformers computes it. A module
    the worker cannot reproduce is refused (``ConfigError`` naming it).
    """
    pipeline = _read_pipeline(Path(model_path))
    if pipeline is None:
        return None
    return PoolerConfig(pooling_type=pipeline.pooling_type, normalize=pipeline.normalize)


def read_dense_modules(model_path: Union[str, Path]) -> tuple[DenseModule, ...]:
    """The ``Dense`` modules a sentence-transformers folder applies to the pooled vector, in
    ``modules.json`` order (none without the file). Each one's ``in_features`` is the previous
    one's ``out_features``; its weights are a ``model.safetensors`` (a ``pytorch_model.bin`` alone
    is refused, naming it: a pickle is never loaded)."""
    pipeline = _read_pipeline(Path(model_path))
    return () if pipeline is None else pipeline.dense


def embedding_size(model_path: Optional[Union[str, Path]], hidden_size: int) -> int:
    """The size of an embedder's vectors before ``dimensions``: its last Dense module's
    ``out_features``, else ``hidden_size`` (the vectors are pooled hidden states). Read once per
    checkpoint (the engine asks for every request)."""
    return _embedding_size(str(model_path) if model_path else "", hidden_size)


@functools.lru_cache(maxsize=16)
def _embedding_size(model_path: str, hidden_size: int) -> int:
    dense = read_dense_modules(model_path) if model_path else ()
    return dense[-1].out_features if dense else hidden_size


def _read_pipeline(folder: Path) -> Optional[_Pipeline]:
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError("modules.json", f"cannot be read: {e}") from e
    if not isinstance(modules, list):
        raise ConfigError("modules.json", "must be a list of modules")
    pooling_type: Optional[str] = None
    dense: list[DenseModule] = []
    normalize = False
    for module in sorted(modules, key=lambda m: m.get("idx", 0)):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        where = f"modules.json[{module.get('idx', '?')}] ({module.get('type')})"
        if kind in _ST_NEUTRAL:
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            if pooling_type is not None:
                raise ConfigError(where, "a second Pooling module is not supported")
            pooling_type = _st_pooling_type(folder / str(module.get("path", "")), where)
        elif kind == "Dense":
            if pooling_type is None or normalize:
                raise ConfigError(where, "a Dense module is supported after Pooling and before Normalize only")
            dense.append(_st_dense(folder / str(module.get("path", "")), where, dense[-1] if dense else None))
        else:
            raise ConfigError(where, f"sentence-transformers module {kind!r} is not supported "
                                     "(supported: Transformer, Pooling, Dense, Normalize)")
    return _Pipeline(pooling_type, tuple(dense), normalize)


def _st_module_config(folder: Path, where: str) -> dict:
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(where, f"its {path.name} cannot be read: {e}") from e
    if not isinstance(config, dict):
        raise ConfigError(f"{folder.name}/config.json", "must be a mapping")
    return config


def _st_dense(folder: Path, where: str, previous: Optional[DenseModule]) -> DenseModule:
    """One Dense module, as sentence-transformers' ``Dense.load`` reads it."""
    config = _st_module_config(folder, where)
    name = f"{folder.name}/config.json"
    sizes = []
    for key in ("in_features", "out_features"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} {key}", f"must be a positive integer, got {value!r}")
        sizes.append(value)
    if previous is not None and sizes[0] != previous.out_features:
        raise ConfigError(f"{name} in_features", f"{sizes[0]} differs from the previous Dense module's "
                                                 f"out_features {previous.out_features}")
    path = str(config.get("activation_function") or _DENSE_DEFAULT_ACTIVATION)
    activation = path.rsplit(".", 1)[-1]
    if not path.startswith("torch.") or activation not in DENSE_ACTIVATIONS:
        raise ConfigError(f"{name} activation_function",
                          f"{path!r} is not supported (supported: torch.nn's {', '.join(DENSE_ACTIVATIONS)})")
    if config.get("use_residual"):
        raise ConfigError(f"{name} use_residual", "a residual Dense module is not supported")
    for key in ("module_input_name", "module_output_name"):
        if config.get(key) not in (None, "sentence_embedding"):
            raise ConfigError(f"{name} {key}", f"{config[key]!r} is not supported (only the sentence embedding "
                                               "is projected)")
    module = DenseModule(folder, sizes[0], sizes[1], bool(config.get("bias", True)), activation)
    if not module.weights_file.is_file():
        pickled = folder / "pytorch_model.bin"
        if pickled.is_file():
            raise ConfigError(f"{folder.name}/{pickled.name}",
                              "gridserve reads a Dense module's weights from model.safetensors only (a .bin "
                              "file is a pickle, never loaded): save the module again with safetensors")
        raise ConfigError(f"{folder.name}/model.safetensors", "is missing: the Dense module has no weights")
    return module


def _st_pooling_type(folder: Path, where: str) -> str:
    config = _st_module_config(folder, where)
    if "pooling_mode" in config:
        modes = config["pooling_mode"]
        modes = [modes] if isinstance(modes, str) else list(modes)
    else:
        modes = [mode for key, mode in _ST_LEGACY_MODES.items() if config.get(key)] or ["mean"]
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ConfigError(f"{folder.name}/config.json pooling_mode",
                          f"{modes!r} is not supported (supported: one of {', '.join(_ST_MODES)})")
    if config.get("include_prompt", True) is False:
        raise ConfigError(f"{folder.name}/config.json include_prompt", "false is not supported")
    return _ST_MODES[modes[0]]


def resolve_pooler_config(model_path: Optional[Union[str, Path]], default: PoolerConfig,
                          override: Union[None, dict, PoolerConfig] = None) -> PoolerConfig:
    """The model's pooling: ``override``'s fields, then the checkpoint's sentence-transformers files,
    then the architecture's ``default``."""
    found = read_sentence_transformers_config(model_path) if model_path else None
    resolved = default if found is None else found.over(default)
    return PoolerConfig.of(override).over(resolved)


def read_sentence_bert_config(model_path: Union[str, Path]) -> dict:
    """``sentence_bert_config.json`` (``max_seq_length``: sentence-transformers truncates inputs to
    it; ``do_lower_case``: it lowercases them first), or ``{}`` when the folder has none. The
    engine's limits and tokenizer read it; the worker does not."""
    path = Path(model_path) / "sentence_bert_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError("sentence_bert_config.json", f"cannot be read: {e}") from e
    return config if isinstance(config, dict) else {}


# RoBERTa-style encoders number positions from ``padding_idx + 1`` (transformers'
# ``create_position_ids_from_input_ids``)
_PADDING_OFFSET_ARCHITECTURES = ("XLMRobertaModel", "XLMRobertaForSequenceClassification", "RobertaModel",
                                 "RobertaForSequenceClassification")


def position_offset(architecture: str, hf_config: dict) -> int:
    """The row of an encoder's position table its first token reads: ``pad_token_id + 1`` for the
    RoBERTa family (XLM-R's default pad is 1: positions from 2), 0 for BERT and the decoders."""
    return padding_position_offset(hf_config) if architecture in _PADDING_OFFSET_ARCHITECTURES else 0


def padding_position_offset(hf_config: dict) -> int:
    """``pad_token_id + 1`` (RoBERTa's ``padding_idx + 1``; its default pad is 1)."""
    pad = hf_config.get("pad_token_id")
    return (1 if pad is None else int(pad)) + 1


def max_input_tokens(architecture: str, hf_config: dict) -> Optional[int]:
    """The longest input an encoder's position table covers (``max_position_embeddings`` less the
    offset: 512 for XLM-R's 514), or None when the config names no table size. The engine's
    ``max_model_len`` for a pooling model must not exceed it."""
    table = hf_config.get("max_position_embeddings")
    return None if table is None else int(table) - position_offset(architecture, hf_config)


def matryoshka_dimensions(hf_config: dict) -> Optional[tuple[int, ...]]:
    """The output sizes a Matryoshka model was trained for (config.json's ``matryoshka_dimensions``);
    ``()`` when ``is_matryoshka`` says any size will do; None when the model does not support them."""
    dims = hf_config.get("matryoshka_dimensions")
    if dims:
        return tuple(int(d) for d in dims)
    return () if hf_config.get("is_matryoshka") else None


def classifier_activation(hf_config: dict) -> str:
    """A classification head's default activation, as vLLM and sentence-transformers' CrossEncoder
    choose it: the checkpoint's ``sentence_transformers.activation_fn`` when it names one of
    Sigmoid / Softmax / Identity, else sigmoid for one label and softmax for several."""
    st = hf_config.get("sentence_transformers") or {}
    path = st.get("activation_fn") or hf_config.get("sbert_ce_default_activation_function")
    if path:
        name = str(path).rsplit(".", 1)[-1]
        if name in _ST_ACTIVATIONS:
            return _ST_ACTIVATIONS[name]
    return SIGMOID if num_labels(hf_config) == 1 else SOFTMAX


def num_labels(hf_config: dict) -> int:
    """A classifier's outputs: ``num_labels``, else the size of ``id2label`` (transformers' rule, 2 by default)."""
    if hf_config.get("num_labels"):
        return int(hf_config["num_labels"])
    return len(hf_config.get("id2label") or {}) or 2


@dataclass(frozen=True)
class PoolingParams:
    """What one pooling request asks (vLLM's ``PoolingParams``); None takes the model's default.

    ``dimensions``: the embedding truncated to its first ``dimensions`` values, then normalised (a
    Matryoshka model only). ``normalize``: L2-normalise the embedding. ``activation``: apply the
    classification head's activation (False: the raw logits).
    """

    task: str = EMBED
    dimensions: Optional[int] = None
    normalize: Optional[bool] = None
    activation: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise InvalidArgumentError("pooling_params.task",
                                       f"must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise InvalidArgumentError("pooling_params.dimensions",
                                       f"must be a positive integer, got {self.dimensions!r}")
        for name in ("normalize", "activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise InvalidArgumentError(f"pooling_params.{name}", f"must be a boolean, got {value!r}")

    def verify(self, tasks: tuple[str, ...], hidden_size: int, hf_config: dict) -> None:
        """Refuse, naming the field, what a model serving ``tasks`` (hidden size ``hidden_size``,
        config ``hf_config``) cannot do: another task, ``dimensions`` of a model without Matryoshka
        support or outside its sizes, ``normalize`` / ``dimensions`` of a classifier."""
        if self.task not in tasks:
            raise InvalidArgumentError("pooling_params.task",
                                       f"{self.task!r} is not served by this model; it serves {', '.join(tasks)}")
        if self.task != EMBED:
            for name in ("dimensions", "normalize"):
                if getattr(self, name) is not None:
                    raise InvalidArgumentError(f"pooling_params.{name}", f"applies to embeddings, not to {self.task}")
            return
        if self.activation is not None:
            raise InvalidArgumentError("pooling_params.activation", "applies to classification and score heads")
        if self.dimensions is None:
            return
        supported = matryoshka_dimensions(hf_config)
        if supported is None:
            raise InvalidArgumentError("pooling_params.dimensions",
                                       "this model does not support Matryoshka representation: changing "
                                       "its output dimensions would give poor embeddings")
        if self.dimensions > hidden_size:
            raise InvalidArgumentError("pooling_params.dimensions",
                                       f"{self.dimensions} exceeds the model's embedding size {hidden_size}")
        if supported and self.dimensions not in supported:
            raise InvalidArgumentError("pooling_params.dimensions",
                                       f"{self.dimensions} is not one of the model's Matryoshka dimensions "
                                       f"{list(supported)}")


def check_default_dimensions(config: PoolerConfig, hidden_size: int, hf_config: dict) -> None:
    """Refuse a ``PoolerConfig.dimensions`` the model cannot give (as a request's would be)."""
    if config.dimensions is None:
        return
    try:
        PoolingParams(dimensions=config.dimensions).verify((EMBED,), hidden_size, hf_config)
    except InvalidArgumentError as e:
        raise ConfigError("pooler_config.dimensions", e.message) from e
