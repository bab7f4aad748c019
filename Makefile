# The two set-up commands of the README: `make demo` and `make test`.
PY := .venv/bin/python
export VLLM_CPU_KVCACHE_SPACE ?= 2

.PHONY: install demo test lint
install:
	bash scripts/install.sh

demo: install
	$(PY) scripts/demo.py

lint: install
	$(PY) -m ruff check .

# Unit, core (scheduler/manager), kernel, CPU end-to-end, server and benchmark tests, then the
# stress run against `vllm serve` as its own step (LIGHTER_MAMBA_STRESS_SECONDS, default 240).
test: install lint
	$(PY) -m pytest tests -m "not stress" --ignore=tests/kernels -q --durations=25
	TRITON_INTERPRET=1 $(PY) -m pytest tests/kernels -q
	$(PY) -m pytest tests/e2e/test_stress.py -m stress -q -s
