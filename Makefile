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
# it runs beside the tests. The quiet pass runs even after a failure in the parallel one, and the
# target ends with every failure of both passes (test id and assertion), then fails if either pass
# or mypy found anything.
test: $(STAMP)
	$(BIN)/ruff check gossamer tests bench
	@# Bytecode once, for the hundreds of processes the suite starts (PYTHONDONTWRITEBYTECODE may be set)
	$(BIN)/python -m compileall -q gossamer tests
	rm -f $(VENV)/junit-parallel.xml $(VENV)/junit-quiet.xml
	$(BIN)/mypy gossamer > $(VENV)/mypy.log 2>&1 & mypy=$$!; \
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 -m 'not quiet' \
		--junitxml=$(VENV)/junit-parallel.xml tests; rc=$$?; \
	$(BIN)/pytest -q -m quiet --junitxml=$(VENV)/junit-quiet.xml tests; quiet_rc=$$?; \
	wait $$mypy; mypy_rc=$$?; cat $(VENV)/mypy.log; \
	$(BIN)/python tests/_failures.py $(VENV)/junit-parallel.xml $(VENV)/junit-quiet.xml; \
	echo "parallel pass exit $$rc, quiet pass exit $$quiet_rc, mypy exit $$mypy_rc"; \
	test $$rc -eq 0 && test $$quiet_rc -eq 0 && test $$mypy_rc -eq 0

lint: $(STAMP)
	$(BIN)/ruff check gossamer tests bench
	$(BIN)/mypy gossamer

proto: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. \
		--mypy_out=. --mypy_grpc_out=. protos/gossamer/v1/*.proto

bench: $(STAMP)
	$(BIN)/python -m bench.ps_throughput
	$(BIN)/python -m bench.overhead
	$(BIN)/python -m bench.compression
	$(BIN)/python -m bench.modes
	$(BIN)/python -m bench.recovery
	$(BIN)/python -m bench.intranode

# Needs root (network namespaces, tc): four emulated hosts on 100 Mbit/s and 1 Gbit/s links.
bench-wan: $(STAMP)
	$(BIN)/python -m bench.wan

clean:
	rm -rf $(VENV) build *.egg-info
