"""Set-up of the test modules that run Triton kernels in its CPU interpreter.

Such a module calls ``use_triton_interpreter()`` before it imports torch or any kernel module:

    import pytest

    from tests.unit.kernels.triton_interpreter import use_triton_interpreter

    use_triton_interpreter()

    import torch  # noqa: E402
"""

from __future__ import annotations

import os
import sys

import pytest


def use_triton_interpreter() -> None:
    """Choose Triton's CPU interpreter for this process (``TRITON_INTERPRET=1``), or skip the calling
    test module: when triton is not installed, or when it was imported before without the
    interpreter (triton.language binds to the variable at its first import, so the module must run
    in its own process then)."""
    imported_too_early = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
    os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton")
    if imported_too_early:
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set: run this file in its own "
                    "process", allow_module_level=True)
