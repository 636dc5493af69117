# gshard developer entry points. Needs only Python 3.11 and make.
#   make venv   create .venv (if missing) and install gshard[test] with exact pins
#   make test   run the test suite on 8 emulated CPU devices, in 2 worker
#               processes (pytest-xdist; each has its own 8 devices): a file
#               runs in one worker. PYTEST_WORKERS=0 runs in this process;
#               PYTEST_ARGS adds arguments (make test PYTEST_ARGS=tests/test_moe.py)
#   make demo   run examples/demo.py
#   make bench  run the benchmarks and write docs/benchmarks*.md
#   make fuzz   random programs through gshard and GSPMD (FUZZ_EXAMPLES=2000,
#               FUZZ_SEED=random); failing repros go to fuzz-failures.txt
#   make clean  remove caches and build artifacts (keeps .venv; see distclean)

PYTHON ?= python3.11
PYTEST_WORKERS ?= 2
PYTEST_ARGS ?=
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv test demo bench fuzz clean distclean

venv: $(STAMP)

# Create the venv only when its interpreter is missing.
$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall only when the dependency declarations change. The venv's python is
# an order-only prerequisite so its mtime never forces a reinstall. No
# byte-compiling at install (a third of its time): Python compiles the modules
# a run imports, once.
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install --no-compile -c constraints.txt -e '.[test]'
	touch $@

test: venv
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --durations=30 $(PYTEST_ARGS)

demo: venv
	$(PY) examples/demo.py

bench: venv
	$(PY) benchmarks/scaling.py
	$(PY) benchmarks/first_step.py
	$(PY) benchmarks/moe.py --devices 2,4,8,16,32
	$(PY) benchmarks/pipeline.py
	$(PY) benchmarks/run.py
	$(PY) benchmarks/client.py
	$(PY) benchmarks/windowed.py
	$(PY) benchmarks/accumulate.py
	$(PY) benchmarks/dispatch.py
	$(PY) benchmarks/auto.py
	$(PY) benchmarks/layouts.py

FUZZ_EXAMPLES ?= 2000
FUZZ_SEED     ?=
fuzz: venv
	$(PY) tests/fuzz_main.py --examples $(FUZZ_EXAMPLES) $(if $(FUZZ_SEED),--seed $(FUZZ_SEED)) --out fuzz-failures.txt

clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis $(STAMP)
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
