"""Test-only fault injection: with ``GRIDSERVE_FAULT_INJECTION=1`` in its environment, an engine
stops its loop thread on ``SIGUSR1`` (``EngineLoop.halt``), as if the thread had died outside any
step. Nothing marks the engine dead: only the loop watchdog notices, and liveness (health service
``"liveness"``) goes NOT_SERVING. Off unless the variable is set; never set it in production.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

logger = logging.getLogger(__name__)

ENV = "GRIDSERVE_FAULT_INJECTION"


def install_fault_injection(loop: Any) -> bool:
    """Stop ``loop``'s thread on SIGUSR1 when ``GRIDSERVE_FAULT_INJECTION=1``; whether it did."""
    if os.environ.get(ENV) != "1":
        return False
    signal.signal(signal.SIGUSR1, lambda _signum, _frame: loop.halt("fault injection (SIGUSR1)"))
    logger.warning("%s=1: SIGUSR1 stops the engine loop thread (tests only)", ENV)
    return True
