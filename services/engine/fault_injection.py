"""Test-only fault injection: with ``GRIDSERVE_TEST_HOOKS=1`` and ``GRIDSERVE_TEST_ENGINE_SIGUSR1_STOP=1``
in its environment, an engine
stops its loop thread on ``SIGUSR1`` (``EngineLoop.halt``), as if the thread had died outside any
step. Nothing marks the engine dead: only the loop watchdog notices, and liveness (health service
``"liveness"``) goes NOT_SERVING. Off unless both variables are set; never set them in production.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

from gridserve.shared import envs

logger = logging.getLogger(__name__)


def install_fault_injection(loop: Any) -> bool:
    """Stop ``loop``'s thread on SIGUSR1 when the test hook is on; whether it did."""
    if not envs.GRIDSERVE_TEST_ENGINE_SIGUSR1_STOP:
        return False
    signal.signal(signal.SIGUSR1, lambda _signum, _frame: loop.halt("fault injection (SIGUSR1)"))
    logger.warning("GRIDSERVE_TEST_ENGINE_SIGUSR1_STOP: SIGUSR1 stops the engine loop thread (tests only)")
    return True
