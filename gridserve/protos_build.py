"""Generates the Python protobuf / gRPC code from ``protos/`` (never committed).

``python -m gridserve.protos_build`` compiles every ``protos/gridserve/**/*.proto`` with
``grpc_tools.protoc -I protos`` and places the result under ``gridserve/api/``, so
``protos/gridserve/worker/v1/worker.proto`` becomes ``gridserve.api.worker.v1.worker_pb2`` (+ ``_pb2_grpc``,
``.pyi``): one namespace for generated contracts that cannot be mistaken for a role
(``gridserve.services.worker``). The protobuf packages on the wire stay ``gridserve.<role>.v1``; only
the Python imports between generated modules are rewritten to the ``api`` prefix. It also writes ``gridserve/protos.pb`` (``DESCRIPTOR_SET``), a
descriptor set of every proto with its imports, which the Envoy edge's gRPC-JSON transcoder reads.
The Makefile's install step runs it; ``ensure_generated()`` lets
code and tests build it on demand in a fresh checkout.
"""

from __future__ import annotations

import logging
import re
import shutil
import sys
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent
PROTO_ROOT = PACKAGE_DIR.parent / "protos"
THIRD_PARTY = PROTO_ROOT / "third_party"
# The generated packages, one per proto folder under protos/gridserve/, all under gridserve/api/.
GENERATED = ("common", "gateway", "engine", "worker", "coordinator")
API_DIR = PACKAGE_DIR / "api"
_IMPORT = re.compile(r"\b(from|import) gridserve\.(" + "|".join(GENERATED) + r")\.")
# Descriptor set (``--include_imports``) of every proto, for Envoy's grpc_json_transcoder.
DESCRIPTOR_SET = PACKAGE_DIR / "protos.pb"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "gridserve").rglob("*.proto"))


def is_stale() -> bool:
    """True when a generated module or the descriptor set is missing or older than a .proto file."""
    for proto in proto_files():
        rel = proto.relative_to(PROTO_ROOT / "gridserve").with_suffix("")
        generated = API_DIR / rel.parent / f"{rel.name}_pb2_grpc.py"
        if not generated.exists() or generated.stat().st_mtime < proto.stat().st_mtime:
            return True
        if not DESCRIPTOR_SET.exists() or DESCRIPTOR_SET.stat().st_mtime < proto.stat().st_mtime:
            return True
    return False


def generate() -> None:
    """Run protoc over every proto file into ``gridserve/api/``; raise RuntimeError when it fails."""
    from grpc_tools import protoc

    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{THIRD_PARTY}",
            f"-I{_grpc_tools_include()}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--descriptor_set_out={DESCRIPTOR_SET}",
            "--include_imports",
            "--include_source_info",
            *files,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {files}")
        API_DIR.mkdir(exist_ok=True)
        (API_DIR / "__init__.py").write_text('"""Generated protobuf / gRPC code (never committed)."""\n')
        for name in GENERATED:
            shutil.rmtree(API_DIR / name, ignore_errors=True)
            shutil.copytree(Path(tmp) / "gridserve" / name, API_DIR / name)
    for path in (p for p in API_DIR.rglob("*") if p.suffix in (".py", ".pyi")):
        path.write_text(_IMPORT.sub(r"\1 gridserve.api.\2.", path.read_text()))
    for name in GENERATED:
        for folder in (API_DIR / name, *(API_DIR / name).glob("v*")):
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
