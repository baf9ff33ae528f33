# The two commands of the README:  `make run`  and  `make test`.
# Both create .venv and install streamflow with what it needs, on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-dev

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/streamflow run jobs/ipv.py --events jobs/data/taobao_user_behavior_10k.csv --db out/ipv.duckdb --replace

lint: $(STAMP)
	$(PY) -m ruff check .

test: lint
	$(PY) -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest: no tests collected"; rc=0; fi; exit $$rc

bench: $(STAMP)
	$(PY) -m bench.triggers --quick
	$(PY) -m bench.device --quick

clean:
	rm -rf $(VENV) out .pytest_cache .ruff_cache
