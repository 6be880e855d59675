# acp development tasks. `make help` lists them.
# `make demo` and `make test` are the two commands of README.md: on a fresh
# machine each one sets up everything it needs (venv, torch, the wheel).

VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

# What the test suite and the demo need besides the wheel itself. MindSpore
# 2.10.0 (CPU wheel, CPython 3.11 x86-64) is built against NumPy 1.26: with
# NumPy 2 its bf16 asnumpy() and parts of the package fail, so NumPy stays
# below 2 (torch 2.15 runs with either).
PY_DEPS := "torch==2.15.*" "numpy>=1.26,<2" "mindspore==2.10.0" "safetensors>=0.4" "pytest>=8" "pytest-timeout>=2" "ruff>=0.6" "mypy>=1.10" "maturin>=1.7,<2" "matplotlib>=3.8"
# Packages installed for the data they ship, not their code (so without
# their dependencies): resemblyzer's wheel carries a trained speaker encoder
# with its Adam state (pretrained.pt), the real model of the compression
# test and bench (read with torch.load(weights_only=True), never imported).
PY_DATA_DEPS := "resemblyzer==0.1.4"

.PHONY: help venv sysdeps build-dev fmt lint cargo-deny deny deny-advisories test test-rust test-py demo bench bench-compare bench-scaling bench-goodput benchmarks torture-full fuzz-build fuzz-smoke clean

help: ## Show this help.
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

# The packages are installed by uv (from PyPI, into the venv), not pip: the
# same wheels in 95 s instead of 217 s on this project's 2-core machines
# (torch, its CUDA libraries and MindSpore are 8 GB unpacked; pip unpacks
# and byte-compiles them on one core). Bytecode is still compiled at install
# (--compile-bytecode), as pip does: where it is not written at import
# (PYTHONDONTWRITEBYTECODE), every process would compile torch again.
UV := $(PY) -m uv pip install -q --python $(PY) --compile-bytecode

$(VENV)/.deps: Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check "uv>=0.5"
	$(UV) $(PY_DEPS)
	$(UV) --no-deps $(PY_DATA_DEPS)
	touch $@

venv: $(VENV)/.deps sysdeps ## Create .venv with torch, pytest, ruff, mypy, maturin.

# fio measures the raw O_DIRECT baselines of the benchmarks (and their test).
# Installed from Debian's packages when missing and we may; else a note.
sysdeps:
	@command -v fio >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing fio (apt-get)"; \
	    apt-get install -y -q fio >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q fio >/dev/null 2>&1; } || echo "note: could not install fio; raw disk baselines use a Python O_DIRECT loop"; \
	  else echo "note: fio is not installed (apt-get install fio); raw disk baselines use a Python O_DIRECT loop"; fi; }

# After the build, the package's bytecode, as pip writes it when it installs
# a wheel: a development install is imported from python/, and where bytecode
# is not written at import (PYTHONDONTWRITEBYTECODE, as in CI) every process
# would compile acp's sources again, 20 ms and more inside a restarted
# process's first load, which the benchmarks and the demo time.
build-dev: venv ## Build the wheel (release, with fault injection for the tests) and install it into .venv.
	cd $(CURDIR) && $(VENV)/bin/maturin develop --release -q --features test-util
	$(PY) -m compileall -q python/acp

# examples/*.rs are include!d by acp-core's example and tests, which
# `cargo fmt` does not follow: they are formatted by name.
EXAMPLES_RS := $(wildcard examples/*.rs)

fmt: ## Format Rust and Python code.
	cargo fmt --all
	rustfmt --edition 2021 $(EXAMPLES_RS)
	$(VENV)/bin/ruff format

lint: venv ## fmt check, clippy -D warnings, rustdoc -D warnings, cargo deny (where installed), ruff, mypy --strict.
	cargo fmt --all -- --check
	rustfmt --check --edition 2021 $(EXAMPLES_RS)
	# One clippy run, with the `acp` binary's feature: nothing is compiled
	# only without it (the wheel's build and rustdoc compile without it).
	cargo clippy --workspace --all-targets --features acp-core/cli -- -D warnings
	RUSTDOCFLAGS='-D warnings' cargo doc -p acp-core --no-deps -q
	@if cargo deny --version >/dev/null 2>&1; then $(DENY_OFFLINE); \
	 else echo "note: cargo-deny is not installed: \`make deny\` installs it and runs the checks"; fi
	$(VENV)/bin/ruff check
	$(VENV)/bin/ruff format --check
	MYPYPATH=python $(VENV)/bin/mypy --strict

# cargo-deny checks the dependency tree against deny.toml: the checks that
# need no network: licences, duplicate versions (warned),
# sources (crates.io only). The RustSec advisories need the advisory database
# from GitHub, so they are a target of their own, `make deny-advisories`, to
# run where the network allows (a CI job with network access, a laptop).
# `make lint` runs them when cargo-deny is installed and says so when it is
# not; `make deny` installs a missing cargo-deny first (a one-off compile of
# about 5 minutes on 2 shared cores, which would put the test command's CI
# run near its 30-minute limit).
CARGO_DENY_VERSION := 0.20.2
DENY_OFFLINE := cargo deny check --hide-inclusion-graph licenses bans sources

cargo-deny:
	@cargo deny --version >/dev/null 2>&1 || { \
	  echo "installing cargo-deny $(CARGO_DENY_VERSION) (cargo install; a few minutes, once)"; \
	  cargo install cargo-deny --locked --version $(CARGO_DENY_VERSION); }

deny: cargo-deny ## cargo deny: licences, duplicate versions, sources (no network).
	$(DENY_OFFLINE)

deny-advisories: cargo-deny ## cargo deny: RustSec advisories (fetches their database from GitHub).
	cargo deny check --hide-inclusion-graph advisories

test-rust: ## Rust unit, integration and doc tests (and the acp binary's).
	cargo test --workspace --features acp-core/cli

test-py: build-dev ## The pytest suite against the built wheel.
	$(PY) -m pytest

test: lint test-rust test-py ## Everything CI runs: lint, Rust tests, Python tests.

demo: build-dev ## Train a small model, SIGKILL it, resume from RAM, print the figures.
	$(PY) -m acp.demo

bench: ## Criterion benchmarks (ACP_BENCH_GIB=1 for 1 GiB sizes).
	cargo bench -p acp-bench

# The published figures (BENCHMARKS.md). Each writes Markdown, JSON (and
# PNG plots) under acp-bench/results/. Raw O_DIRECT baselines use fio when it
# is installed (apt-get install fio), else a Python O_DIRECT loop (said so).
RESULTS := acp-bench/results
COMPARE_ARGS ?= --size-gib 0.25 1 --repeats 5
SCALING_ARGS ?=
GOODPUT_ARGS ?=

bench-compare: build-dev ## acp next to torch.save, safetensors, DCP, MindSpore and the raw baselines, with a verdict line per issue-16 target (and a replaced node's restore).
	$(PY) acp-bench/peers/compare.py $(COMPARE_ARGS) --out $(RESULTS)/compare
	$(PY) acp-bench/peers/per_tensor.py --count 100000 --no-load | tee $(RESULTS)/compare/per_tensor.txt
	$(PY) acp-bench/peers/restart.py --storage --mib 1024 --saves 1 --gap 0 --rounds 3 --out $(RESULTS)/compare/replaced_node

bench-scaling: build-dev ## Stall and flush against state size and tensor count, with PNG plots.
	$(PY) acp-bench/peers/scaling.py $(SCALING_ARGS) --out $(RESULTS)/scaling

bench-goodput: build-dev ## Useful steps per hour of a training job killed at random moments.
	$(PY) acp-bench/peers/goodput.py $(GOODPUT_ARGS) --out $(RESULTS)/goodput

benchmarks: bench bench-compare bench-scaling bench-goodput ## Everything BENCHMARKS.md quotes.
	mkdir -p $(RESULTS) && cargo run --release -p acp-bench --bin report > $(RESULTS)/criterion.md

torture-full: build-dev ## The torture suite at full trial counts; prints the figures of RELIABILITY.md.
	$(PY) tests/torture/run_full.py

# cargo-fuzz targets of acp-core (acp-core/fuzz, its own workspace, nightly).
FUZZ_TARGETS := parse_header index_parse manifest_parse file_name recovery
FUZZ_SECS ?= 12

fuzz-build: ## Build the fuzz targets (needs nightly and `cargo install cargo-fuzz`).
	@cargo +nightly fuzz --version >/dev/null 2>&1 || { echo "fuzz-build: needs the nightly toolchain and cargo-fuzz (cargo install cargo-fuzz)"; exit 1; }
	cd acp-core && cargo +nightly fuzz build

fuzz-smoke: fuzz-build ## Fuzz each target FUZZ_SECS s (12: 60 s in all) from the committed corpus.
	cd acp-core && for t in $(FUZZ_TARGETS); do \
	  mkdir -p fuzz/work/$$t && \
	  cargo +nightly fuzz run $$t fuzz/work/$$t fuzz/corpus/$$t -- \
	    -max_total_time=$(FUZZ_SECS) -rss_limit_mb=2048 -print_final_stats=1 || exit 1; \
	done

clean: ## Remove build outputs and the venv.
	cargo clean
	rm -rf $(VENV) dist
