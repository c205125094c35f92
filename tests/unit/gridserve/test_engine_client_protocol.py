"""Both engine clients, remote (gRPC) and in process, implement ``EngineClientProtocol``: the same
methods, each as async (or not) as the protocol's and with its parameters, and the same attributes."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from gridserve.local_engine_client import LocalEngineClient
from gridserve.shared.engine_client_protocol import EngineClientProtocol
from gridserve.shared.rpc.engine_client import EngineClient

CLIENTS = [EngineClient, LocalEngineClient]


def _protocol_methods() -> dict[str, object]:
    return {name: member for name, member in vars(EngineClientProtocol).items()
            if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, property))}


def _attributes_set_in_init(cls: type) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    return {target.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"}


def test_the_protocol_names_what_the_gateway_uses():
    assert set(_protocol_methods()) == {"num_in_flight", "register", "unregister", "add_request", "abort", "close"}
    assert set(EngineClientProtocol.__annotations__) == {"address", "loop", "ready", "serving", "recovering",
                                                         "sessions"}


@pytest.mark.parametrize("cls", CLIENTS, ids=lambda c: c.__name__)
def test_each_client_has_the_protocol_methods_with_the_same_signature_and_async_ness(cls):
    for name, member in _protocol_methods().items():
        implementation = inspect.getattr_static(cls, name, None)
        assert implementation is not None, f"{cls.__name__} lacks {name}"
        if isinstance(member, property):
            assert isinstance(implementation, property), f"{cls.__name__}.{name} must be a property"
            continue
        assert inspect.iscoroutinefunction(implementation) == inspect.iscoroutinefunction(member), (
            f"{cls.__name__}.{name}: {'async' if inspect.iscoroutinefunction(member) else 'sync'} in the protocol")
        want = [(p.name, p.kind, p.default) for p in inspect.signature(member).parameters.values()]
        got = [(p.name, p.kind, p.default) for p in inspect.signature(implementation).parameters.values()]
        assert got == want, f"{cls.__name__}.{name}{inspect.signature(implementation)}"


@pytest.mark.parametrize("cls", CLIENTS, ids=lambda c: c.__name__)
def test_each_client_sets_the_protocol_attributes(cls):
    missing = set(EngineClientProtocol.__annotations__) - _attributes_set_in_init(cls)
    assert not missing, f"{cls.__name__}.__init__ does not set {sorted(missing)}"
