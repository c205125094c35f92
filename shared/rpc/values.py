"""Arguments and results of worker extension methods as ``common.v1.RpcValue``, never pickle.

A value is plain data (None, bool, int, float, str, and lists / string-keyed dicts of them: a
protobuf ``Value`` / ``Struct``) or holds typed tensors. Torch-free roles carry tensors as
``TensorData`` (raw little-endian bytes, dtype name, shape); the worker turns them into torch
tensors (``services/worker/extension.py``). Numbers travel as JSON numbers: integral ones come
back as ``int`` (exact up to 2**53).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format, struct_pb2

from gridserve.api.common.v1 import common_pb2
from gridserve.shared.errors import InvalidArgumentError

DTYPES = {
    "int32": common_pb2.DTYPE_INT32,
    "int64": common_pb2.DTYPE_INT64,
    "float32": common_pb2.DTYPE_FLOAT32,
    "float16": common_pb2.DTYPE_FLOAT16,
    "bfloat16": common_pb2.DTYPE_BFLOAT16,
}
_DTYPE_NAMES = {code: name for name, code in DTYPES.items()}
ITEMSIZE = {"int32": 4, "int64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class TensorData:
    """A dense array as bytes: ``data`` holds ``prod(shape)`` little-endian ``dtype`` elements."""

    data: bytes
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidArgumentError("tensor.dtype", f"must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        count = 1
        for dim in self.shape:
            if dim < 0:
                raise InvalidArgumentError("tensor.shape", f"negative dimension in {self.shape}")
            count *= dim
        if count * ITEMSIZE[self.dtype] != len(self.data):
            raise InvalidArgumentError(
                "tensor.data", f"{len(self.data)} bytes for shape {list(self.shape)} of {self.dtype}")


def encode(value: Any) -> common_pb2.RpcValue:
    """``value`` as an ``RpcValue``; anything but plain data and ``TensorData`` is refused."""
    if isinstance(value, TensorData):
        return common_pb2.RpcValue(tensor=common_pb2.Tensor(
            data=value.data, dtype=DTYPES[value.dtype], shape=list(value.shape)))
    if _has_tensor(value):
        if isinstance(value, dict):
            return common_pb2.RpcValue(map=common_pb2.RpcMap(items={_key(k): encode(v) for k, v in value.items()}))
        return common_pb2.RpcValue(list=common_pb2.RpcList(items=[encode(v) for v in value]))
    message = struct_pb2.Value()
    try:
        json_format.ParseDict(_plain(value), message)
    except (json_format.ParseError, TypeError, ValueError) as exc:
        raise InvalidArgumentError("value", f"cannot send {type(value).__name__}: {exc}") from None
    return common_pb2.RpcValue(json=message)


def decode(message: common_pb2.RpcValue) -> Any:
    """The Python value of an ``RpcValue`` (tensors as ``TensorData``)."""
    kind = message.WhichOneof("kind")
    if kind == "tensor":
        t = message.tensor
        if t.dtype not in _DTYPE_NAMES:
            raise InvalidArgumentError("tensor.dtype", f"unknown dtype {t.dtype}")
        return TensorData(t.data, _DTYPE_NAMES[t.dtype], tuple(t.shape))
    if kind == "list":
        return [decode(v) for v in message.list.items]
    if kind == "map":
        return {k: decode(v) for k, v in message.map.items.items()}
    if kind == "json":
        return _ints(json_format.MessageToDict(message.json))
    return None


def _ints(value: Any) -> Any:
    """JSON numbers come back as floats: integral ones are returned as ``int``."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
        return int(value)
    if isinstance(value, list):
        return [_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _ints(v) for k, v in value.items()}
    return value


def _has_tensor(value: Any) -> bool:
    if isinstance(value, TensorData):
        return True
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    return False


def _key(key: Any) -> str:
    if not isinstance(key, str):
        raise InvalidArgumentError("value", f"map keys must be strings, got {type(key).__name__}")
    return key


def _plain(value: Any) -> Any:
    """Plain data checked: a tuple becomes a list; anything else unknown is refused."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {_key(k): _plain(v) for k, v in value.items()}
    raise InvalidArgumentError("value", f"cannot send {type(value).__name__}: plain data or tensors only")
