# Infinijup: `make lab` sets everything up and starts JupyterLab; `make test` sets up and tests.
# Each set-up step leaves a stamp under .stamps/ so a second run skips what is already done.

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
JLPM := $(VENV)/bin/jlpm
CRIU_PREFIX ?= /opt/infinijup/criu
HELPER_SOCKET ?= /run/infinijup/helper.sock
HELPER_PIDFILE ?= /run/infinijup/helper.pid
HELPER_LOG ?= /var/log/infinijup-helper.log
HELPER_PREFIX ?= /opt/infinijup/helper
LAB_PORT ?= 8888
LAB_IP ?= 127.0.0.1
# where `make lab` keeps notebooks (not the checkout: new notebooks would land in the repo)
LAB_DIR ?= $(HOME)/notebooks
STAMPS := .stamps
# lines of a failed test-python printed again after the browser suites' output
PYTHON_TAIL := 250
SYSTEM_PACKAGES := python3 python3-venv python3-dev build-essential git iproute2 util-linux procps ca-certificates
TEST_SYSTEM_PACKAGES := chromium

export INFINIJUP_CRIU := $(CRIU_PREFIX)/sbin/criu
export INFINIJUP_PYCRIU := $(CRIU_PREFIX)/python

.PHONY: lab test setup system-deps criu venv frontend helper helper-stop test-python test-frontend test-ui test-reliability bench-ui soak lint clean

lab: setup helper
	@mkdir -p "$(LAB_DIR)"
	@echo "Starting JupyterLab with Infinijup on http://$(LAB_IP):$(LAB_PORT)/lab, notebooks in $(LAB_DIR)"
	$(VENV)/bin/jupyter lab --ip=$(LAB_IP) --port=$(LAB_PORT) --no-browser --ServerApp.root_dir="$(LAB_DIR)" $(if $(filter 0,$(shell id -u)),--allow-root,)

# Lint first; then the Python suite and the browser suites (jest, then Galata) run side by side.
# They share nothing but the machine: the Python tests start their own helpers, servers and stores;
# the UI tests use the helper of `make helper` and a server and store of their own. The browser
# suites' output is printed after the Python suite's, and then, if the Python suite failed, its
# last lines again (CI shows the end of the output); `make test` fails if either side failed.
test: setup helper
	$(MAKE) lint
	@log=$$(mktemp /tmp/infinijup-test-browser.XXXXXX); pylog=$$(mktemp /tmp/infinijup-test-python.XXXXXX); \
	( $(MAKE) --no-print-directory test-frontend && $(MAKE) --no-print-directory test-ui ) >"$$log" 2>&1 & \
	browser=$$!; \
	$(MAKE) test-python 2>&1 | tee "$$pylog"; python=$${PIPESTATUS[0]}; \
	wait $$browser; browser_rc=$$?; \
	echo "--- make test-frontend test-ui (ran beside test-python) ---"; cat "$$log"; rm -f "$$log"; \
	if [ $$python -ne 0 ]; then \
	  echo "--- the last $(PYTHON_TAIL) lines of make test-python again: it failed, and why is above the browser suites' output ---"; \
	  tail -n $(PYTHON_TAIL) "$$pylog"; fi; rm -f "$$pylog"; \
	echo "make test: test-python exit $$python, test-frontend + test-ui exit $$browser_rc"; \
	[ $$python -eq 0 ] && [ $$browser_rc -eq 0 ]

setup: system-deps criu venv frontend $(STAMPS)/install $(STAMPS)/hub-proxy infinijup/gpu/libinfinijup_vmm.so

# --- the VMM allocator PyTorch's GPU memory goes on in kernels (no CUDA needed to build it) ---
VMM_SOURCES = infinijup/gpu/vmm_alloc.c infinijup/gpu/vmm_arena.c
infinijup/gpu/libinfinijup_vmm.so: $(VMM_SOURCES) infinijup/gpu/vmm_alloc.h
	cc -O2 -Wall -shared -fPIC -o $@ $(VMM_SOURCES) -ldl -lpthread

# --- system packages (root) -------------------------------------------------------------
system-deps: $(STAMPS)/system-deps
$(STAMPS)/system-deps:
	@scripts/require-root.sh "installing system packages" "sudo make system-deps"
	@missing=$$(for p in $(SYSTEM_PACKAGES) $(TEST_SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	command -v node >/dev/null 2>&1 || missing="$$missing nodejs npm"; \
	if [ -n "$$missing" ]; then \
	  echo "installing:" $$missing; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
	@mkdir -p $(STAMPS) && touch $@

# --- CRIU >= 4.2 (root to build/install) --------------------------------------------------
criu:
	@scripts/setup-criu.sh $(CRIU_PREFIX)

# --- Python virtualenv -------------------------------------------------------------------
venv: $(STAMPS)/venv
$(STAMPS)/venv: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "jupyterlab>=4.4,<5" "hatchling>=1.21" "hatch-nodejs-version>=0.3.2" "hatch-jupyter-builder>=0.9" editables
	@mkdir -p $(STAMPS) && touch $@

# --- the JupyterLab extension (TypeScript) -----------------------------------------------
frontend: $(STAMPS)/frontend
$(STAMPS)/frontend: $(STAMPS)/venv package.json $(wildcard yarn.lock) $(shell find labextension -type f 2>/dev/null) tsconfig.json
	PATH=$(abspath $(VENV))/bin:$$PATH $(JLPM) install --immutable
	PATH=$(abspath $(VENV))/bin:$$PATH $(JLPM) build:prod
	@mkdir -p $(STAMPS) && touch $@

# --- the Python package, server extension, kernelspec ------------------------------------
$(STAMPS)/install: $(STAMPS)/venv $(STAMPS)/frontend pyproject.toml
	PATH=$(abspath $(VENV))/bin:$$PATH $(PY) -m pip install -q --no-build-isolation -e ".[test,gpu]"
	@echo "$(CRIU_PREFIX)/python" > $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/infinijup-pycriu.pth
	PATH=$(abspath $(VENV))/bin:$$PATH $(VENV)/bin/jupyter labextension develop --overwrite . >/dev/null
	$(VENV)/bin/jupyter server extension enable --sys-prefix infinijup >/dev/null
	$(VENV)/bin/jupyter kernelspec install --sys-prefix --name infinijup jupyter-config/kernels/infinijup >/dev/null
	@mkdir -p $(STAMPS) && touch $@

# --- JupyterHub's proxy for tests/hub (configurable-http-proxy, node; kept in the checkout) ---
$(STAMPS)/hub-proxy: tests/hub/proxy/package.json $(wildcard tests/hub/proxy/package-lock.json)
	cd tests/hub/proxy && npm ci --no-audit --no-fund --loglevel=error
	@mkdir -p $(STAMPS) && touch $@

# --- the privileged helper (root) --------------------------------------------------------
# Root never runs the checkout or its venv (whoever can write those would be root): the helper
# is copied to $(HELPER_PREFIX), root-owned, and runs from there (scripts/install_helper.py).
# A helper already running from an older install is restarted (kernels keep running across a
# helper restart): the digest of the installed code it started from is kept beside its pidfile.
helper: $(STAMPS)/install
	@scripts/require-root.sh "starting the privileged helper (CRIU needs root)" "sudo make helper"
	@$(PY) scripts/install_helper.py --prefix $(HELPER_PREFIX) >/dev/null
	@build=$$(cd $(HELPER_PREFIX) && find lib bin -type f -not -path '*/__pycache__/*' -print0 \
	  | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16); \
	if [ -f $(HELPER_PIDFILE) ] && ! grep -qx "$$build" $(HELPER_PIDFILE).build 2>/dev/null; then \
	  echo "the installed helper changed: restarting it (running kernels keep running)"; \
	  $(MAKE) --no-print-directory helper-stop; fi; \
	$(HELPER_PREFIX)/bin/infinijup-helper --daemon --socket $(HELPER_SOCKET) --pidfile $(HELPER_PIDFILE) --log $(HELPER_LOG) \
	  && echo "$$build" > $(HELPER_PIDFILE).build

helper-stop:
	@if [ -f $(HELPER_PIDFILE) ]; then pid=$$(cat $(HELPER_PIDFILE)); kill $$pid 2>/dev/null || true; \
	  for i in $$(seq 300); do kill -0 $$pid 2>/dev/null || break; sleep 0.1; done; \
	  rm -f $(HELPER_PIDFILE) $(HELPER_PIDFILE).build; fi

# --- tests -------------------------------------------------------------------------------
lint: $(STAMPS)/install
	$(VENV)/bin/ruff check infinijup infinijup_helper tests bench
	$(VENV)/bin/lint-imports
	PATH=$(abspath $(VENV))/bin:$$PATH $(JLPM) lint:check
	PATH=$(abspath $(VENV))/bin:$$PATH $(JLPM) typecheck

test-python: $(STAMPS)/install
	$(VENV)/bin/pytest -q -p no:cacheprovider

# Issue 7's fault, security, fuzz and soak tests alone (also part of test-python). They kill
# processes at named phases (the helper's hold points, infinijup_helper/holds.py), never after
# a delay, so a busy machine does not change their outcome.
test-reliability: $(STAMPS)/install
	$(VENV)/bin/pytest -q -p no:cacheprovider tests/reliability

test-frontend: $(STAMPS)/frontend
	PATH=$(abspath $(VENV))/bin:$$PATH $(JLPM) test

# The @backend UI tests talk to a real kernel through the helper started by `make helper`.
test-ui: $(STAMPS)/install
	cd ui-tests && PATH=$(abspath $(VENV))/bin:$$PATH $(abspath $(JLPM)) install --immutable
	cd ui-tests && PATH=$(abspath $(VENV))/bin:$$PATH $(abspath $(JLPM)) test

# The long soak (issue 7): `make test` runs the same tests with 20 cycles.
soak: $(STAMPS)/install
	INFINIJUP_SOAK_CYCLES=200 $(VENV)/bin/pytest -p no:cacheprovider -s tests/reliability/test_soak.py

bench-ui: $(STAMPS)/install
	cd ui-tests && PATH=$(abspath $(VENV))/bin:$$PATH $(abspath $(JLPM)) install --immutable
	cd ui-tests && PATH=$(abspath $(VENV))/bin:$$PATH $(abspath $(JLPM)) bench

clean:
	rm -rf $(STAMPS) lib infinijup/labextension node_modules
