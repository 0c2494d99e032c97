# Two entry points that work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0

.PHONY: size demo test test-fast test-avx2 gpu-check lint format bench bench-demo bench-train bench-translate \
	bench-serve bench-study benchmarks-page browser-deps bible-deps docs clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/aiayn demo

# transformers 4 beside the venv's 5, for the Hugging Face export and import tests: 5 removed
# pipeline("translation"), which users of 4 still load exports with. Its other needs are the venv's.
HF4 := $(VENV)/transformers4
$(HF4)/.installed: $(STAMP)
	$(BIN)/pip install --quiet --no-deps --target $(HF4) 'transformers>=4.40,<5' 'huggingface_hub<1' 'tokenizers>=0.19,<0.23'
	touch $@

# The numerics tests once more as an x86-64 CPU with AVX2 alone computes them (no AVX-512, VNNI or
# AMX; CTranslate2 on oneDNN, as on AMD CPUs): PyTorch's, oneDNN's, MKL's and CTranslate2's
# kernels differ by instruction set, and a tolerance tuned on one CPU fails on another. TorchInductor
# gets a cache of its own: kernels it compiled for one instruction set abort under the other.
AVX2_ONLY := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
	CT2_FORCE_CPU_ISA=AVX2 CT2_USE_MKL=0 TORCHINDUCTOR_CACHE_DIR=$$(mktemp -d)
NUMERICS_TESTS := tests/test_model.py tests/test_cache.py tests/test_attention.py tests/test_loss.py \
	tests/test_acceleration.py tests/decode/test_packing.py tests/decode/test_search.py \
	tests/decode/test_translator.py tests/train/test_update.py \
	tests/decode/test_ensemble.py tests/test_optim.py tests/decode/test_alignment.py \
	tests/interop/test_ctranslate2.py tests/interop/test_onnx.py

# tests/cuda skip without a GPU; the second run of them on the CPU (AIAYN_TEST_DEVICE=cpu) proves
# nothing about CUDA but checks the tests' own code, which a lent GPU has no time to debug.
test: $(STAMP) $(HF4)/.installed
	$(BIN)/ruff check src tests bench tools
	$(BIN)/ruff format --check src tests bench tools
	$(BIN)/python -m pytest -q
	$(AVX2_ONLY) $(BIN)/python -m pytest -q -p no:cacheprovider $(NUMERICS_TESTS)
	AIAYN_TEST_DEVICE=cpu $(BIN)/python -m pytest -q -p no:cacheprovider tests/cuda
	PYTHONPATH=$(HF4) $(BIN)/python -c 'import transformers as t; assert t.__version__.startswith("4."), t.__version__'
	PYTHONPATH=$(HF4) $(BIN)/python -m pytest -q -p no:cacheprovider tests/interop/test_marian.py tests/cli/test_interop.py

# The inner loop: ruff, then the suite less what needs minutes: the tests marked slow (training
# end to end, the demo, the benchmark scripts) and tests/integration (`make test` runs them all,
# as CI does). About 4 minutes on a 2-core machine (1600 tests; the slowest, the time-budget
# runs, take ~20 s each).
test-fast: $(STAMP)
	$(BIN)/ruff check src tests bench tools
	$(BIN)/ruff format --check src tests bench tools
	$(BIN)/python -m pytest -q -m "not slow" --ignore tests/integration

# The numerics tests alone, as an AVX2-only CPU runs them (part of `make test`).
test-avx2: $(STAMP)
	$(AVX2_ONLY) $(BIN)/python -m pytest -q -p no:cacheprovider $(NUMERICS_TESTS)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench tools

format: $(STAMP)
	$(BIN)/ruff format src tests bench tools
	$(BIN)/ruff check --fix src tests bench tools

# Benchmarks (bench/, BENCHMARKS.md): each target runs one entry point over bench/runner.py, on an
# otherwise idle machine (it refuses a busy one), and appends one record a run to
# bench/results/TASK.jsonl; `make benchmarks-page` turns the records into BENCHMARKS.md, and
# tests/test_benchmarks_page.py fails until it has. DATA: a folder made by `aiayn prepare
# bible-en-es DATA` (train.*, valid.*); MODEL: a trained model directory (the recipe's, say);
# FAIRSEQ_BIN: the bin/ of a fairseq 0.12.2 install (a tool, not a dependency: without it the
# fairseq row says "not measured"); BENCH_ARGS: more options of the entry point, e.g.
# `--machine NAME --setup NAME` to name the record's table.
#   make bench            the four CPU tasks below, ~35 min (DATA and MODEL)
#   make bench-demo       aiayn demo, the whole command, on the CPU (bench/demo.py)
#   make bench-train      aiayn train vs fairseq-train, 2 rounds of 210 s each (bench/train.py)
#   make bench-translate  aiayn translate vs CTranslate2 (both thread layouts), 3 rounds
#   make bench-serve      aiayn serve under 1, 8 and 32 clients, batching on and off
#   make bench-study      the recipe's own run, fairseq-train's beside it (RUNS=fairseq) or the
#                         small-data study's (RUNS=NAME ...)
FAIRSEQ_BIN ?= /tmp/peers/fairseq/bin
DATA ?=
MODEL ?=
RUNS ?= recipe
STUDY_DIR ?= runs/study
BENCH_ARGS ?=
ifneq ($(filter bench bench-train bench-translate bench-serve bench-study,$(MAKECMDGOALS)),)
ifeq ($(DATA),)
$(error give DATA=DIR, a folder made by `aiayn prepare bible-en-es DIR`)
endif
endif
ifneq ($(filter bench bench-translate bench-serve,$(MAKECMDGOALS)),)
ifeq ($(MODEL),)
$(error give MODEL=DIR, a trained model directory)
endif
endif
bench: bench-demo bench-train bench-translate bench-serve

bench-demo: $(STAMP)
	$(BIN)/python bench/demo.py $(BENCH_ARGS)

bench-train: $(STAMP)
	$(BIN)/python bench/train.py --data $(DATA) --fairseq-bin $(FAIRSEQ_BIN) $(BENCH_ARGS)

bench-translate: $(STAMP)
	$(BIN)/python bench/translate.py -m $(MODEL) --data $(DATA) --variant int8=--int8 \
		--one-line $(BENCH_ARGS)

bench-serve: $(STAMP)
	$(BIN)/python bench/serve.py -m $(MODEL) --texts $(DATA)/valid.en --requests 200 \
		--max-seconds 60 $(BENCH_ARGS)

bench-study: $(STAMP)
	$(BIN)/python bench/study.py run $(DATA) $(STUDY_DIR) $(RUNS) --fairseq-bin $(FAIRSEQ_BIN) \
		$(BENCH_ARGS)

benchmarks-page: $(STAMP)
	$(BIN)/python bench/page.py

# Debian's Chromium and chromedriver for tests/integration/test_browser.py (which skips, saying
# so, where they are missing). Installs with apt-get (as root) only if either is missing.
browser-deps:
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		(apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y \
			chromium chromium-driver)

# Debian's SWORD Bible modules (World English Bible, Reina-Valera 1909) for `aiayn prepare
# bible-en-es` and its end-to-end test in tests/text/prepare/test_bible.py (which skips, saying so,
# where they are missing). Installs with apt-get (as root) only if either is missing.
SWORD_CONF := /usr/share/sword/mods.d
bible-deps:
	test -f $(SWORD_CONF)/engWEB2015eb.conf && test -f $(SWORD_CONF)/spaRV1909eb.conf || \
		(apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y \
			sword-text-web sword-text-sparv)

# Figures of docs/walkthrough.md, drawn by aiayn's own commands from the demo model. The schedule
# is the paper's base model beside the demo's (d_model, warmup_steps, lr_scale), which
# tests/test_demo.py checks against what run_demo trains with.
DEMO_MODEL := demo_run/run/model
FIG := docs/figures
EXAMPLE := four thousand, three hundred and twenty-one
docs: $(STAMP)
	test -f $(DEMO_MODEL)/config.json || $(BIN)/aiayn demo
	mkdir -p $(FIG)
	$(BIN)/aiayn info -m $(DEMO_MODEL) > $(FIG)/demo-model.txt
	$(BIN)/aiayn plot positional-encoding --d-model 128 --length 64 -o $(FIG)/positional-encoding.png
	$(BIN)/aiayn plot schedule --d-model 512 --warmup 4000 --lr-scale 1 \
		--d-model 128 --warmup 200 --lr-scale 0.5 --steps 20000 -o $(FIG)/schedule.png
	$(BIN)/aiayn plot curves demo_run/run -o $(FIG)/demo-curves.png
	$(BIN)/aiayn attention -m $(DEMO_MODEL) "$(EXAMPLE)" -o $(FIG)/alignment.png
	$(BIN)/aiayn attention -m $(DEMO_MODEL) "$(EXAMPLE)" --kind encoder -o $(FIG)/encoder-self-attention.png
	$(BIN)/aiayn attention -m $(DEMO_MODEL) "$(EXAMPLE)" --kind decoder -o $(FIG)/decoder-self-attention.png
	$(BIN)/aiayn attention -m $(DEMO_MODEL) "$(EXAMPLE)" --kind cross -o $(FIG)/encoder-decoder-attention.png
	$(BIN)/python tools/web_page_figure.py -m $(DEMO_MODEL) -o $(FIG)/web-page.png

# The GPU path proved on a lent GPU machine in at most 8 minutes (bench/gpu_check.py): the CUDA
# tests, training throughput of `base` at 25k tokens per update against nn.Transformer, torchrun
# and DDP over NCCL, the user's job as whole commands; its tables printed, the logs into OUT.
# No .venv: the machine's own python3 with a CUDA PyTorch runs this tree's src/ (PYTHONPATH
# keeps what it held, e.g. carried wheels).
# Without CUDA it says so in one line and exits 0. OUT/records.jsonl holds its records: where the
# machine's copy of the tree had no git, `python bench/page.py --stamp OUT/records.jsonl --commit
# C` adds the source hashes of the commit it ran; then append them to bench/results/gpu.jsonl.
ifneq ($(filter gpu-check,$(MAKECMDGOALS)),)
ifeq ($(OUT),)
$(error give OUT=DIR for the report, e.g. make gpu-check OUT=/tmp/gpu-check)
endif
endif
gpu-check:
	PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) bench/gpu_check.py --out $(OUT) $(GPU_ARGS)

# Module and function sizes: what the ~600-line guideline for a module flags.
size: $(STAMP)
	$(BIN)/python tools/code_size.py --markdown

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
