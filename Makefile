# gossamer: `make demo` and `make test` work on a fresh machine (they create .venv).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pytest-xdist workers for the suite: three on two cores, since a multi-process test spends much of
# its time waiting on its processes; files go out in collection order (chaos and integration, the
# long ones, first; the many short unit files last fill the gaps at the end)
TEST_WORKERS ?= 3

.PHONY: demo test lint proto bench bench-wan clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	@# editable installs from pyproject need pip >= 21.3: upgrade only an older one (Python 3.10.0's)
	$(BIN)/python -c "import pip, sys; sys.exit(tuple(map(int, pip.__version__.split('.')[:2])) < (21, 3))" \
		|| $(BIN)/pip install -q --upgrade pip
	# one resolve, the pinned CPU build in it, so nothing pulls a multi-GB CUDA torch
	$(BIN)/pip install -q torch==2.13.0 -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gossamer demo

# mypy is single-threaded and the suite leaves part of the CPU idle (processes waiting on each other):
# it runs beside the tests, and the target fails after them if it found anything.
test: $(STAMP)
	$(BIN)/ruff check gossamer tests bench
	@# Bytecode once, for the hundreds of processes the suite starts (PYTHONDONTWRITEBYTECODE may be set)
	$(BIN)/python -m compileall -q gossamer tests
	$(BIN)/mypy gossamer > $(VENV)/mypy.log 2>&1 & mypy=$$!; \
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 -m 'not quiet' tests; rc=$$?; \
	wait $$mypy; mypy_rc=$$?; cat $(VENV)/mypy.log; \
	test $$rc -eq 0 && test $$mypy_rc -eq 0
	$(BIN)/pytest -q -m quiet tests

lint: $(STAMP)
	$(BIN)/ruff check gossamer tests bench
	$(BIN)/mypy gossamer

proto: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. \
		--mypy_out=. --mypy_grpc_out=. protos/gossamer/v1/*.proto

bench: $(STAMP)
	$(BIN)/python bench/ps_throughput.py
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/compression.py
	$(BIN)/python bench/modes.py
	$(BIN)/python bench/recovery.py
	$(BIN)/python bench/intranode.py

# Needs root (network namespaces, tc): four emulated hosts on 100 Mbit/s and 1 Gbit/s links.
bench-wan: $(STAMP)
	$(BIN)/python bench/wan.py

clean:
	rm -rf $(VENV) build *.egg-info
