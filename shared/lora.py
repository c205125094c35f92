"""What names a LoRA adapter everywhere: ``LoRARequest`` (vLLM's name), torch-free.

A request runs on the base model or on one adapter. The engine keeps the adapter table (served
name -> id and folder); the worker loads an adapter's files the first time a request on it runs
(``services/worker/lora``). ``lora_int_id`` is unique for an engine's life and never reused, so the
prefix cache may key blocks by ``(lora_name, lora_int_id)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from gridserve.shared.errors import InvalidArgumentError

# PEFT's file names, as ``save_pretrained`` writes them.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MAX_LORA_NAME = 256


@dataclass(frozen=True)
class LoRARequest:
    """One adapter: its served name, the engine's id for it (> 0) and its folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name or len(self.lora_name) > MAX_LORA_NAME:
            raise InvalidArgumentError("lora_request.lora_name", f"must be a non-empty string of at most "
                                       f"{MAX_LORA_NAME} characters, got {self.lora_name!r:.80}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise InvalidArgumentError("lora_request.lora_int_id", f"must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise InvalidArgumentError("lora_request.lora_path", f"must be a string, got {type(self.lora_path).__name__}")

    @property
    def cache_key(self) -> tuple[str, int]:
        """What keys a request's first KV block besides its tokens (``kv_cache_manager``)."""
        return (self.lora_name, self.lora_int_id)

