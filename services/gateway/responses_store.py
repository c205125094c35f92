"""The Responses API's store: what ``previous_response_id`` and ``GET /v1/responses/{id}`` read.

Off unless the gateway runs with ``--enable-responses-store``. When on, each gateway replica keeps
the responses it made in memory, bounded three ways: at most ``--responses-store-max-entries``
responses, ``--responses-store-max-bytes`` bytes of them (their JSON and the conversation they
continue), each for ``--responses-store-ttl-s`` seconds; beyond a bound the oldest go first, and a
response larger than the whole byte budget is not kept. An entry belongs to the API key its request
carried (a hash of the bearer token; none: the anonymous owner): another key, or another replica,
finds nothing (404). Ids carry the replica's tag, so a 404 can say that the id was made elsewhere.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any, Optional

from gridserve.shared.envs import add_option
from gridserve.shared.errors import ConfigError

logger = logging.getLogger(__name__)

ID_PREFIX = "resp_"
TAG_CHARS = 8  # the replica tag: the first characters after the prefix


@dataclass(frozen=True)
class ResponsesStoreOptions:
    """The store's switch and bounds (a flag ``--<name-with-dashes>`` each)."""

    enable_responses_store: bool = False
    responses_store_max_entries: int = 10_000
    responses_store_max_bytes: int = 256 << 20
    responses_store_ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        for name in ("responses_store_max_entries", "responses_store_max_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(name.replace("_", "-"), f"must be a positive integer, got {getattr(self, name)}")
        if not self.responses_store_ttl_s > 0:
            raise ConfigError("responses-store-ttl-s", f"must be positive, got {self.responses_store_ttl_s}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ResponsesStoreOptions:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def to_argv(self) -> list[str]:
        """These options as ``gridserve gateway`` flags (only the ones that differ from the default)."""
        argv: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                flag = "--" + f.name.replace("_", "-")
                argv += [flag] if value is True else [flag, str(value)]
        return argv

    def store(self) -> Optional[ResponseStore]:
        """The store these options ask for (None: off)."""
        if not self.enable_responses_store:
            return None
        return ResponseStore(self.responses_store_max_entries, self.responses_store_max_bytes,
                             self.responses_store_ttl_s)


def add_responses_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``ResponsesStoreOptions`` flags (``gridserve gateway`` and ``gridserve serve``)."""
    group = parser.add_argument_group("Responses API store (previous_response_id, GET /v1/responses/{id})")
    defaults = ResponsesStoreOptions()
    add_option(group, "--enable-responses-store", action="store_true",
               help="keep responses in this gateway's memory, per API key, for previous_response_id and "
                    "GET /v1/responses/{id} (off: store true is refused)")
    add_option(group, "--responses-store-max-entries", type=int, default=defaults.responses_store_max_entries,
               help=f"most stored responses per gateway (default {defaults.responses_store_max_entries})")
    add_option(group, "--responses-store-max-bytes", type=int, default=defaults.responses_store_max_bytes,
               help=f"most bytes of stored responses per gateway (default {defaults.responses_store_max_bytes})")
    add_option(group, "--responses-store-ttl-s", type=float, default=defaults.responses_store_ttl_s,
               help=f"seconds a stored response is kept (default {defaults.responses_store_ttl_s:g})")


def owner_of(metadata: Optional[Iterable[tuple[str, Any]]]) -> str:
    """Who owns what a call stores: a hash of its bearer token ("" without one)."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return hashlib.sha256(value[len("Bearer "):].encode()).hexdigest()
    return ""


@dataclass
class StoredResponse:
    """One kept response: its JSON body and the conversation a follow-up continues (template
    messages: the earlier turns, this input and this output; instructions are not carried)."""

    owner: str
    body: bytes
    messages: list[dict[str, Any]]
    size: int
    expires_at: float


class ResponseStore:
    """Responses by id, oldest first, within the bounds (see the module docstring). Used on the
    gateway's event loop only."""

    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self.clock = clock
        self.tag = secrets.token_hex(TAG_CHARS // 2)
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def new_id(self) -> str:
        return f"{ID_PREFIX}{self.tag}{secrets.token_hex(12)}"

    def made_here(self, response_id: str) -> bool:
        """Whether ``response_id`` is one this replica's store would have made."""
        return response_id.startswith(ID_PREFIX + self.tag)

    def put(self, owner: str, response_id: str, body: bytes, messages: list[dict[str, Any]], size: int) -> bool:
        """Keep a response (``size``: its bytes, body and conversation); False when it alone is
        larger than the byte budget (then nothing is kept)."""
        if size > self.max_bytes:
            logger.warning("response %s (%d bytes) exceeds --responses-store-max-bytes (%d): not stored",
                           response_id, size, self.max_bytes)
            return False
        self._expire()
        while self.entries and (len(self.entries) >= self.max_entries or self.bytes + size > self.max_bytes):
            self._drop(next(iter(self.entries)))
        self.entries[response_id] = StoredResponse(owner, body, messages, size, self.clock() + self.ttl_s)
        self.bytes += size
        return True

    def get(self, owner: str, response_id: str) -> Optional[StoredResponse]:
        """The response, when it is kept, not expired and ``owner``'s; else None."""
        self._expire()
        entry = self.entries.get(response_id)
        return entry if entry is not None and entry.owner == owner else None

    def __len__(self) -> int:
        return len(self.entries)

    def _expire(self) -> None:
        now = self.clock()
        while self.entries and next(iter(self.entries.values())).expires_at <= now:
            self._drop(next(iter(self.entries)))

    def _drop(self, response_id: str) -> None:
        self.bytes -= self.entries.pop(response_id).size
