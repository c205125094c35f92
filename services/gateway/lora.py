"""Multi-LoRA serving, the gateway's part: which model names are adapters, and the fan-out of vLLM's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` to every engine.

The adapter table lives in the engines (``LoadLoraAdapter`` / ``UnloadLoraAdapter`` /
``ListLoraAdapters``); a gateway keeps no state of its own that another replica would not have,
only a copy of what the engines list, taken at most ``ttl_s`` ago. A name missing from the copy, a
copy older than that, and every load or unload (by any replica: the next miss sees it) take a new
one; concurrent misses share one (``refresh``), so clients naming unknown models cost one
``ListLoraAdapters`` per engine at a time, not one per request. The copy is the union of what the
ready engines list (with data parallelism every engine loads every adapter).

An engine that restarts comes back with its ``--lora-modules`` only; the next copy taken after it
answers loads the adapters it lacks again (those the other engines serve that were created before it
started: ``_repair``), so every engine keeps serving every adapter.

Runtime loading goes to every engine in ``--engines`` order, one after the other, all or none: an
engine that refuses after others loaded the adapter has it unloaded from those again, and the
caller gets the refusal; an unreachable engine refuses the whole load up front. Two replicas loading
the same name race at the first engine, so at most one of them gets past it. Unloading also goes to
every engine: one that does not know the name counts as done (an earlier unload reached it), so
repeating an unload that failed half-way finishes it; the name unknown everywhere is a 404. Both run
to the end even when the caller goes away (``asyncio.shield``).

Engine refusals as HTTP (vLLM answers 400 for every failed load and 404 for an unknown name;
gridserve keeps those and tells the operator's switches apart): INVALID_ARGUMENT -> 400 naming the
field (``lora_path``, or ``adapter_config.r``: a field of the adapter's ``adapter_config.json``),
ALREADY_EXISTS -> 400 (vLLM's "has already been loaded"), NOT_FOUND -> 404, PERMISSION_DENIED
(``--allow-runtime-lora-updating`` off) and FAILED_PRECONDITION (``--enable-lora`` off, or no
``--lora-dir`` for runtime loading) -> 403, UNAVAILABLE / DEADLINE_EXCEEDED -> 503, UNIMPLEMENTED
(an engine without LoRA) -> 501, anything else 500.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import grpc

from gridserve.shared.errors import EngineDeadError, GridserveError, ModelNotFoundError
from gridserve.shared.rpc.errors import status_for

logger = logging.getLogger(__name__)

TTL_S = 2.0  # how old a copy of the adapter table may be before a lookup takes a new one

_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "BadRequestError"),
    grpc.StatusCode.ALREADY_EXISTS: (400, "BadRequestError"),
    grpc.StatusCode.NOT_FOUND: (404, "NotFoundError"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "PermissionDeniedError"),
    grpc.StatusCode.FAILED_PRECONDITION: (403, "PermissionDeniedError"),
    grpc.StatusCode.UNAVAILABLE: (503, "ServiceUnavailableError"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (503, "ServiceUnavailableError"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "NotImplementedError"),
}


class LoraRefusal(GridserveError):
    """A load or unload refused, as the HTTP error the caller gets (``api_errors`` answers it)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind


def not_found(name: str) -> ModelNotFoundError:
    """OpenAI's words for a model name this server does not serve (HTTP 404, gRPC NOT_FOUND)."""
    return ModelNotFoundError(f"The model `{name}` does not exist.")


@dataclass(frozen=True)
class Adapter:
    """One adapter as an engine lists it."""

    name: str
    path: str
    int_id: int = 0
    created: float = 0.0


@dataclass(frozen=True)
class AdapterTable:
    """The engines' adapters (by name, in the order they were added) and their LoRA settings."""

    adapters: dict[str, Adapter] = field(default_factory=dict)
    enable_lora: bool = False
    max_loras: int = 0
    max_lora_rank: int = 0
    taken_at: float = float("-inf")  # the clock's time when the copy was asked for


def engine_refusal(exc: BaseException, engine: Any, name: str) -> LoraRefusal:
    """An engine's refusal of a load or unload (a gRPC error, or an in-process engine's typed error)
    as the caller's HTTP error."""
    code, details = status_for(exc)
    status, kind = _HTTP.get(code, (500, "InternalServerError"))
    param: Optional[str] = "lora_name"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        named = details.split(":", 1)[0] if ":" in details else ""
        param = named.removeprefix("lora_request.") if named and " " not in named else None
    elif code == grpc.StatusCode.NOT_FOUND:
        details = f"The lora adapter '{name}' cannot be found."  # vLLM's words
    elif code == grpc.StatusCode.ALREADY_EXISTS:
        details = f"The lora adapter '{name}' has already been loaded."  # vLLM's words
    elif status >= 500:
        param = None
        details = f"engine {getattr(engine, 'address', '?')}: {details}"
    if status == 500:
        logger.error("LoRA adapter %r: engine %s failed: %s", name, getattr(engine, "address", "?"), details)
    return LoraRefusal(status, details, param, kind)


class LoraAdapters:
    """A gateway's view of its engines' adapter tables, and the runtime load / unload fan-out.

    ``engines``: the gateway's engine clients (``EngineClient``: ``list_lora_adapters``,
    ``load_lora_adapter``, ``unload_lora_adapter``; a client without them serves no adapters)."""

    def __init__(self, engines: Sequence[Any], ttl_s: float = TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engines = list(engines)
        self.ttl_s = ttl_s
        self.clock = clock
        self.table = AdapterTable()
        self._lock: Optional[asyncio.Lock] = None
        self._repairs: set[asyncio.Task] = set()  # loads onto restarted engines, in flight
        self._asked = 0  # refreshes asked for so far
        self._done = 0  # of those, how many the latest copy covers (it was taken after they were asked)

    @property
    def _serves_lora(self) -> bool:
        return any(hasattr(e, "list_lora_adapters") for e in self.engines)

    def _fresh(self) -> bool:
        return self.clock() - self.table.taken_at < self.ttl_s

    async def lookup(self, name: str) -> Optional[Adapter]:
        """The adapter served as ``name``, or None; a name not in a fresh copy takes a new one."""
        if not self._serves_lora or (self._fresh() and not self.table.enable_lora):
            return None  # no engine serves adapters (--enable-lora is a start flag): nothing to ask
        adapter = self.table.adapters.get(name)
        if adapter is not None and self._fresh():
            return adapter
        try:
            return (await self.refresh()).adapters.get(name)
        except EngineDeadError:
            if adapter is None:
                raise
            return adapter  # no engine answers now: the last copy's word (the engine checks it again)

    async def current(self) -> AdapterTable:
        """A copy at most ``ttl_s`` old (for ``/v1/models``)."""
        if not self._serves_lora or self._fresh():
            return self.table
        return await self.refresh()

    def invalidate(self) -> None:
        """The engines' tables changed: the next lookup asks them again."""
        self.table = AdapterTable(self.table.adapters, self.table.enable_lora, self.table.max_loras,
                                  self.table.max_lora_rank)

    async def refresh(self) -> AdapterTable:
        """A copy of the engines' tables asked for after this call began. Calls that arrive while one
        is being taken wait for it, then share the next one (at most one in flight)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        self._asked += 1
        ticket = self._asked
        async with self._lock:
            if self._done >= ticket:
                return self.table
            covers = self._asked
            self.table = await self._take()
            self._done = covers
            return self.table

    async def _take(self) -> AdapterTable:
        taken_at = self.clock()
        listers = [e for e in self.engines if hasattr(e, "list_lora_adapters") and e.ready.is_set()]
        if not listers:
            raise EngineDeadError("no engine is reachable to list its LoRA adapters")
        answers = await asyncio.gather(*(e.list_lora_adapters() for e in listers), return_exceptions=True)
        adapters: dict[str, Adapter] = {}
        held: list[tuple[Any, float, set[str]]] = []  # per engine that answered: its start, its names
        enable, max_loras, max_rank, answered = False, 0, 0, 0
        for engine, answer in zip(listers, answers):
            if isinstance(answer, BaseException):
                if isinstance(answer, grpc.aio.AioRpcError) and answer.code() == grpc.StatusCode.UNIMPLEMENTED:
                    answered += 1  # an engine without LoRA: no adapters
                    continue
                if isinstance(answer, asyncio.CancelledError):
                    raise answer
                logger.info("engine %s: ListLoraAdapters failed: %s", engine.address, status_for(answer)[1])
                continue
            answered += 1
            enable = enable or answer.enable_lora
            max_loras = max(max_loras, answer.max_loras)
            max_rank = max(max_rank, answer.max_lora_rank)
            for a in answer.adapters:
                adapters.setdefault(a.lora_name, Adapter(a.lora_name, a.lora_path, a.lora_int_id, a.created))
            held.append((engine, answer.started, {a.lora_name for a in answer.adapters}))
        if not answered:
            raise EngineDeadError("no engine answered ListLoraAdapters")
        self._repair(held, adapters)
        return AdapterTable(adapters, enable, max_loras, max_rank, taken_at)

    def _repair(self, held: list[tuple[Any, float, set[str]]], adapters: dict[str, Adapter]) -> None:
        """Give a restarted engine back the adapters loaded at run time: one that started after an
        adapter the other engines serve was created lacks it only because it restarted (an unload
        would have reached an engine that was already running), so it is loaded there again."""
        for engine, started, names in held:
            for adapter in adapters.values():
                if adapter.name in names or not started or started <= adapter.created:
                    continue
                logger.info("LoRA adapter %r: engine %s restarted after it was loaded; loading it there again",
                            adapter.name, engine.address)
                task = asyncio.ensure_future(self._load_one(engine, adapter))
                self._repairs.add(task)
                task.add_done_callback(self._repairs.discard)

    async def _load_one(self, engine: Any, adapter: Adapter) -> None:
        try:
            await engine.load_lora_adapter(adapter.name, adapter.path)
        except Exception as exc:  # noqa: BLE001 - another replica may have been first: logged
            code, details = status_for(exc)
            if code != grpc.StatusCode.ALREADY_EXISTS:
                logger.warning("LoRA adapter %r: reloading it on engine %s failed: %s", adapter.name,
                               engine.address, details)
        finally:
            self.invalidate()

    # ---- runtime loading ------------------------------------------------------------------------
    def _check_reachable(self) -> None:
        if not self.engines:
            raise LoraRefusal(503, "no engine to load LoRA adapters on", None, "ServiceUnavailableError")
        down = [e.address for e in self.engines if not e.ready.is_set()]
        if down:
            raise LoraRefusal(503, f"engine {down[0]} is not reachable: LoRA adapters are loaded and unloaded on "
                                "every engine or none; try again when it is back", None, "ServiceUnavailableError")

    async def load(self, name: str, path: str) -> None:
        """Load ``name`` from ``path`` on every engine, or on none (a ``LoraRefusal`` says why)."""
        self._check_reachable()
        await asyncio.shield(asyncio.ensure_future(self._load(name, path)))

    async def _load(self, name: str, path: str) -> None:
        loaded: list[Any] = []
        try:
            for engine in self.engines:
                try:
                    await engine.load_lora_adapter(name, path)
                except Exception as exc:  # noqa: BLE001 - every refusal is the caller's answer
                    raise engine_refusal(exc, engine, name) from None
                loaded.append(engine)
        except BaseException as exc:
            if loaded:
                logger.warning("LoRA adapter %r: refused by an engine (%s); unloading it from the %d engines that "
                               "loaded it", name, exc, len(loaded))
            for engine in reversed(loaded):
                try:
                    await engine.unload_lora_adapter(name)
                except Exception as undo:  # noqa: BLE001 - reported, the refusal is still the answer
                    logger.error("LoRA adapter %r: unloading it from engine %s after a failed load failed: %s",
                                 name, engine.address, status_for(undo)[1])
            raise
        finally:
            self.invalidate()
        logger.info("LoRA adapter %r loaded from %s on %d engines", name, path, len(loaded))

    async def unload(self, name: str) -> None:
        """Unload ``name`` from every engine (404 when none had it)."""
        self._check_reachable()
        await asyncio.shield(asyncio.ensure_future(self._unload(name)))

    async def _unload(self, name: str) -> None:
        removed, first_error = 0, None
        try:
            for engine in self.engines:
                try:
                    await engine.unload_lora_adapter(name)
                    removed += 1
                except Exception as exc:  # noqa: BLE001
                    error = engine_refusal(exc, engine, name)
                    if error.status != 404 and first_error is None:
                        first_error = error
        finally:
            self.invalidate()
        if first_error is not None:
            raise first_error
        if not removed:
            raise LoraRefusal(404, f"The lora adapter '{name}' cannot be found.", "lora_name", "NotFoundError")
        logger.info("LoRA adapter %r unloaded from %d engines", name, removed)
