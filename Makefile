VENV := .venv
PY := $(VENV)/bin/python
# Training needs only the package; the tests and the PyTorch comparisons add the test extra.
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: train test bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test]'
	touch $(TEST_STAMP)

# --resume: a stopped `make train` continues where it stopped; a fresh one starts from step 0.
train: $(STAMP)
	$(VENV)/bin/jaxgpt train --out runs/default --resume

bench: $(TEST_STAMP)
	$(VENV)/bin/jaxgpt bench train --config experiments/day1.toml --repeats 3
	$(PY) scripts/bench_vs_torch.py

test: $(TEST_STAMP)
	$(PY) -m pytest -x -n 3

clean:
	rm -rf $(VENV) runs
