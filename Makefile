# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PG_BIN := $(firstword $(wildcard /usr/lib/postgresql/*/bin))

.PHONY: demo test venv servers lint bench simulate fuzz explore mutation clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

venv: $(BIN)/.installed

# Debian's PostgreSQL and Redis servers for the integration tests, promtool (Debian's prometheus) for the
# alert rules and nginx for the public front (apt-get update once, then install what is missing).
NGINX := $(firstword $(wildcard /usr/sbin/nginx) $(shell command -v nginx 2>/dev/null))
servers:
	@if ! command -v redis-server >/dev/null 2>&1 || [ -z "$(PG_BIN)" ] || ! command -v promtool >/dev/null 2>&1 \
			|| [ -z "$(NGINX)" ]; then \
		$(SUDO) apt-get update -qq && \
		$(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			postgresql redis-server prometheus nginx >/dev/null; \
	fi
	@command -v redis-server >/dev/null && ls /usr/lib/postgresql/*/bin/initdb >/dev/null && command -v promtool >/dev/null \
		&& ls /usr/sbin/nginx >/dev/null

lint: venv servers
	$(BIN)/ruff check .
	promtool check rules prometheus/alerts.yml
	cd prometheus && promtool test rules alerts_test.yml

# One worker per core and one more, at most eight (pytest-xdist; three on the 2-core CI machine): much of the
# suite waits on servers and processes it starts, so a third worker on two cores took the suite from 17 to
# 13.5 minutes. Each worker starts its own PostgreSQL and Redis. The longest tests go first
# (tests/conftest.py) and an idle worker steals queued tests from a busy one, so none waits at the end;
# `--durations` prints the slowest. PYTEST_WORKERS=0 runs in one process.
WORKERS := $(shell n=$$(nproc 2>/dev/null || echo 2); n=$$((n + 1)); [ $$n -gt 8 ] && n=8; echo $$n)
test: venv servers lint
	$(BIN)/pytest -p no:cacheprovider --basetemp=.pytest-tmp -n $${PYTEST_WORKERS:-$(WORKERS)} --dist worksteal \
		--durations=15 $(PYTEST_ARGS)

demo: venv
	$(BIN)/billingctl demo

# The simulation at ten times the size `make test` runs: ten seeds instead of one, each through 40 days in
# process and 33 days in separate processes (gunicorn, a process per job started cold, infrastructure faults).
simulate: venv servers
	SIM_DAYS=$${SIM_DAYS:-40} SIM_PROCESS_DAYS=$${SIM_PROCESS_DAYS:-33} SIM_SKEWS=$${SIM_SKEWS:-7,-90} \
		SIM_SEEDS=$${SIM_SEEDS:-1,2,3,4,5,6,7,8,9,10} BILLING_TEST_CLI=$${BILLING_TEST_CLI:-fresh} $(BIN)/pytest -p no:cacheprovider -n 2 \
		--basetemp=.pytest-tmp tests/simulation

# The signed-webhook fuzzer at its longer target: 3,400 mutated bodies per receiver (20,400), on PostgreSQL.
fuzz: venv servers
	FUZZ_EXAMPLES=$${FUZZ_EXAMPLES:-3400} $(BIN)/pytest -p no:cacheprovider -n 2 --basetemp=.pytest-tmp \
		tests/e2e/test_webhook_fuzz.py -s

# The model-based exploration at its long target: 2,000 histories the machine chooses (make test runs 8),
# each audited against the outside world's books with reconcile required to agree (docs/reliability.md), on
# the embedded container and on production's (EXPLORE_MODE=in_process or production runs one of them).
explore: venv servers
	EXPLORE_EXAMPLES=$${EXPLORE_EXAMPLES:-2000} $(BIN)/pytest -p no:cacheprovider --basetemp=.pytest-tmp \
		tests/reliability/test_exploration.py -s

# Mutation testing of the money and security modules (mutmut; the score is in docs/reliability.md). The
# tests' files (SQLite databases, the sandbox's) go to memory when /dev/shm has a gigabyte free (a
# container's is often 64 MB): on a disk, the fsync of every commit made each mutant wait (decision 100).
MEMORY_TMP = $(shell d=/dev/shm/billingctl-tmp-$$(id -u); \
	[ "$$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2 {print $$4}')" -ge 1048576 ] 2>/dev/null && mkdir -p $$d \
	&& echo $$d || echo $${TMPDIR:-/tmp})
mutation: venv servers
	rm -rf mutants
	TMPDIR=$(MEMORY_TMP) $(BIN)/mutmut run --max-children 2
	$(BIN)/python scripts/mutation_report.py

bench: venv servers
	@command -v wrk >/dev/null || \
		($(SUDO) apt-get update -qq && $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null)
	$(BIN)/pip install -q pyinstrument
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .pytest-tmp mutants billing.db billing-sandbox.db
