# gdsdata: make demo | make test | make bench | make bench-gpu
PYTHON ?= python3
VENV ?= .venv
# torch and torchvision from PyPI: on Linux x86_64 these are the CUDA 13 builds, which also run on a
# machine without a GPU (CI's). Override for another build, e.g. a CPU-only one from PyTorch's index:
#   make TORCH="torch torchvision --index-url https://download.pytorch.org/whl/cpu" test
TORCH ?= torch==2.14.1 torchvision==0.29.1
EXTRAS ?= test,bench
PY := $(VENV)/bin/python

.PHONY: demo test test-gpu bench bench-gpu fuzz clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

demo: $(VENV)/.installed
	$(PY) bench/demo.py

test: $(VENV)/.installed
	$(VENV)/bin/ruff check gdsdata bench tests tools examples
	$(PY) -m pytest -q

test-gpu: $(VENV)/.installed
	$(PY) -m pytest -q -m gpu

fuzz: $(VENV)/.installed
	GDSDATA_FUZZ_EXAMPLES=25000 $(PY) -m pytest -q tests/test_fuzz.py

bench: $(VENV)/.installed
	$(PY) bench/run.py --size small --out bench-results

bench-gpu: $(VENV)/.installed
	$(PY) bench/run.py --size full --out bench-results

clean:
	rm -rf demo-data bench-data bench-results .pytest_cache
