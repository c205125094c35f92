"""Generates the Python protobuf / gRPC code from ``protos/`` (never committed).

``python -m gridserve.protos_build`` compiles every ``protos/gridserve/**/*.proto`` with
``grpc_tools.protoc -I protos`` into this package's folder, so ``protos/gridserve/worker/v1/worker.proto``
becomes ``gridserve.worker.v1.worker_pb2`` (+ ``_pb2_grpc``, ``.pyi``), and writes the ``__init__.py``
files of the generated packages. It also writes ``gridserve/protos.pb`` (``DESCRIPTOR_SET``), a
descriptor set of every proto with its imports, which the Envoy edge's gRPC-JSON transcoder reads.
The Makefile's install step runs it; ``ensure_generated()`` lets
code and tests build it on demand in a fresh checkout.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent
PROTO_ROOT = PACKAGE_DIR.parent / "protos"
THIRD_PARTY = PROTO_ROOT / "third_party"
# The generated packages, one per proto folder under protos/gridserve/.
GENERATED = ("common", "gateway", "engine", "worker", "coordinator")
# Descriptor set (``--include_imports``) of every proto, for Envoy's grpc_json_transcoder.
DESCRIPTOR_SET = PACKAGE_DIR / "protos.pb"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "gridserve").rglob("*.proto"))


def is_stale() -> bool:
    """True when a generated module or the descriptor set is missing or older than a .proto file."""
    for proto in proto_files():
        rel = proto.relative_to(PROTO_ROOT / "gridserve").with_suffix("")
        generated = PACKAGE_DIR / rel.parent / f"{rel.name}_pb2_grpc.py"
        if not generated.exists() or generated.stat().st_mtime < proto.stat().st_mtime:
            return True
        if not DESCRIPTOR_SET.exists() or DESCRIPTOR_SET.stat().st_mtime < proto.stat().st_mtime:
            return True
    return False


def generate() -> None:
    """Run protoc over every proto file; raise RuntimeError when it fails."""
    from grpc_tools import protoc

    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{THIRD_PARTY}",
        f"-I{_grpc_tools_include()}",
        f"--python_out={PACKAGE_DIR.parent}",
        f"--grpc_python_out={PACKAGE_DIR.parent}",
        f"--pyi_out={PACKAGE_DIR.parent}",
        f"--descriptor_set_out={DESCRIPTOR_SET}",
        "--include_imports",
        "--include_source_info",
        *files,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {files}")
    for name in GENERATED:
        for folder in (PACKAGE_DIR / name, *(PACKAGE_DIR / name).glob("v*")):
            if folder.is_dir():
                (folder / "__init__.py").touch()
    logger.info("generated protobuf code for %d files", len(files))


def ensure_generated() -> None:
    if is_stale():
        generate()


def _grpc_tools_include() -> Path:
    import grpc_tools

    return Path(grpc_tools.__file__).resolve().parent / "_proto"


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    generate()
    sys.exit(0)
