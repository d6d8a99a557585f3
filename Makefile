# The two commands of the README: `make demo` and `make test`. Both start with
# `setup`, which installs the pinned CPU PJRT plugin into .plugins/ (once).

CARGO ?= cargo
PYTHON ?= python3
# XLA's INFO logs are noise in test output; errors reach us through PJRT.
export TF_CPP_MIN_LOG_LEVEL ?= 3

.PHONY: setup demo test lint build clean-plugins

setup:
	@$(PYTHON) scripts/install_cpu_plugin.py

build:
	$(CARGO) build --release --locked

demo: setup build
	./target/release/hlo-train devices --devices 8

test: setup lint
	$(CARGO) test --workspace --locked

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

clean-plugins:
	rm -rf .plugins
