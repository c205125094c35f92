"""The model registry (lazy strings, torch-free) and the old-constructor adapter."""

from __future__ import annotations

import warnings

import pytest

from gridserve import ModelRegistry
from gridserve.services.worker import models
from gridserve.shared.errors import ConfigError, InvalidArgumentError
from gridserve.shared.model_registry import ARCHITECTURES, BUILTIN_ARCHITECTURES


@pytest.fixture
def registered():
    names = []

    def register(architecture, target):
        ModelRegistry.register_model(architecture, target)
        names.append(architecture)

    yield register
    for name in names:
        ModelRegistry.unregister(name)


def test_registered_lazy_string_is_supported_without_importing_it(registered):
    registered("NotImportedForCausalLM", "no_such_package.models:NotImportedForCausalLM")
    assert "NotImportedForCausalLM" in ModelRegistry.get_supported_archs()
    ModelRegistry.check_architecture("NotImportedForCausalLM")  # registered, never imported


def test_unknown_architecture_names_every_registered_one(registered):
    registered("MyForCausalLM", "my_pkg.models:MyForCausalLM")
    with pytest.raises(ConfigError) as info:
        ModelRegistry.check_architecture("MambaForCausalLM")
    assert info.value.field == "model.architecture"
    assert "'MambaForCausalLM'" in str(info.value)
    for name in (*BUILTIN_ARCHITECTURES, "MyForCausalLM"):
        assert name in str(info.value)


@pytest.mark.parametrize(("architecture", "target", "field"), [
    ("My Model", "pkg.mod:Cls", "architecture"),
    ("MyForCausalLM", "pkg.mod.Cls", "model_cls"),
    ("MyForCausalLM", 42, "model_cls"),
])
def test_bad_registration_names_the_argument(architecture, target, field):
    with pytest.raises(InvalidArgumentError) as info:
        ModelRegistry.register_model(architecture, target)
    assert info.value.field == field


def test_every_builtin_architecture_resolves_to_its_class_in_the_worker():
    assert set(ARCHITECTURES) == set(BUILTIN_ARCHITECTURES)
    for name, info in ARCHITECTURES.items():
        cls = models.get_model_class(name)
        assert cls.__name__ == info.module.split(":")[1] and cls.__module__.endswith(info.module.split(":")[0])


def test_registered_string_resolves_to_its_class_in_the_worker(registered):
    registered("OrderedForCausalLM", "collections:OrderedDict")
    import collections

    assert models.get_model_class("OrderedForCausalLM") is collections.OrderedDict


class _NewStyle:
    def __init__(self, *, config, prefix: str = "") -> None:
        self.args = (config, prefix)


class _OldStyle:
    def __init__(self, config, prefix: str = "") -> None:
        self.args = (config, prefix)


def test_new_signature_is_built_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert models.construct_model(_NewStyle, "cfg", "p").args == ("cfg", "p")


def test_old_positional_signature_is_adapted_with_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = models.construct_model(_OldStyle, "cfg", "model")
        second = models.construct_model(_OldStyle, "cfg2")
    assert first.args == ("cfg", "model") and second.args == ("cfg2", "")
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1
    assert "_OldStyle" in str(deprecations[0].message) and "*, config" in str(deprecations[0].message)
