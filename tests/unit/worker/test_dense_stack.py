"""Sentence-transformers ``Dense`` modules: read from ``modules.json`` and the modules' folders
(``shared.pooling.read_dense_modules``), applied by the worker (``DenseStack``) before the pooler
truncates and normalises; on hand-made folders and tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from gridserve.services.worker.dense_stack import DenseStack
from gridserve.services.worker.pooler import EmbeddingPooler, PoolingMetadata, pool_hidden
from gridserve.shared.errors import ConfigError
from gridserve.shared.pooling import (
    PoolerConfig,
    PoolingParams,
    embedding_size,
    read_dense_modules,
    read_sentence_transformers_config,
)

ST = "sentence_transformers.base.modules."
LENS = [3, 1, 5]
QSL = torch.tensor([0, 3, 4, 9], dtype=torch.int32)


def _folder(root: Path, *dense: dict, weights: str = "model.safetensors", normalize: bool = True) -> Path:
    """Transformer, mean Pooling, one Dense module per config in ``dense`` (random weights saved as
    ``weights``), Normalize."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": f"{ST}transformer.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "x.Pooling"}]
    (root / "1_Pooling").mkdir(parents=True)
    (root / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean"}))
    gen = torch.Generator().manual_seed(0)
    for config in dense:
        idx = len(modules)
        folder = root / f"{idx}_Dense"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        tensors = {"linear.weight": torch.randn(config["out_features"], config["in_features"], generator=gen)}
        if config.get("bias", True):
            tensors["linear.bias"] = torch.randn(config["out_features"], generator=gen)
        if weights == "model.safetensors":
            save_file(tensors, str(folder / weights))
        else:
            torch.save(tensors, folder / weights)
        modules.append({"idx": idx, "name": str(idx), "path": folder.name, "type": f"{ST}dense.Dense"})
    if normalize:
        modules.append({"idx": len(modules), "name": "n", "path": "n_Normalize", "type": f"{ST}normalize.Normalize"})
    (root / "modules.json").write_text(json.dumps(modules))
    return root


def _dense(in_features: int, out_features: int, **config) -> dict:
    return {"in_features": in_features, "out_features": out_features, **config}


def test_dense_modules_are_read_in_order_with_tanh_by_default(tmp_path):
    folder = _folder(tmp_path, _dense(8, 12, bias=True), _dense(12, 6, bias=False,
                                                                  activation_function="torch.nn.modules.linear.Identity"))
    first, second = read_dense_modules(folder)
    assert (first.in_features, first.out_features, first.bias, first.activation) == (8, 12, True, "Tanh")
    assert (second.in_features, second.out_features, second.bias, second.activation) == (12, 6, False, "Identity")
    assert second.weights_file == folder / "3_Dense" / "model.safetensors"
    assert read_sentence_transformers_config(folder) == PoolerConfig("MEAN", normalize=True)
    assert embedding_size(folder, 8) == 6 and embedding_size(tmp_path / "none", 8) == 8
    assert read_dense_modules(tmp_path / "none") == ()


@pytest.mark.parametrize(("dense", "field"), [
    ((_dense(8, 12), _dense(10, 6)), "3_Dense/config.json in_features"),
    ((_dense(8, 0),), "2_Dense/config.json out_features"),
    ((_dense(8, 4, activation_function="my.module.Swish"),), "2_Dense/config.json activation_function"),
    ((_dense(8, 4, activation_function="torch.nn.modules.activation.Softmax"),),
     "2_Dense/config.json activation_function"),
    ((_dense(8, 8, use_residual=True),), "2_Dense/config.json use_residual"),
    ((_dense(8, 4, module_input_name="token_embeddings"),), "2_Dense/config.json module_input_name"),
])
def test_a_dense_module_gridserve_cannot_reproduce_is_refused_naming_the_key(tmp_path, dense, field):
    folder = _folder(tmp_path, *dense)
    with pytest.raises(ConfigError) as info:
        read_dense_modules(folder)
    assert info.value.field == field


def test_dense_weights_in_a_pickle_only_are_refused_naming_the_file(tmp_path):
    folder = _folder(tmp_path, _dense(8, 4), weights="pytorch_model.bin")
    with pytest.raises(ConfigError) as info:
        read_dense_modules(folder)
    assert info.value.field == "2_Dense/pytorch_model.bin"
    assert "model.safetensors" in info.value.message and "pickle" in info.value.message
    (folder / "2_Dense" / "pytorch_model.bin").unlink()
    with pytest.raises(ConfigError) as info:
        read_dense_modules(folder)
    assert info.value.field == "2_Dense/model.safetensors"


def _reference(hidden: torch.Tensor, folder: Path) -> torch.Tensor:
    """The pooled means through each Dense module, written out."""
    rows = pool_hidden(hidden, QSL, "MEAN")
    for module in read_dense_modules(folder):
        from safetensors.torch import load_file

        tensors = load_file(str(module.weights_file))
        rows = F.linear(rows, tensors["linear.weight"], tensors.get("linear.bias"))
        rows = getattr(torch.nn, module.activation)()(rows)
    return rows


def test_the_pooler_projects_then_truncates_then_normalises(tmp_path):
    folder = _folder(tmp_path, _dense(8, 12, activation_function="torch.nn.modules.activation.GELU"),
                     _dense(12, 6, bias=False, activation_function="torch.nn.modules.linear.Identity"))
    stack = DenseStack(read_dense_modules(folder))
    loaded = stack.load_weights("sentence_dense")
    assert loaded == {"sentence_dense.layers.0.linear.weight", "sentence_dense.layers.0.linear.bias",
                      "sentence_dense.layers.1.linear.weight"}
    assert stack.load_weights("sentence_dense") == set()  # read once: a later weight sync leaves them
    hidden = torch.randn(sum(LENS), 8, generator=torch.Generator().manual_seed(1))
    projected = _reference(hidden, folder)
    pooler = EmbeddingPooler(PoolerConfig("MEAN", normalize=True), stack)
    with torch.inference_mode():
        out = pooler(hidden, PoolingMetadata(QSL, [PoolingParams(), PoolingParams(normalize=False),
                                                   PoolingParams(dimensions=4)]))
    torch.testing.assert_close(out[0], F.normalize(projected[0], dim=-1))
    torch.testing.assert_close(out[1], projected[1])
    torch.testing.assert_close(out[2], F.normalize(projected[2, :4], dim=-1))
