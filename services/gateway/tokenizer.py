"""``GatewayTokenizer``: a Hugging Face tokenizer folder (or the tokenizer embedded in a ``.gguf``
file, converted by ``shared/gguf_tokenizer``) read with ``tokenizers`` and ``jinja2``.

The gateway must not import torch, and ``transformers`` 5 imports it; this class offers the part
of a fast tokenizer's interface the gateway uses (``encode``, ``decode``, ``backend_tokenizer``,
``eos_token_id``, ``apply_chat_template``), reading ``tokenizer.json``, ``tokenizer_config.json``
and the chat template (``chat_template.jinja`` or the config's ``chat_template``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

from tokenizers import Tokenizer

from gridserve.services.gateway.chat_template import ChatTemplateRenderer
from gridserve.shared.errors import InvalidArgumentError, ModelNotFoundError
from gridserve.shared.gguf_config import is_gguf
from gridserve.shared.gguf_tokenizer import tokenizer_from_gguf

logger = logging.getLogger(__name__)


class GatewayTokenizer:
    """Encode / decode and chat templates for one tokenizer folder or GGUF file."""

    def __init__(self, path: str, renderer: Optional[ChatTemplateRenderer] = None) -> None:
        """``renderer`` bounds chat template rendering (time, size); a default one if not given."""
        self.renderer = renderer or ChatTemplateRenderer(max_chars=4_000_000, timeout_s=2.0)
        self.renderer.env.globals["raise_exception"] = _raise_template_error
        self.config: dict[str, Any]
        self.chat_template: Optional[str]
        if is_gguf(path):  # the tokenizer embedded in a GGUF checkpoint, converted
            converted = tokenizer_from_gguf(str(path))
            self.backend_tokenizer = converted.tokenizer
            self.config = dict(converted.config)
            self.chat_template = converted.chat_template
        else:
            folder = Path(path)
            if not (folder / "tokenizer.json").is_file():
                raise ModelNotFoundError(f"no tokenizer.json in {folder} (the gateway needs a fast tokenizer)")
            self.backend_tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
            config_file = folder / "tokenizer_config.json"
            self.config = json.loads(config_file.read_text()) if config_file.is_file() else {}
            template_file = folder / "chat_template.jinja"
            self.chat_template = (
                template_file.read_text() if template_file.is_file() else self.config.get("chat_template")
            )
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.eos_token_id = self.backend_tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        # text -> id of each added token, and of the special ones (what decoding skips unless told not to)
        added = self.backend_tokenizer.get_added_tokens_decoder()
        self.added_tokens = {token.content: token_id for token_id, token in added.items()}
        self.special_tokens = {token.content: token_id for token_id, token in added.items() if token.special}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: Optional[str] = None,
        tokenize: bool = True,
        tools: Optional[list[dict[str, Any]]] = None,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        **_: Any,
    ) -> Any:
        """Render the conversation like ``transformers`` (tokens without extra special tokens);
        ``chat_template_kwargs`` are further template variables (``enable_thinking``, ...)."""
        template = chat_template or self.chat_template
        if not template:
            raise InvalidArgumentError("chat_template", "the model has no chat template; pass one")
        text = self.renderer.render(
            template,
            **(chat_template_kwargs or {}),
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _token_text(token: Any) -> Optional[str]:
    if isinstance(token, dict):
        return token.get("content")
    return token


def _raise_template_error(message: str) -> None:
    raise InvalidArgumentError("messages", message)
