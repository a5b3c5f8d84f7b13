VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast fuzz sweep bench clean

$(STAMP): pyproject.toml setup.py constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/demo.py

test: $(STAMP)  # ends with the suite's time and its ten slowest tests
	$(PY) -m pytest -q tests --durations=10

test-fast: $(STAMP)  # one-process tests only: no gloo ranks, no torchrun, nothing slow
	$(PY) -m pytest -q tests -m "not gloo and not torchrun and not slow"

N ?= 5000
fuzz: $(STAMP)  # the differential fuzzer's long mode: N generated models on 2 cores; failures saved in fuzz-failures/
	$(PY) -m tests.fuzz --count $(N) --jobs 2 --out fuzz-failures

sweep: $(STAMP)  # every Hugging Face causal LM at t=2 from a tiny config: the table in README.md and sweep.md
	$(PY) -m tests.hf_sweep --markdown sweep.md --json sweep.json --readme docs/supported.md

bench: $(STAMP)  # the benchmark matrix against the peers: the table and plot in benchmarks/README.md
	$(PY) benchmarks/matrix.py --readme benchmarks/README.md --plot benchmarks/matrix.png

clean:
	rm -rf $(VENV) build *.egg-info
