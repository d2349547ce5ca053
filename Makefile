# gdsdata: make demo | make test | make bench (CPU tables) | make bench-gpu (GPU tables) | make bench-suite
PYTHON ?= python3
VENV ?= .venv
# torch and torchvision from PyPI: on Linux x86_64 these are the CUDA 13 builds, which also run on a
# machine without a GPU (CI's). Override for another build, e.g. a CPU-only one from PyTorch's index:
#   make TORCH="torch torchvision --index-url https://download.pytorch.org/whl/cpu" test
TORCH ?= torch==2.14.1 torchvision==0.29.1
EXTRAS ?= test,bench
PY := $(VENV)/bin/python

.PHONY: demo test test-oldest test-gpu bench bench-gpu bench-suite fuzz clean

# each install is tried up to 4 times, and pip resumes a download cut off mid-file: a dropped
# connection to PyPI (seen on a CI run, for a 79 MB wheel) should not fail the build
PIP_OPTIONS := install --quiet --retries 10 --timeout 60
PIP := $(PY) -m pip $(PIP_OPTIONS)
RETRY := tools/retry 4 30

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(RETRY) $(PIP) --upgrade pip
	$(RETRY) $(PIP) --resume-retries 20 $(TORCH)
	$(RETRY) $(PIP) --resume-retries 20 -e ".[$(EXTRAS)]"
	touch $@

demo: $(VENV)/.installed
	$(PY) bench/demo.py

test: $(VENV)/.installed
	$(VENV)/bin/ruff check gdsdata bench tests tools examples
	$(PY) -m pytest -q

# the same suite on the oldest releases gdsdata takes (pyproject's floors: Python 3.10 where the
# machine has it, torch 2.4, whose Triton 3.0 the GPU kernels need, and NumPy 1.x), in a virtualenv
# of its own
OLDEST ?= torch==2.4.1 torchvision==0.19.1 "numpy<2"
OLDEST_PYTHON ?= $(shell python3.10 -c '' 2>/dev/null && echo python3.10 || echo $(PYTHON))
OLD_PY := .venv-oldest/bin/python
OLD_PIP := $(OLD_PY) -m pip $(PIP_OPTIONS)

.venv-oldest/.installed: pyproject.toml
	$(OLDEST_PYTHON) -m venv .venv-oldest
	$(RETRY) $(OLD_PIP) --upgrade pip
	$(RETRY) $(OLD_PIP) --resume-retries 20 $(OLDEST)
	$(RETRY) $(OLD_PIP) -e ".[$(EXTRAS)]" $(OLDEST)
	touch $@

test-oldest: .venv-oldest/.installed
	$(OLD_PY) -m pytest -q

test-gpu: $(VENV)/.installed
	$(PY) -m pytest -q -m gpu

fuzz: $(VENV)/.installed
	GDSDATA_FUZZ_EXAMPLES=25000 $(PY) -m pytest -q tests/test_fuzz.py

# the tables of docs/benchmarks.md: the CPU path (FFCV and litdata rows where they are installed) ...
bench: $(VENV)/.installed
	$(PY) bench/cpu.py --dir bench-data/cpu --model --out bench-results/cpu-uint8
	$(PY) bench/cpu.py --dir bench-data/cpu --float --model --out bench-results/cpu-float

# ... and on a GPU machine the training client, the loader alone and cold storage (DALI rows where it imports)
bench-gpu: $(VENV)/.installed
	$(PY) bench/train.py --dir bench-data/train --inputs synthetic,gdsdata,dali,raw,dataloader,gdsdata:nocrc,gdsdata:bilinear \
		--streams current,side --out bench-results/train
	$(PY) bench/train.py --dir bench-data/train --inputs synthetic,gdsdata,gdsdata:direct_block --out bench-results/train-drive
	$(PY) bench/gpu.py --dir bench-data/gpu --out bench-results/gpu
	$(PY) bench/storage.py --dir bench-data/storage --out bench-results/storage

# every pipeline side by side on any machine, small
bench-suite: $(VENV)/.installed
	$(PY) bench/run.py --size small --out bench-results

clean:
	rm -rf demo-data bench-data bench-results .pytest_cache
