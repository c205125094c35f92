"""Worker extension arguments and results as ``RpcValue``: plain data and typed tensors, no pickle."""

from __future__ import annotations

import struct

import pytest

from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.rpc.values import TensorData, decode, encode


def test_plain_data_round_trips_with_integers_kept():
    value = {"lr": 0.5, "step": 3, "names": ["a", "b"], "flag": True, "none": None, "nested": {"k": [1, 2.5]}}
    assert decode(encode(value)) == value
    assert isinstance(decode(encode(7)), int) and decode(encode(None)) is None


def test_tensors_inside_maps_and_lists_round_trip_as_typed_bytes():
    weight = TensorData(struct.pack("<4f", 1.0, -2.0, 0.5, 3.0), "float32", (2, 2))
    value = {"model.w": weight, "meta": {"version": 2}, "list": [weight, "x"]}
    message = encode(value)
    assert message.WhichOneof("kind") == "map"
    assert message.map.items["model.w"].tensor.shape == [2, 2]
    assert decode(message) == {"model.w": weight, "meta": {"version": 2}, "list": [weight, "x"]}


@pytest.mark.parametrize(("value", "field"), [
    (object(), "value"),
    ({1: "non-string key"}, "value"),
    (b"raw bytes", "value"),
])
def test_values_that_are_not_plain_data_are_refused(value, field):
    with pytest.raises(InvalidArgumentError) as info:
        encode(value)
    assert info.value.field == field


@pytest.mark.parametrize(("data", "dtype", "shape", "field"), [
    (b"\0" * 8, "float32", (3,), "tensor.data"),
    (b"", "complex64", (0,), "tensor.dtype"),
    (b"", "float32", (-1,), "tensor.shape"),
])
def test_inconsistent_tensors_name_the_field(data, dtype, shape, field):
    with pytest.raises(InvalidArgumentError) as info:
        TensorData(data, dtype, shape)
    assert info.value.field == field
