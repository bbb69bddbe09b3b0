# weenv: `make demo` and `make test` do all set-up on a fresh Debian 12 machine as root.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# docker.io: tests and benchmarks start their own dockerd (private socket and data root, no bridge, no
# iptables) as an image producer; the package's own service is not used.
APT_PACKAGES := fuse3 libfuse3-dev pkg-config gcc docker-registry crun busybox-static zstd \
	mmdebstrap skopeo umoci iproute2 nftables git catatonit libc6-dev runsc prometheus docker.io
# podman: a peer in the benchmarks only (benchmarks/_peers.py: private --root/--runroot, cgroupfs, no network),
# installed by `make bench` / `make bench-quick`, so that `make test` does not grow.
BENCH_APT_PACKAGES := podman
PYTEST_ARGS ?=

.PHONY: setup apt bench-apt venv corpus-inputs demo test bench bench-quick soak soak-quick clean

setup: apt venv

# Installs only what is missing, so a second run costs a dpkg query.
define apt_install
	@missing=$$(for p in $(1); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null \
		| grep -q 'install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing apt packages:" $$missing; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -qq && apt-get install -y -qq $$missing >/dev/null; \
	fi
endef

apt:
	$(call apt_install,$(APT_PACKAGES))

bench-apt:
	$(call apt_install,$(BENCH_APT_PACKAGES))

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,cluster]'
	touch $@

# What the image-intake tests fetch from outside 127.0.0.1, fetched here into the fixture cache
# ($$WEENV_FIXTURE_CACHE): the corpus base (mmdebstrap: Debian minbase + python3 + pip) and the
# wheels its Dockerfiles install with `pip install --no-index` (pip download, this machine's pip config), and the
# plain minbase tar tests/test_registry_image.py imports.
corpus-inputs: venv
	$(PY) -m tests.fixtures_docker prefetch

demo: setup
	$(VENV)/bin/weenv demo

test: setup corpus-inputs
	$(PY) -m pytest $(PYTEST_ARGS)

bench: setup bench-apt corpus-inputs
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m benchmarks.run

bench-quick: setup bench-apt corpus-inputs
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m benchmarks.run --quick --no-docs

# the reliability campaign: 1,000 env lifecycles, then the fault matrix and fuzz targets; docs/reliability.md
soak: setup
	$(PY) -m benchmarks.soak

soak-quick: setup
	$(PY) -m benchmarks.soak --quick

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
