VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/jaxgpt train --out runs/default

bench: $(STAMP)
	$(VENV)/bin/jaxgpt bench train --config experiments/day1.toml --repeats 3
	$(PY) scripts/bench_vs_torch.py

test: $(STAMP)
	$(PY) -m pytest -x -n 2

clean:
	rm -rf $(VENV) runs
