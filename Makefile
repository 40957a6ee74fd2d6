# pagestream — set-up, run, test, benchmarks.  `make run` and `make test` do all the set-up.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=

# The one place torch's build is chosen: where nvidia-smi sees a GPU, the default (CUDA)
# wheel; elsewhere the CPU build 2.13.0 (an unpinned `torch` would pull a multi-GB CUDA
# build onto a CPU-only machine).  Override with `make setup TORCH_SPEC=...`.
TORCH_SPEC ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0)

.PHONY: setup run test test-fast lint format bench bench-serve gpu-check gpu-bench compose-check fleet k8s-check clean

setup: $(VENV)/.stamp

$(VENV)/.stamp: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test,clients]"
	touch $@

# tcmalloc under the server where Debian's libtcmalloc-minimal4 is installed (as the image
# does; docker/entrypoint.sh says why); an LD_PRELOAD already set wins.
TCMALLOC := $(firstword $(wildcard /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4))
RUN_PRELOAD := $(if $(LD_PRELOAD),,$(if $(TCMALLOC),LD_PRELOAD=$(TCMALLOC)))

# The shipped default model (committed); the server never trains it at start-up, so a
# tree without it gets it here first (a few CPU minutes, once).
DEFAULT_MODEL := modelkit/pair/target/config.json
$(DEFAULT_MODEL): | $(VENV)/.stamp
	$(PY) -m service.cli train-pair modelkit/pair

run: setup $(DEFAULT_MODEL)
	@echo "pagestream: serving on http://$(HOST):$(PORT)/  (chat page at /, OpenAI API at /v1)"
	$(RUN_PRELOAD) $(PY) -m service.cli serve --host $(HOST) --port $(PORT) $(ARGS)

# Two passes (tests/conftest.py says which tests run alone and why); exit status 5 is a
# pass that selected nothing (ARGS naming tests of one kind only).
test: setup
	$(PY) -m pytest tests -m "not alone" -n 2 --dist loadfile $(ARGS) || [ $$? -eq 5 ]
	$(PY) -m pytest tests -m alone $(ARGS) || [ $$? -eq 5 ]

test-fast: setup
	$(PY) -m pytest tests -m "not slow" $(ARGS)

lint: setup
	$(VENV)/bin/ruff check service scheduler gpu tests bench modelkit
	$(VENV)/bin/ruff format --check service scheduler gpu tests bench modelkit

format: setup
	$(VENV)/bin/ruff check --fix service scheduler gpu tests bench modelkit
	$(VENV)/bin/ruff format service scheduler gpu tests bench modelkit

bench: setup
	$(PY) -m bench.run $(ARGS)

bench-serve: setup
	$(PY) -m service.cli bench serve $(ARGS)

# For a machine with a CUDA GPU: native kernel tests at real sizes, bandwidth, e2e decode.
gpu-check: setup
	$(PY) -m bench.gpu_check $(ARGS)

# For a CUDA GPU: pagestream serve under load (1B and 8B shapes, random weights written
# there) at concurrency 1/16/64/256, beside the decode roofline (bench/gpu_serve.py).
gpu-bench: setup
	$(PY) -m bench.gpu_serve $(ARGS)

# The compose topology on loopback: redis-server, 3 replicas, nginx with docker/nginx.conf.
# Prints per-replica request counts, Redis-hit TTFT vs cold, and the failover timeline.
fleet: setup
	PYTHONPATH=$(CURDIR) $(PY) -m bench.fleet_checks $(ARGS)

compose-check:
	docker-compose -f docker/docker-compose.yml config -q
	docker-compose -f docker/docker-compose.yml -f docker/docker-compose.cuda.yml config -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build *.egg-info
