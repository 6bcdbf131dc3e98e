# Each target bootstraps .venv itself, so a fresh clone needs only `make train` or `make test`.
# What a run needs, and (for the tests and benchmarks) the rest: one stamp each, so that
# `make test` after `make train` installs only what it still lacks.
VENV   := .venv
PY     := $(VENV)/bin/python
INSTALLED := pyproject.toml constraints.txt setup.py src/labrun/data/image/_jpeg_region.c \
             src/labrun/data/segmentation/_png_rows.c scripts/setup.sh
TRAIN_STAMP := $(VENV)/.installed-train
TEST_STAMP  := $(VENV)/.installed-test

.PHONY: train test bench lint wheel clean

$(TRAIN_STAMP): $(INSTALLED)
	bash scripts/setup.sh train

$(TEST_STAMP): $(INSTALLED)
	bash scripts/setup.sh test

train: $(TRAIN_STAMP)   ## the default job: digits, small CNN, CPU, about a minute
	$(PY) train.py

test: $(TEST_STAMP)     ## every test; as root it brings up the test SLURM cluster first
	bash scripts/test.sh

bench: $(TRAIN_STAMP)   ## benchmarks as ratios against a baseline of the same run; exit 1 on a broken floor
	bash scripts/bench.sh

lint: $(TRAIN_STAMP)
	$(VENV)/bin/ruff check src tests train.py benchmarks
	$(VENV)/bin/labrun configs check
	$(VENV)/bin/lint-imports

wheel: $(TEST_STAMP)   ## labrun's wheel, configs inside, into dist/ (its version from git)
	rm -rf build  # setuptools would add what earlier builds left in build/lib
	$(PY) -m pip wheel --no-deps --no-build-isolation -w dist .

clean:
	rm -rf outputs multirun .pytest_cache dist
