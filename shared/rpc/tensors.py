"""Packs flat numeric lists into ``common.v1.Tensor`` (raw little-endian bytes) and back.

Uses the standard library's ``array`` so that torch-free roles (engine, gateway) can read them.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Sequence

from gridserve.api.common.v1 import common_pb2

_TYPECODES = {
    common_pb2.DTYPE_INT32: "i",
    common_pb2.DTYPE_INT64: "q",
    common_pb2.DTYPE_FLOAT32: "f",
}


def pack(values: Sequence[float], dtype: int) -> common_pb2.Tensor:
    """A 1-D tensor of ``values`` with element type ``dtype`` (a ``common_pb2.Dtype`` value)."""
    data = array(_TYPECODES[dtype], values)
    if sys.byteorder != "little":
        data.byteswap()
    return common_pb2.Tensor(data=data.tobytes(), dtype=dtype, shape=[len(data)])


def unpack(tensor: common_pb2.Tensor) -> list:
    """The elements of ``tensor`` as a flat Python list (empty for an unset tensor)."""
    if tensor.dtype == common_pb2.DTYPE_UNSPECIFIED:
        return []
    data = array(_TYPECODES[tensor.dtype])
    data.frombytes(tensor.data)
    if sys.byteorder != "little":
        data.byteswap()
    return data.tolist()


def pack_raw(data: bytes, dtype: int, shape: Sequence[int]) -> common_pb2.Tensor:
    """A tensor of ``shape`` whose elements are already little-endian bytes (image pixels)."""
    return common_pb2.Tensor(data=data, dtype=dtype, shape=list(shape))


def raw_bytes(tensor: common_pb2.Tensor, dtype: int) -> tuple[bytes, tuple[int, ...]]:
    """The little-endian bytes and shape of ``tensor``; ``ValueError`` unless its dtype is ``dtype``
    and its size matches its shape."""
    if tensor.dtype != dtype:
        raise ValueError(f"expected dtype {common_pb2.Dtype.Name(dtype)}, got {common_pb2.Dtype.Name(tensor.dtype)}")
    shape = tuple(int(d) for d in tensor.shape)
    itemsize = array(_TYPECODES[dtype]).itemsize
    if any(d < 0 for d in shape) or len(tensor.data) != itemsize * math.prod(shape):
        raise ValueError(f"{len(tensor.data)} bytes do not fill shape {list(shape)}")
    return tensor.data, shape
