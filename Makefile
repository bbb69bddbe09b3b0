# weenv: `make demo` and `make test` do all set-up on a fresh Debian 12 machine as root.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
APT_PACKAGES := fuse3 libfuse3-dev pkg-config gcc docker-registry crun busybox-static zstd \
	mmdebstrap skopeo umoci iproute2 nftables git catatonit libc6-dev runsc prometheus
PYTEST_ARGS ?=

.PHONY: setup apt venv demo test bench bench-quick soak soak-quick clean

setup: apt venv

# Installs only what is missing, so a second run costs a dpkg query.
apt:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null \
		| grep -q 'install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing apt packages:" $$missing; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -qq && apt-get install -y -qq $$missing >/dev/null; \
	fi

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,cluster]'
	touch $@

demo: setup
	$(VENV)/bin/weenv demo

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

bench: setup
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m benchmarks.run

bench-quick: setup
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m benchmarks.run --quick --no-docs

# the reliability campaign: 1,000 env lifecycles, then the fault matrix and fuzz targets; docs/reliability.md
soak: setup
	$(PY) -m benchmarks.soak

soak-quick: setup
	$(PY) -m benchmarks.soak --quick

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
