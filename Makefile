# The two commands of the README: `make demo` and `make test`. Both start with
# `setup`, which installs the pinned CPU PJRT plugin into .plugins/ (once).

CARGO ?= cargo
PYTHON ?= python3
# XLA's INFO logs are noise in test output; errors reach us through PJRT.
export TF_CPP_MIN_LOG_LEVEL ?= 3

.PHONY: setup setup-targets demo test lint build clean-plugins fuzz

setup:
	@$(PYTHON) scripts/install_cpu_plugin.py

# XLA's CUDA and ROCm compilers, for compiling GPU programs without a GPU
# (.plugins/cuda, .plugins/rocm; once). Downloads about 380 MB the first time.
setup-targets:
	@$(PYTHON) scripts/install_gpu_compilers.py

build:
	$(CARGO) build --release --locked

# The main job: LoRA-finetune the tiny model on the bundled task (write a
# word in capitals) and show a generation before and after; then DPO on
# the task's pairs (the word in capitals preferred over the word echoed),
# the held-out share of pairs the model prefers rising from about half to
# all. Then GRPO: from a short SFT (600 steps, few words exactly right),
# the model samples 8 completions of each prompt itself and learns from an
# exact-match reward alone; the share of completions exactly right rises
# (demo-grpo-out/reward.svg). Each run replaces the last one's demo-out/,
# demo-dpo-out/, demo-sft-short/ and demo-grpo-out/ (--overwrite).
demo: setup build
	./target/release/hlo-train devices --devices 8
	./target/release/hlo-train train --batch 16 --seq 16 --steps 1500 --lr 2e-3 \
		--schedule cosine --warmup 50 --lora-rank 16 --lora-alpha 32 --log-every 250 \
		--out demo-out --overwrite --metrics demo-out/metrics.jsonl
	./target/release/hlo-train train --objective dpo --batch 16 --seq 16 --steps 60 --lr 3e-3 \
		--lora-rank 16 --lora-alpha 32 --eval-every 20 --log-every 20 \
		--out demo-dpo-out --overwrite --metrics demo-dpo-out/metrics.jsonl
	./target/release/hlo-train train --batch 16 --seq 16 --steps 600 --lr 2e-3 \
		--schedule cosine --warmup 50 --lora-rank 16 --lora-alpha 32 --log-every 300 \
		--out demo-sft-short --overwrite
	./target/release/hlo-train train --objective grpo --init-adapter demo-sft-short \
		--reward accuracy --num-generations 8 --batch 64 --seq 16 --max-completion-length 8 \
		--temperature 0.5 --steps 400 --lr 1e-3 --warmup 20 --log-every 50 --log-completions 1 \
		--out demo-grpo-out --overwrite --metrics demo-grpo-out/metrics.jsonl

# Every test, the server through the official `openai` Python client and
# a run's event files through the `tensorboard` package (both installed
# into .plugins/python once), then the Rust API example (a LoRA finetune
# whose loss must fall).
test: setup setup-targets lint
	$(CARGO) test --workspace --locked
	$(PYTHON) scripts/serve_openai_check.py target/debug/hlo-train
	$(PYTHON) scripts/tensorboard_check.py target/debug/hlo-train
	$(CARGO) run --release --locked --example finetune

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings
	$(PYTHON) scripts/longest_functions.py --top 5 $(wildcard */src */examples */benches)

clean-plugins:
	rm -rf .plugins

# Not part of `make test`: needs a nightly toolchain and cargo-fuzz
# (`cargo install cargo-fuzz`). Runs each parser's fuzz target for
# FUZZ_SECONDS (60) seconds; a crash stops with its input in fuzz/artifacts/.
FUZZ_SECONDS ?= 60
FUZZ_TARGETS = safetensors_header jsonl_line hf_config mesh_spec
fuzz:
	cd fuzz && for t in $(FUZZ_TARGETS); do \
		cargo +nightly fuzz run -O $$t -- -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=4096 || exit 1; \
	done
