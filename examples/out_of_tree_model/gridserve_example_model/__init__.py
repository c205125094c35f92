"""An out-of-tree gridserve model package.

``register`` runs in every gridserve process (gateway, engine and worker alike) through the
``gridserve.general_plugins`` entry point. It registers lazy ``"module:Class"`` strings only: the
model module imports torch, which the gateway and the engine do not have.
"""

from __future__ import annotations


def register() -> None:
    from gridserve import ModelRegistry

    ModelRegistry.register_model("ExampleLlamaForCausalLM", "gridserve_example_model.model:ExampleLlamaForCausalLM")
    ModelRegistry.register_model("ExampleOldStyleForCausalLM",
                                 "gridserve_example_model.model:ExampleOldStyleForCausalLM")
