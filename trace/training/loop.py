"""The training loop of one arm: ``Trainer`` runs the TRACE training steps, with checkpoints and resume.

One training step (docs/architecture.md#one-training-step): draw B candidate prompts -> score them with
the predictor (``trace_oracle``: Monte-Carlo estimates, outside the budget) -> stage 1 root allocation -> bare
rollouts -> stage 2 prefix expansion (``rounds`` times) -> every ``predictor.truth.every`` steps, score the
predictor against Monte-Carlo truth on an unselected sample (its rollouts never train) -> score the predictor on
the new trees, then refit it on a sliding window -> advantages -> the allocation audit (point and integrated
forecasts against what was realised) -> policy update -> metrics. With ``predictor.recalibrate`` both stages read the
forecasts recalibrated against the window's outcomes (``trace.training.recalibration``).
Every arm (``trace.allocation.arms.ARMS``) spends exactly ``allocation.trajectory_budget``
trajectories per step (DAPO: at most that many, it filters instead of topping up).

Determinism and resume: all randomness of step ``s`` derives from ``(seed, s)``; the candidate prompts of a
step depend only on ``(seed, s)`` (so every arm sees the same prompts); the checkpoint holds the policy,
optimizer and RNG (DeepSpeed), the predictor state and the step counter; the predictor's window is read
back from the step's Parquet trees. A run killed at any point and restarted continues from the last
checkpoint and ends with the same trees, metrics and weights as an uninterrupted run (on CPU).

Data parallel (under ``torchrun`` or ``deepspeed``, the ``launch`` params): every rank computes the same
prompts, scores and allocation; each samples and trains on its own whole trees and receives the others'
(``trace.training.parallel.DataParallelSampler``), so every rank refits the same predictor on the same window (checked
every step); rank 0 alone writes the trees and the checkpoint's predictor and state files, and runs the
in-training evaluation (held-out greedy accuracy, and avg@k with ``train.eval_samples``, on the same sampling
seeds at every evaluation). DeepSpeed writes its checkpoint shards from every rank. With several nodes the run
folder must be on a file system every node sees.
"""

from __future__ import annotations

import hashlib
import io
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from trace.allocation.arms import get_arm, make_allocator_state
from trace.allocation.samplers import MonteCarloScorer, PolicySampler
from trace.allocation.step import allocate_step
from trace.reporting.audit import audit_metrics, integrated_metrics
from trace.training.checkpoint import load_allocator_state, load_checkpoint, write_checkpoint
from trace.configuration.config import Config
from trace.envs.base import Environment, Prompt
from trace.training.evaluation import MetricsFn, evaluate_policy, success_rates
from trace.training.exploration_weights import exploration_root_weights
from trace.training.parallel import DataParallelSampler, all_gather_objects, barrier, is_main_process, rank, world_size
from trace.sampling import make_rollout_backend, sampling_spec
from trace.policy.lora import apply_lora
from trace.training.seeding import candidate_indices, step_rng, step_seed
from trace.training.recalibration import RecalibratedSampler, exploration_trees, logged_maps, map_metrics, step_maps
from trace.training.token_budget import budget_spent, crossed_marks
from trace.tree import RolloutTree
from trace.tree_io import read_trees, tree_path, write_trees
from trace.tracking.names import EVAL_ACCURACY, EVAL_SAMPLED_ACCURACY, sampled_accuracy_name


class Trainer:
    """Runs the training steps of one ablation, with checkpoints and resume.

    Args:
        cfg: the whole config (the trainer hands each library call its own section).
        ablation: arm name (``trace.allocation.arms.ARMS``).
        policy: ``trace.policy.model.Policy`` after warmup.
        env: the task environment.
        train_prompts: candidate pool; eval_prompts: held-out prompts for in-training evaluation.
        predictor: a ``trace.predictor.SuccessPredictor`` (warm-started).
        run_dir: folder for checkpoints and trees of this arm.
        log_metrics: ``fn(metrics, step)`` (MLflow).
    """

    def __init__(self, cfg: Config, ablation: str, *, policy, env: Environment, train_prompts: Sequence[Prompt],
                 eval_prompts: Sequence[Prompt], predictor, run_dir: str | Path,
                 log_metrics: MetricsFn | None = None, progress: bool = True):
        from trace.update import PolicyUpdater

        self.cfg = cfg
        self.spec = get_arm(ablation)
        self.ablation = self.spec.name
        # what the arm's root rule keeps across steps (greso, mopps, vip); saved in every checkpoint
        self.allocator_state = make_allocator_state(self.spec, cfg.allocation)
        self.policy = apply_lora(policy, cfg.update.lora, cfg.seed)  # update.lora: adapters, in place
        self.env = env
        self.train_prompts = list(train_prompts)
        self.eval_prompts = list(eval_prompts)
        self.predictor = predictor
        self.run_dir = Path(run_dir)
        self.log_metrics = log_metrics or (lambda m, s: None)
        self.progress = progress
        self.updater = PolicyUpdater(policy.model, cfg.update, seed=cfg.seed,
                                     pad_token_id=policy.tokenizer.pad_token_id,
                                     max_tokens=cfg.policy.max_context_tokens)
        # one backend for the whole run: the updater announces every optimizer step (mark_weights_updated), on
        # which the HF backend drops kept KV and the vLLM engine reloads the weights and resets its prefix cache
        self.backend = make_rollout_backend(policy, cfg.rollout)
        self.rank, self.world_size = rank(), world_size()  # the process group exists once the updater does
        if self.world_size > 1 and cfg.update.zero_stage == 3 and not hasattr(self.backend, "sync_weights"):
            raise ValueError("update.zero_stage=3 with rollout.backend=hf on several ranks: the HF backend "
                             "generates with the partitioned module, whose every forward pass is a collective, "
                             "and ranks sample different trees; use rollout.backend=vllm or zero_stage <= 2")
        if (cfg.update.zero_stage == 3 or cfg.update.lora.enabled) and hasattr(self.backend, "weights_fn"):
            self.backend.weights_fn = self.updater.serving_state_dict  # gathered full weights, adapters merged
        self.tokens_per_trajectory: dict[str, float] = {}  # stage-1 split costs (trace.training.parallel)
        self.estimator = (cfg.advantages.estimator.value if cfg.advantages.estimator is not None
                          else self.spec.estimator)
        self.cumulative_tokens = 0.0
        self.cumulative_trajectories = 0.0
        self.next_step = 0
        self.checkpoint_step = 0  # next_step of the newest checkpoint saved or loaded
        self.history: list[dict] = []
        self.probe_initial: float | None = None  # the starting policy's probe success (train.probe_prompts)
        self.recalibration_used: dict = {}  # predictor.recalibrate: step -> the maps its allocator read through

    # ---- paths and checkpoints ------------------------------------------------------------------------
    @property
    def trees_root(self) -> Path:
        """Folder of the arm's step trees, ``<run_dir>/trees`` (``trace.tree_io.tree_path`` below it)."""
        return self.run_dir / "trees"

    def save_checkpoint(self, step_done: int) -> None:
        """Checkpoint after ``step_done`` steps: DeepSpeed state, predictor, counters (``trace.training.checkpoint``)."""
        write_checkpoint(self.run_dir, step_done, updater=self.updater, predictor=self.predictor,
                         params_hash=self.cfg.resume_hash(), ablation=self.ablation,
                         cumulative_tokens=self.cumulative_tokens,
                         cumulative_trajectories=self.cumulative_trajectories, history=self.history,
                         allocator_state=None if self.allocator_state is None else self.allocator_state.state_dict())
        self.checkpoint_step = step_done

    def resume(self) -> int:
        """Load the last checkpoint if it belongs to these params; return the next step to run.

        A checkpoint of other params (a changed config other than ``train.num_steps``) is discarded and
        training starts at step 0; a checkpoint past ``train.num_steps`` runs nothing more.

        Raises:
            CheckpointError: the checkpoint cannot be read (``load_checkpoint``), or the arm keeps an allocator
                state and the checkpoint's is missing or lacks a key the allocator reads (names the state file,
                the key and the folder to delete).
        """
        state = load_checkpoint(self.run_dir, updater=self.updater, predictor=self.predictor,
                                params_hash=self.cfg.resume_hash(), ablation=self.ablation)
        if state is None:
            return 0
        self.cumulative_tokens = state["cumulative_tokens"]
        self.cumulative_trajectories = state["cumulative_trajectories"]
        self.next_step = int(state["next_step"])
        self.checkpoint_step = self.next_step
        self.history = list(state.get("history", []))[: self.next_step]
        if self.allocator_state is not None:
            load_allocator_state(self.allocator_state, state, self.run_dir, self.ablation)
        self.probe_initial = next((float(h["probe/initial"]) for h in self.history if "probe/initial" in h), None)
        return self.next_step

    def window_trees(self, step: int, steps: int | None = None) -> list[RolloutTree]:
        """Trees of steps ``[step - steps + 1, step]`` read back from Parquet (``steps``: the predictor's window)."""
        lo = max(0, step - (steps or self.cfg.predictor.window_steps) + 1)
        out: list[RolloutTree] = []
        for s in range(lo, step + 1):
            path = tree_path(self.trees_root, self.ablation, s)
            if path.is_file():
                out.extend(read_trees(path))
        return out

    # ---- one step ----------------------------------------------------------------------------------------
    def _policy_sampler(self, step: int, oracle_salt: str = "oracle", maps=None) -> Any:
        """The step's rollouts and scores (salt ``s`` samples with seed ``step_seed(seed, step, s)``): the
        predictor's (recalibrated by ``maps``, ``trace.training.recalibration``, where given), or for an arm with
        ``scores="monte_carlo"`` (``trace_oracle``) Monte-Carlo estimates on salts stemmed ``oracle_salt``."""
        cfg = self.cfg
        inner = PolicySampler(self.policy, self.env, self.backend, self.predictor,
                              lambda salt: sampling_spec(cfg.rollout, step_seed(cfg.seed, step, salt)),
                              step=step, ablation=self.ablation, max_context_tokens=cfg.policy.max_context_tokens)
        if self.spec.scores != "monte_carlo":
            return inner if maps is None else RecalibratedSampler(inner, maps)
        if self.world_size > 1:  # the other ranks' trees arrive without the states their prefixes continue from
            raise ValueError(f"{self.ablation} runs in one process: its estimates continue every tree's prefixes, "
                             "and a rank holds only its own trees' states; run it without the launch params")
        return MonteCarloScorer(inner, cfg.allocation.oracle_samples, oracle_salt)

    def _sync_weights(self) -> None:
        """Push new weights to a backend that holds its own copy (vLLM), on every rank at the same point: under
        ZeRO-3 the push gathers the partitioned weights, a collective. The HF backend needs no push."""
        sync = getattr(self.backend, "sync_weights", None)
        if sync is not None:
            sync()

    def _check_same_predictor(self) -> None:
        """Every rank must hold the same predictor after the refit (it decides the next allocation)."""
        import torch

        buf = io.BytesIO()
        torch.save(self.predictor.state_dict(), buf)
        digests = all_gather_objects(hashlib.sha256(buf.getvalue()).hexdigest())
        if len(set(digests)) > 1:
            raise RuntimeError(f"the predictor differs between ranks after the refit (state digests {digests}); "
                               "every rank must see the same trees and run the same deterministic fit")

    def _truth_audit(self, step: int, candidates: Sequence[Prompt], trees: Sequence[RolloutTree],
                     maps=None) -> dict[str, float]:
        """``predictor.truth``: the predictor's forecasts on an unselected sample against Monte-Carlo truth, before
        its refit (``trace.predictor.ground_truth``); own salts and generator, nothing added to ``trees``."""
        from trace.predictor.ground_truth import audit_forecasts

        cfg, truth = self.cfg, self.cfg.predictor.truth
        sampler = self._policy_sampler(step, "truth_oracle", maps)  # what the allocator reads, scored
        metrics, _ = audit_forecasts(sampler, candidates, trees, num_roots=truth.roots, num_prefixes=truth.prefixes,
                                     samples=truth.samples, rng=step_rng(cfg.seed, step, "truth"))
        if isinstance(sampler, MonteCarloScorer):  # what those estimates cost is the audit's too
            metrics["truth/rollouts"] += sampler.rollouts
            metrics["truth/tokens"] += sampler.tokens
        return metrics

    def step(self, step: int) -> dict[str, float]:
        """Run one training step and write its trees; returns its metrics (also logged)."""
        from trace.advantages.estimators import assign_advantages
        from trace.metrics import rollout_metrics

        cfg, acfg = self.cfg, self.cfg.allocation
        t_step = time.perf_counter()
        if step == 0 and cfg.train.probe_prompts and is_main_process():
            self.probe_initial = self._probe()
        idx = candidate_indices(len(self.train_prompts), acfg.num_candidates, cfg.seed, step)
        candidates = [self.train_prompts[i] for i in idx]
        self._sync_weights()
        previous = self.window_trees(step - 1)  # the predictor's window before this step
        maps = None
        if cfg.predictor.recalibrate and self.spec.scores != "monte_carlo":  # the maps earlier steps read through
            self.recalibration_used = {**logged_maps(self.history), **self.recalibration_used}
            window = self.window_trees(step - 1, cfg.predictor.recalibrate_window)
            roots = (exploration_trees(window, self.spec, self.train_prompts, acfg, cfg.seed)
                     if cfg.predictor.recalibrate_roots == "explore" else None)  # the unselected root groups alone
            maps = self.recalibration_used[step] = step_maps(self.recalibration_used, window,
                                                             cfg.predictor.recalibrate_map, roots)
        sampler = DataParallelSampler(self._policy_sampler(step, maps=maps), self.tokens_per_trajectory,
                                      rank=self.rank, world_size=self.world_size)  # whole trees per rank, scored alike
        result = allocate_step(self.spec, candidates, sampler, acfg, lambda salt: step_rng(cfg.seed, step, salt),
                               state=self.allocator_state)
        trees, all_for_metrics = result.trees, result.sampled_trees
        metrics: dict[str, float] = dict(result.metrics)
        if isinstance(sampler.inner, MonteCarloScorer):  # the estimates' rollouts, outside the budget
            metrics.update(sampler.inner.metrics())
        timings: dict[str, float] = dict(result.timings)
        truth = cfg.predictor.truth
        if truth.every and (step + 1) % truth.every == 0:  # every rank alike: the predictor's forward may be collective
            t0 = time.perf_counter()
            metrics.update(self._truth_audit(step, candidates, all_for_metrics, maps))
            timings["time/truth"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        if all_for_metrics:
            metrics.update(self.predictor.evaluate(all_for_metrics))
        window = previous + all_for_metrics
        if window:  # the exploration groups' roots weighted by predictor.explore_weight (None: all 1)
            fitted = self.predictor.fit(window, exploration_root_weights(window, self.spec, self.train_prompts, cfg))
            metrics.update({k: v for k, v in fitted.items() if isinstance(v, (int, float))})
        if self.world_size > 1:
            self._check_same_predictor()
            metrics.update(sampler.split(all_for_metrics))
        sampler.observe(all_for_metrics)
        timings["time/predictor_fit"] = time.perf_counter() - t0

        for tree in all_for_metrics:
            for node in tree.nodes:
                node.advantage = None
        if trees:
            adv = cfg.advantages
            assign_advantages(trees, self.estimator, eps=adv.eps, std_floor=adv.std_floor, clip=adv.clip,
                              baseline=adv.baseline, scale=adv.scale, negative_weight=adv.negative_weight)
        metrics.update(rollout_metrics(all_for_metrics, num_candidates=len(candidates)))
        metrics.update(audit_metrics(result))
        metrics.update(integrated_metrics(result, previous, maps))  # the same forecasts over the truth's spread
        metrics.update(map_metrics(maps) if maps else {})
        if result.is_filtered:
            # only kept groups carry gradient signal
            metrics.update({k: v for k, v in rollout_metrics(trees, len(candidates)).items()
                            if k in ("effective_ratio", "effective_token_ratio")} if trees else
                           {"effective_ratio": 0.0, "effective_token_ratio": 0.0})
            if trees:
                kept_leaves = sum(t.num_trajectories() for t in trees)
                total_leaves = sum(t.num_trajectories() for t in all_for_metrics)
                metrics["effective_ratio"] *= kept_leaves / total_leaves
                kept_tok = sum(t.num_generated_tokens() for t in trees)
                total_tok = sum(t.num_generated_tokens() for t in all_for_metrics)
                metrics["effective_token_ratio"] *= kept_tok / max(total_tok, 1)

        t0 = time.perf_counter()
        if trees:
            # each rank its own trees; the token-mean normaliser is global (PolicyUpdater)
            metrics.update(self.updater.rl_step(sampler.owned(trees), temperature=cfg.rollout.temperature))
        timings["time/update"] = time.perf_counter() - t0
        if trees:
            self._sync_weights()  # before rank 0's evaluation generates alone

        t0 = time.perf_counter()
        if is_main_process():
            write_trees([t.copy_without_state() for t in all_for_metrics],
                        tree_path(self.trees_root, self.ablation, step))
        barrier()  # the next step's window is read back from these files on every rank
        timings["time/write"] = time.perf_counter() - t0

        tokens_before = self.cumulative_tokens
        self.cumulative_tokens += metrics.get("tokens/generated", 0.0)
        self.cumulative_trajectories += metrics.get("rollout/trajectories", 0.0)
        metrics["tokens/cumulative"] = self.cumulative_tokens
        metrics["rollout/cumulative_trajectories"] = self.cumulative_trajectories
        metrics["accuracy/train"] = metrics.get("reward/mean", 0.0)
        tcfg = cfg.train
        marks = crossed_marks(tokens_before, self.cumulative_tokens, tcfg.eval_every_tokens, tcfg.token_budget)
        if marks:
            metrics["eval/token_mark"] = float(marks[-1])
        if tcfg.token_budget:  # the report states the budget and which runs reached it
            metrics["tokens/budget"] = float(tcfg.token_budget)
        due = bool(marks) if tcfg.eval_every_tokens else (step + 1) % tcfg.eval_every == 0 or self.budget_spent
        if (due or step + 1 == tcfg.num_steps) and is_main_process():
            t0 = time.perf_counter()
            # the same seed at every evaluation: every curve point samples the same streams (avg@k included)
            ev, _ = evaluate_policy(self.policy, self.env, self.eval_prompts[: cfg.train.eval_prompts], cfg.rollout,
                                    seed=step_seed(cfg.seed, 0, "eval"), backend=self.backend,
                                    max_context_tokens=cfg.policy.max_context_tokens,
                                    pass_k=cfg.train.eval_samples, temperature=cfg.evaluate.temperature)
            metrics[EVAL_ACCURACY] = ev["accuracy/greedy"]
            if cfg.train.eval_samples:
                metrics[EVAL_SAMPLED_ACCURACY] = ev[sampled_accuracy_name(cfg.train.eval_samples)]
            if cfg.train.probe_prompts:
                metrics["probe/success"] = self._probe()
                metrics["probe/gain"] = metrics["probe/success"] - self._probe_start()
            timings["time/eval"] = time.perf_counter() - t0
        if step == 0 and self.probe_initial is not None:
            metrics["probe/initial"] = self.probe_initial
        timings["time/step"] = time.perf_counter() - t_step
        metrics.update(timings)
        self.log_metrics(metrics, step)
        return metrics

    def _probe(self) -> float:
        """Mean success of the policy now on the fixed probe set: the first ``train.probe_prompts`` training
        prompts, ``train.probe_samples`` rollouts each, on the same sampling seeds at every call."""
        tcfg = self.cfg.train
        rates = success_rates(self.policy, self.env, self.train_prompts[: tcfg.probe_prompts], self.cfg.rollout,
                              seed=step_seed(self.cfg.seed, 0, "probe"), samples=tcfg.probe_samples,
                              max_context_tokens=self.cfg.policy.max_context_tokens, backend=self.backend)
        return float(np.mean(list(rates.values())))

    def _probe_start(self) -> float:
        """The starting policy's probe success, measured before step 0 (a resumed run reads it back from the
        checkpoint's history, ``probe/initial`` at step 0).

        Raises:
            RuntimeError: no probe of the starting policy (a checkpoint of a run without the probe).
        """
        if self.probe_initial is None:
            raise RuntimeError("train.probe_prompts is set but the run's history holds no probe of the starting "
                               "policy (probe/initial at step 0); start the run over (delete its checkpoint folder)")
        return self.probe_initial

    def run(self, until_step: int | None = None, on_step: Callable[[int, dict], None] | None = None) -> list[dict]:
        """Run steps ``next_step .. until_step - 1`` (default ``train.num_steps``), or until ``train.token_budget``
        is spent, checkpointing every ``train.checkpoint_every`` steps and at the end. Returns each step's
        metrics."""
        from tqdm import tqdm

        end = self.cfg.train.num_steps if until_step is None else min(until_step, self.cfg.train.num_steps)
        out = []
        bar = tqdm(range(self.next_step, end), desc=f"train {self.ablation}", disable=not self.progress, leave=False)
        for step in bar:
            if self.budget_spent:  # train.token_budget reached (also by a resumed run's checkpoint)
                break
            metrics = self.step(step)
            out.append(metrics)
            self.history.append({"step": step, **metrics})
            self.next_step = step + 1
            bar.set_postfix(reward=f"{metrics.get('reward/mean', 0):.2f}", eff=f"{metrics.get('effective_ratio', 0):.2f}")
            if (self.next_step % self.cfg.train.checkpoint_every == 0 or self.next_step == self.cfg.train.num_steps
                    or self.budget_spent):
                self.save_checkpoint(self.next_step)
            if on_step:
                on_step(step, metrics)
        return out

    @property
    def budget_spent(self) -> bool:
        """``train.token_budget`` is set and the arm's generated tokens reached it: no step runs any more."""
        return budget_spent(self.cumulative_tokens, self.cfg.train.token_budget)

    def summary(self) -> dict[str, float]:
        """Means over all steps run so far of the headline metrics, and the last in-training evaluation."""
        out: dict[str, float] = {"train/steps": float(len(self.history))}
        for key in ("effective_ratio", "effective_token_ratio", "active_prompt_ratio", "mixed_group_ratio",
                    "reward/mean", "tokens/generated", "rollout/trajectories", "tools/calls", "time/step",
                    "predictor/brier", "predictor/auc"):
            vals = [h[key] for h in self.history if key in h]
            if vals:
                out[f"mean/{key}"] = float(np.mean(vals))
        for key, name in ((EVAL_ACCURACY, "last/accuracy_eval"), (EVAL_SAMPLED_ACCURACY, "last/accuracy_eval_sampled"),
                          ("probe/gain", "last/probe_gain")):
            evals = [h[key] for h in self.history if key in h]
            if evals:
                out[name] = float(evals[-1])
        out["tokens/cumulative"] = self.cumulative_tokens
        return out
