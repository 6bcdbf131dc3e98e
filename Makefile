# Each target bootstraps .venv itself, so a fresh clone needs only `make train` or `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: train test bench lint clean

$(STAMP): pyproject.toml constraints.txt setup.py src/labrun/data/_jpeg_region.c scripts/setup.sh
	bash scripts/setup.sh

train: $(STAMP)   ## the default job: digits, small CNN, CPU, about a minute
	$(PY) train.py

test: $(STAMP)    ## every test; as root it brings up the test SLURM cluster first
	bash scripts/test.sh

bench: $(STAMP)   ## benchmarks as ratios against a baseline of the same run; exit 1 on a missed target
	$(PY) -m labrun.cli bench all --check

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests train.py benchmarks
	$(VENV)/bin/labrun configs check
	$(VENV)/bin/lint-imports

clean:
	rm -rf outputs multirun .pytest_cache
