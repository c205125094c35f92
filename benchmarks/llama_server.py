"""llama.cpp's ``llama-server`` as ``gridserve bench peer``'s peer: find or build it, convert a
checkpoint to GGUF, and run one server on a free loopback port.

The build and the conversion are the shared scripts' (``../shared/tools/peer-llamacpp/``:
``build.sh WORKDIR`` builds ``llama-server`` from the ``llama-cpp-python`` sdist's vendored tree
and a venv for the HF -> GGUF converter, ~8.5 minutes on 2 cores, needs the package index;
``convert.sh WORKDIR HF_DIR OUT.gguf TYPE``). Converted files are cached in ``WORKDIR/gguf``.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

from gridserve.benchmarks.peer_server import PeerServer, PeerSetupError
from gridserve.shared import envs

logger = logging.getLogger(__name__)

GGUF_TYPES = ("f32", "f16", "q8_0")
BUILD_TIMEOUT_S = 3600.0
CONVERT_TIMEOUT_S = 1800.0


def default_scripts_dir() -> Path:
    """``$GRIDSERVE_PEER_SCRIPTS``, else ``<checkout>/../shared/tools/peer-llamacpp``."""
    env = envs.GRIDSERVE_PEER_SCRIPTS
    return Path(env) if env else Path(__file__).resolve().parents[1].parent / "shared" / "tools" / "peer-llamacpp"


def default_work_dir() -> Path:
    return Path.home() / ".cache" / "gridserve" / "peer-llamacpp"


def _run_script(argv: list[str], log: Path, timeout_s: float, what: str) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    logger.info("%s: %s (log: %s)", what, " ".join(argv), log)
    with open(log, "ab") as out:
        try:
            rc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            raise PeerSetupError(f"{what} took over {timeout_s:g}s; see {log}") from None
        except OSError as exc:
            raise PeerSetupError(f"{what}: cannot run {argv[0]} ({exc})") from None
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise PeerSetupError(f"{what} failed (exit {rc}); see {log}:\n" + "\n".join(tail))


def build(work_dir: Path, scripts: Path) -> None:
    """The shared ``build.sh``: llama-server and the converter's venv in ``work_dir``."""
    script = scripts / "build.sh"
    if not script.is_file():
        raise PeerSetupError(f"no {script}: give --llama-server, or --peer-scripts with build.sh / convert.sh")
    _run_script([str(script), str(work_dir)], work_dir / "build.log", BUILD_TIMEOUT_S,
                "building llama.cpp (about 8.5 minutes on 2 cores)")


def find_llama_server(explicit: Optional[str], work_dir: Path, scripts: Path) -> Path:
    """``explicit`` (``--llama-server``), else ``llama-server`` on PATH, else the one built in
    ``work_dir`` (built there by the shared scripts first if it is not)."""
    if explicit:
        path = Path(explicit).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise PeerSetupError(f"--llama-server {explicit}: not an executable file")
        return path
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path)
    built = work_dir / "build" / "bin" / "llama-server"
    if not built.is_file():
        build(work_dir, scripts)
    return built


def ensure_gguf(model_dir: Path, outtype: str, work_dir: Path, scripts: Path) -> Path:
    """``model_dir`` converted to GGUF ``outtype``, cached as ``work_dir/gguf/<name>-<type>.gguf``
    (converted again when the checkpoint is newer). The converter's venv comes from ``build.sh``."""
    if outtype not in GGUF_TYPES:
        raise ValueError(f"GGUF type must be one of {', '.join(GGUF_TYPES)}, got {outtype!r}")
    out = work_dir / "gguf" / f"{model_dir.name}-{outtype}.gguf"
    newest = max((f.stat().st_mtime for f in model_dir.iterdir() if f.is_file()), default=0.0)
    if out.is_file() and out.stat().st_mtime >= newest:
        return out
    if not (work_dir / "cvenv" / "bin" / "python").is_file():
        build(work_dir, scripts)
    partial = out.with_name(out.stem + ".partial.gguf")
    _run_script([str(scripts / "convert.sh"), str(work_dir), str(model_dir), str(partial), outtype],
                out.with_suffix(".convert.log"), CONVERT_TIMEOUT_S, f"converting {model_dir.name} to GGUF {outtype}")
    partial.replace(out)
    converter_log = partial.with_name(partial.name + ".log")  # convert.sh's own log, beside its output
    if converter_log.is_file():
        converter_log.replace(out.with_name(out.name + ".log"))
    return out


class LlamaServer(PeerServer):
    """One ``llama-server`` on a free loopback port: ``slots`` parallel sequences (``-np``) with
    continuous batching, ``ctx_per_slot`` tokens of context each, a ``kv_type`` KV cache, all of
    the machine's cores unless ``threads``, then ``extra_args`` (e.g. ``-fa off``). ``start()`` waits
    until ``GET /health`` answers 200; ``stop()`` sends SIGTERM, then SIGKILL after ``grace_s``. A
    context manager."""

    name = "llama-server"

    def __init__(self, binary: Path, gguf: Path, slots: int, *, ctx_per_slot: int = 512, kv_type: str = "f16",
                 threads: Optional[int] = None, log_path: Optional[Path] = None, host: str = "127.0.0.1",
                 grace_s: float = 10.0, extra_args: tuple[str, ...] = ()) -> None:
        super().__init__(log_path=log_path, host=host, grace_s=grace_s)
        self.binary, self.gguf, self.slots = binary, gguf, slots
        self.ctx_per_slot, self.kv_type = ctx_per_slot, kv_type
        self.threads = threads or os.cpu_count() or 1
        self.extra_args = tuple(extra_args)

    def argv(self) -> list[str]:
        return [str(self.binary), "-m", str(self.gguf), "--host", self.host, "--port", str(self.port),
                "-np", str(self.slots), "-c", str(self.slots * self.ctx_per_slot), "-t", str(self.threads),
                "-ctk", self.kv_type, "-ctv", self.kv_type, "-cb", *self.extra_args]
