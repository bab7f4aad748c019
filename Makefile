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
# The main suite runs in two pytest workers, one test file each at a time (a file's engines,
# shared by its tests through module fixtures, stay in one worker): one tiny engine keeps about
# 1.2 of the 2 cores busy, so two side by side cut the suite from 1,926 to 1,243 s on the 2-core
# AMD EPYC (2026-12-07). The kernel tests stay serial (two workers took 75 s against 59 s).
test: install lint
	$(PY) -m pytest tests -m "not stress" --ignore=tests/kernels -q --durations=25 -n 2 --dist loadfile
	TRITON_INTERPRET=1 $(PY) -m pytest tests/kernels -q
	$(PY) -m pytest tests/e2e/test_stress.py -m stress -q -s
