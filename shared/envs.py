"""Every ``GRIDSERVE_*`` environment variable in one typed, documented table, read lazily.

Two kinds of variable exist:

- **flag variables**: every command-line option of a role can also come from
  ``GRIDSERVE_<FLAG>`` (``--max-num-seqs`` -> ``GRIDSERVE_MAX_NUM_SEQS``); a flag on the command
  line wins. They are declared with their flags (``gridserve/roles.py``, the gateway's limits and
  media options) and read here by :func:`flag_default`.
- **process settings** (this table, :data:`VARIABLES`): timeouts, kernel choices and tuning knobs
  that have no flag. Read them as attributes of this module (``envs.GRIDSERVE_STEP_TIMEOUT_S``):
  each access reads the environment at that moment, as ``vllm/envs.py`` does, so a test's
  ``monkeypatch.setenv`` or a launcher's child environment takes effect without re-imports.

No other module reads a ``GRIDSERVE_*`` variable from ``os.environ`` (checked by
``tests/unit/shared/test_envs.py``); ``docs/reference/environment.md`` is generated from this
table (``python -m gridserve.reference``). Test-only hooks take effect only with the one test
switch ``GRIDSERVE_TEST_HOOKS=1``.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from gridserve.shared.errors import ConfigError

_FALSE = ("", "0", "false", "no", "off")


def _bool(text: str) -> bool:
    return text.strip().lower() not in _FALSE


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be > 0")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError("must be >= 0")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be >= 1")
    return value


_DNS_NAME = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?)*")


def dns_name(text: str) -> str:
    """A lowercase DNS name (``gs-gridserve.llm``): labels of a-z, 0-9 and inner hyphens."""
    value = text.strip()
    if len(value) > 200 or not _DNS_NAME.fullmatch(value):
        raise ValueError("must be a lowercase DNS name (labels of a-z, 0-9 and inner '-', joined by '.')")
    return value


dns_name.__name__ = "DNS name"


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value

    parse.__name__ = "|".join(choices)
    return parse


@dataclass(frozen=True)
class EnvVar:
    """One process setting: its name, how its text is parsed, its default and what it does."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    roles: str  # which processes read it ("worker", "engine", "gateway", "all", "launcher", "tools")
    test_only: bool = False

    @property
    def kind(self) -> str:
        return {_bool: "bool", float: "float", int: "int", str: "str", _positive_float: "float > 0",
                _non_negative_float: "float >= 0",
                _non_negative_int: "int >= 0", _positive_int: "int >= 1"}.get(self.parse, self.parse.__name__)

    def read(self) -> Any:
        text = os.environ.get(self.name)
        if text is None or (text == "" and self.parse is not str):
            return self.default
        if self.test_only and self.name != TEST_HOOKS and not _test_hooks_enabled():
            return self.default
        try:
            return self.parse(text)
        except ValueError as exc:
            raise ConfigError(self.name, f"{exc} (got {text!r})") from None


TEST_HOOKS = "GRIDSERVE_TEST_HOOKS"

_TABLE = [
    # --- timeouts and intervals -------------------------------------------------------------
    EnvVar("GRIDSERVE_RPC_DEADLINE_S", _positive_float, 30.0,
           "deadline of a control-plane gRPC call between roles (seconds; *at import*)", "all"),
    EnvVar("GRIDSERVE_RECONNECT_DELAY_S", _positive_float, 1.0,
           "pause before a long-lived stream (engine outputs, load watch) reconnects (seconds; *at import*)", "all"),
    EnvVar("GRIDSERVE_STARTUP_TIMEOUT_S", _positive_float, 600.0,
           "how long `gridserve serve` waits for every role to become ready (seconds)", "launcher"),
    EnvVar("GRIDSERVE_WORKER_CONNECT_TIMEOUT_S", _positive_float, 30.0,
           "how long an engine waits for its workers to answer at start (seconds)", "engine"),
    EnvVar("GRIDSERVE_STEP_TIMEOUT_S", _positive_float, 120.0,
           "a worker that does not answer one step within this many seconds fails the group", "engine"),
    EnvVar("GRIDSERVE_LOAD_TIMEOUT_S", _positive_float, 900.0,
           "how long a worker may take to load the model (seconds)", "engine"),
    EnvVar("GRIDSERVE_LOOP_WATCHDOG_S", _positive_float, 30.0,
           "an engine loop silent this long makes the engine not live (liveness probe fails)", "engine"),
    EnvVar("GRIDSERVE_FAILOVER_TIMEOUT_S", _non_negative_float, 60.0,
           "how long a gateway keeps retrying a request whose engine was lost (seconds; 0: never)", "gateway"),
    EnvVar("GRIDSERVE_COORDINATOR_PUBLISH_INTERVAL_S", _positive_float, 1.0,
           "how often the DP coordinator publishes engine load to gateways (seconds)", "coordinator"),
    EnvVar("GRIDSERVE_DIST_TIMEOUT_S", _positive_float, 60.0,
           "timeout of torch.distributed collectives between workers (seconds)", "worker"),
    # --- CPU, kernels -----------------------------------------------------------------------
    EnvVar("GRIDSERVE_CPU_THREADS", _non_negative_int, 0,
           "torch threads per CPU worker (0: every core; `serve` with several workers sets 1 each)",
           "worker"),
    EnvVar("GRIDSERVE_CPU_MALLOC_TUNING", _bool, True,
           "keep large allocations mapped between steps (glibc malloc tuning) on CPU workers", "worker"),
    EnvVar("GRIDSERVE_CPU_PACKED_LINEAR", _bool, True,
           "fp32 (and, with native bf16, bf16) CPU linears on oneDNN-packed weights (0: plain "
           "F.linear, for A/B runs)", "worker"),
    EnvVar("GRIDSERVE_KERNELS", _choice("auto", "reference", "triton", "cpu"), "auto",
           "kernel family: auto (C++ on CPU, Triton on CUDA), reference (torch), triton, cpu (C++ "
           "required)", "worker"),
    EnvVar("GRIDSERVE_SERIAL_MAX_ELEMENTS", _non_negative_int, 1 << 20,
           "per-token CPU ops on up to this many elements run on one thread (0: off; *at import*)", "worker"),
    EnvVar("GRIDSERVE_INT8_ONEDNN", _choice("auto", "0", "1"), "auto",
           "int8 GEMM through oneDNN's AMX kernel: auto (where the CPU has AMX), 0 never, 1 always",
           "worker"),
    EnvVar("GRIDSERVE_BATCH_INVARIANT", _bool, False,
           "batch-invariant numerics (same as --batch-invariant)", "worker, engine"),
    # --- mutual TLS -------------------------------------------------------------------------
    EnvVar("GRIDSERVE_TLS_DEPLOYMENT", dns_name, None,
           "the deployment every peer certificate must name (same as --tls-deployment; Helm: "
           "`<fullname>.<namespace>`): only `<role>[-<id>].<deployment>.gridserve.internal` or "
           "`spiffe://<trust domain>/ns/<namespace>/sa/<fullname>-<role>[-<id>]` count (unset: any name "
           "the CA signed)", "worker, engine, coordinator, gateway"),
    EnvVar("GRIDSERVE_TLS_TRUST_DOMAIN", dns_name, None,
           "the SPIFFE trust domain a peer's URI must be in (same as --tls-trust-domain; needs "
           "GRIDSERVE_TLS_DEPLOYMENT)", "worker, engine, coordinator, gateway"),
    # --- gateway ------------------------------------------------------------------------------
    EnvVar("GRIDSERVE_MEDIA_LOADING_THREAD_COUNT", _positive_int, 8,
           "threads that fetch and decode image URLs in each gateway", "gateway"),
    # --- every role -------------------------------------------------------------------------
    EnvVar("GRIDSERVE_PLUGINS", str, None,
           "comma-separated names of the `gridserve.general_plugins` entry points to load (unset: all)",
           "all"),
    EnvVar("GRIDSERVE_MODEL_CACHE", str, None,
           "folder of the locally built demo / recipe checkpoints (default ~/.cache/gridserve/models)",
           "tools"),
    EnvVar("GRIDSERVE_PEER_SCRIPTS", str, None,
           "folder of the llama.cpp peer build scripts (`gridserve bench peer`)", "tools"),
    # --- tests only ---------------------------------------------------------------------------
    EnvVar(TEST_HOOKS, _bool, False,
           "the one switch for test-only hooks below; never set it in production", "all", test_only=True),
    EnvVar("GRIDSERVE_TEST_ENGINE_SIGUSR1_STOP", _bool, False,
           "tests: SIGUSR1 stops the engine's loop thread (the watchdog then makes it not live)",
           "engine", test_only=True),
    EnvVar("GRIDSERVE_TEST_MEDIA_LOOPBACK", _bool, False,
           "tests: the gateway may fetch image URLs from loopback addresses (a local image server); every "
           "other private address stays refused", "gateway", test_only=True),
    EnvVar("GRIDSERVE_TEST_GRAMMAR_FAULT", str, "",
           "tests: a request whose structured-output spec contains this text fails its grammar step "
           "(*at import*)",
           "worker", test_only=True),
]

VARIABLES: dict[str, EnvVar] = {var.name: var for var in _TABLE}


def _test_hooks_enabled() -> bool:
    return _bool(os.environ.get(TEST_HOOKS, ""))


def __getattr__(name: str) -> Any:
    var = VARIABLES.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.read()


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(VARIABLES))


def is_set(name: str) -> bool:
    """Whether the operator set ``name`` (a table variable) to a non-empty value."""
    if name not in VARIABLES:
        raise KeyError(name)
    return bool(os.environ.get(name))


# ---- flag variables --------------------------------------------------------------------------
def flag_env_name(flag: str) -> str:
    """``--max-num-seqs`` -> ``GRIDSERVE_MAX_NUM_SEQS``."""
    return "GRIDSERVE_" + flag.lstrip("-").replace("-", "_").upper()


def flag_default(flag: str, default: Any = None, kind: Optional[Callable[[str], Any]] = str) -> Any:
    """The value of ``flag``'s variable parsed by ``kind``, or ``default`` when unset / empty."""
    name = flag_env_name(flag)
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    try:
        return kind(text) if kind is not None else text
    except ValueError as exc:
        raise ConfigError(name, f"{exc} (got {text!r})") from None


def add_option(parser: Any, *flags: str, **kwargs: Any) -> argparse.Action:
    """``parser.add_argument`` whose default comes from the first flag's ``GRIDSERVE_*`` variable
    (a flag on the command line wins); the variable's name ends the help and stays on the action
    (``action.env_var``) for the generated reference."""
    name = flag_env_name(flags[0])
    if kwargs.get("action") == "store_true":
        kwargs["default"] = flag_default(flags[0], bool(kwargs.get("default", False)), _bool)
    elif kwargs.get("nargs") in ("+", "*"):  # the variable holds the values comma or space separated
        kind = kwargs.get("type") or str
        kwargs["default"] = flag_default(flags[0], kwargs.get("default"),
                                         lambda text: [kind(x) for x in text.replace(",", " ").split()] or None)
    else:
        kwargs["default"] = flag_default(flags[0], kwargs.get("default"), kwargs.get("type") or str)
    kwargs["help"] = f"{kwargs.get('help', '')} [{name}]".strip()
    action = parser.add_argument(*flags, **kwargs)
    action.env_var = name
    return action
