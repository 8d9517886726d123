"""The experiment's stages as library functions: warmup SFT, seed rollouts, the TRACE training step, evaluation.

One training step (DESIGN.md section 3): draw B candidate prompts -> score them with the predictor ->
stage 1 root allocation -> bare rollouts -> stage 2 prefix expansion (``rounds`` times) -> score the
predictor on the new trees, then refit it on a sliding window -> advantages -> policy update -> metrics.
Every arm (``trace.allocation.baselines.ABLATIONS``) spends exactly ``allocation.trajectory_budget``
trajectories per step (DAPO: at most that many, it filters instead of topping up).

Determinism and resume: all randomness of step ``s`` derives from ``(seed, s)``; the candidate prompts of a
step depend only on ``(seed, s)`` (so every arm sees the same prompts); the checkpoint holds the policy,
optimizer and RNG (DeepSpeed), the predictor state and the step counter; the predictor's window is read
back from the step's Parquet trees. A run killed at any point and restarted continues from the last
checkpoint and ends with the same trees, metrics and weights as an uninterrupted run (on CPU).

Simplifications: one process (world size 1) on CPU; multi-GPU runs go through DeepSpeed's launcher.
"""

from __future__ import annotations

import json
import shutil
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from trace.allocation.baselines import NoMixedGroupError, get_ablation, plan_expansion, plan_root_counts, run_dapo
from trace.allocation.prefix import candidate_anchors, split_expansion_budget
from trace.config import Config, RolloutConfig
from trace.envs.base import Environment, Prompt
from trace.tree import RolloutTree
from trace.tree_io import atomic_write_bytes, read_trees, tree_path, write_trees

MetricsFn = Callable[[Mapping[str, float], int], None]


def step_seed(seed: int, step: int, salt: str = "") -> int:
    """A 31-bit seed for one step (and purpose), stable across processes and Python versions."""
    return zlib.crc32(f"{seed}/{step}/{salt}".encode()) & 0x7FFFFFFF


def step_rng(seed: int, step: int, salt: str = "") -> np.random.Generator:
    return np.random.default_rng(step_seed(seed, step, salt))


def check_candidate_pool(num_prompts: int, num_candidates: int) -> None:
    """Refuse a candidate pool that cannot give a step ``num_candidates`` distinct prompts.

    Args:
        num_prompts: P, training prompts in the pool.
        num_candidates: B, ``allocation.num_candidates``.

    Raises:
        ValueError: ``P < 1``, ``B < 1``, or ``B > P``; the message names the params to change.
    """
    if num_prompts < 1:
        raise ValueError("no training prompts: check the prepare stage's output")
    if num_candidates < 1:
        raise ValueError(f"allocation.num_candidates must be >= 1, got {num_candidates}")
    if num_candidates > num_prompts:
        raise ValueError(
            f"allocation.num_candidates={num_candidates} exceeds the {num_prompts} training prompts, and a step's "
            "candidates must be distinct prompts: lower allocation.num_candidates or train on more prompts "
            "(task.kgqa.num_train, task.simulator.num_prompts, task.files.max_train or a larger data file)")


def _epoch_permutation(num_prompts: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng(step_seed(seed, epoch, "epoch")).permutation(num_prompts)


def _boundary_tail(num_prompts: int, num_candidates: int, epoch: int) -> int:
    """Positions of epoch ``epoch - 1`` inside the step that starts epoch ``epoch`` (0: a step starts it)."""
    return (epoch * num_prompts) % num_candidates


def _order_after(order: np.ndarray, permutation: np.ndarray, num_candidates: int, tail: int) -> np.ndarray:
    """The next epoch's drawing order: ``permutation`` with the prompts of the boundary step moved back.

    The boundary step holds the last ``tail`` prompts of ``order``; it takes the first ``B - tail`` prompts of
    ``permutation`` that it does not hold yet, and the prompts it skipped follow right after them.
    """
    if tail == 0:
        return permutation
    held = np.isin(permutation, order[order.size - tail:])
    free = np.flatnonzero(~held)
    cut = int(free[num_candidates - tail - 1]) + 1  # permutation[:cut] holds exactly B - tail free prompts
    head, head_held = permutation[:cut], held[:cut]
    return np.concatenate([head[~head_held], head[head_held], permutation[cut:]])


def _epoch_order(num_prompts: int, num_candidates: int, seed: int, epoch: int) -> np.ndarray:
    """(P,) the drawing order of ``epoch``: its seeded permutation, repaired at the boundary with ``epoch - 1``."""
    tail = _boundary_tail(num_prompts, num_candidates, epoch)
    if tail == 0:
        return _epoch_permutation(num_prompts, seed, epoch)
    # The repair of epoch j moves only its first B positions, so the last prompts of epoch j are those of its
    # plain permutation when a step starts epoch j or when the share of it in its final step,
    # ``_boundary_tail(j + 1)``, lies past position B. Start from the latest such epoch (epoch 0 always is one)
    # and repair forward.
    first = epoch - 1
    while first > 0 and _boundary_tail(num_prompts, num_candidates, first) != 0 \
            and num_candidates + _boundary_tail(num_prompts, num_candidates, first + 1) > num_prompts:
        first -= 1
    order = _epoch_permutation(num_prompts, seed, first)
    for later in range(first + 1, epoch + 1):
        order = _order_after(order, _epoch_permutation(num_prompts, seed, later), num_candidates,
                             _boundary_tail(num_prompts, num_candidates, later))
    return order


def candidate_indices(num_prompts: int, num_candidates: int, seed: int, step: int) -> np.ndarray:
    """(B,) int64 indices of the ``B`` distinct candidate prompts of ``step``.

    Positions ``step * B .. step * B + B - 1`` of a stream of epochs, each epoch a seeded permutation of the
    ``P`` prompts (``step_seed(seed, epoch, "epoch")``). When ``P`` is not a multiple of ``B``, a step can
    straddle an epoch boundary: it holds the last prompts of one epoch and completes itself with the first
    prompts of the next epoch's permutation that it does not hold yet; the prompts it skipped are drawn right
    after, so every epoch still draws every prompt exactly once. When ``P`` is a multiple of ``B`` no step
    straddles and the result is the plain slice of the epoch's permutation.

    The result depends only on ``(num_prompts, num_candidates, seed, step)``, never on the arm or on earlier
    calls, so every arm sees the same prompts at a step and a resumed run draws what an uninterrupted one does.

    Args:
        num_prompts: P, the size of the training pool (>= 1).
        num_candidates: B, ``allocation.num_candidates`` (1 <= B <= P).
        seed: the run's ``seed``.
        step: the training step (>= 0).

    Returns:
        (B,) int64 distinct indices into the pool.

    Raises:
        ValueError: an empty pool, ``B > P`` (``check_candidate_pool``), or a negative step.
    """
    check_candidate_pool(num_prompts, num_candidates)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    epoch, offset = divmod(step * num_candidates, num_prompts)
    order = _epoch_order(num_prompts, num_candidates, seed, epoch)
    out = order[offset:offset + num_candidates]
    if out.size < num_candidates:  # the step straddles the boundary into the next epoch
        following = _order_after(order, _epoch_permutation(num_prompts, seed, epoch + 1), num_candidates, out.size)
        out = np.concatenate([out, following[:num_candidates - out.size]])
    return out.astype(np.int64)


def sampling_spec(rollout_cfg: RolloutConfig, seed: int, temperature: float | None = None):
    from trace.rollout import SamplingSpec

    return SamplingSpec(temperature=rollout_cfg.temperature if temperature is None else temperature,
                        top_p=rollout_cfg.top_p, max_new_tokens=rollout_cfg.max_new_tokens, seed=seed,
                        batch_size=rollout_cfg.batch_size)


def make_rollout_backend(policy, rollout_cfg: RolloutConfig, backend=None):
    """``backend`` if given, else the backend ``rollout.backend`` names (HF, or the shared vLLM engine)."""
    if backend is not None:
        return backend
    from trace.rollout import make_backend

    return make_backend(policy, sampling_spec(rollout_cfg, 0), reuse_prefix_cache=rollout_cfg.reuse_prefix_cache,
                        rollout_cfg=rollout_cfg)


def root_texts(env: Environment, prompts: Sequence[Prompt]) -> list[str]:
    return [env.reset(p)[1] for p in prompts]


# ---- evaluation --------------------------------------------------------------------------------------
def evaluate_policy(policy, env: Environment, prompts: Sequence[Prompt], rollout_cfg: RolloutConfig, *,
                    seed: int, max_context_tokens: int, pass_k: int = 0, temperature: float = 1.0,
                    backend=None, prefix: str = "accuracy") -> tuple[dict[str, float], list[RolloutTree]]:
    """Greedy accuracy, and pass@k / mean@k of ``pass_k`` sampled rollouts per prompt (``pass_k=0``: greedy only).

    Returns:
        ``({"<prefix>/greedy", "<prefix>/pass@k", "<prefix>/mean@k", "<prefix>/truncated",
        "<prefix>/greedy_hops<h>" per hop count when prompts carry ``meta["num_hops"]``}, trees)``.
    """
    from trace.rollout import rollout_roots

    backend = make_rollout_backend(policy, rollout_cfg, backend)
    greedy = rollout_roots(policy, env, prompts, [1] * len(prompts), sampling_spec(rollout_cfg, seed, 0.0),
                           step=-1, ablation="eval", backend=backend, max_context_tokens=max_context_tokens)
    rewards = np.array([t.leaf_rewards()[0] for t in greedy])
    truncated = np.array([t.leaves()[0].finish_reason.is_truncated for t in greedy])
    metrics = {f"{prefix}/greedy": float(rewards.mean()), f"{prefix}/truncated": float(truncated.mean())}
    hops = [p.meta.get("num_hops") for p in prompts]
    for h in sorted({h for h in hops if h is not None}):
        sel = np.array([x == h for x in hops])
        metrics[f"{prefix}/greedy_hops{h}"] = float(rewards[sel].mean())
    trees = list(greedy)
    if pass_k >= 1:
        sampled = rollout_roots(policy, env, prompts, [pass_k] * len(prompts),
                                sampling_spec(rollout_cfg, seed + 1, temperature), step=-1, ablation="eval",
                                backend=backend, max_context_tokens=max_context_tokens)
        per_prompt = np.array([t.leaf_rewards() for t in sampled])  # (P, k)
        metrics[f"{prefix}/pass@{pass_k}"] = float((per_prompt.max(axis=1) > 0).mean())
        metrics[f"{prefix}/mean@{pass_k}"] = float(per_prompt.mean())
        trees.extend(sampled)
    return metrics, trees


def sampled_success(policy, env: Environment, prompts: Sequence[Prompt], rollout_cfg: RolloutConfig, *,
                    seed: int, max_context_tokens: int, backend=None) -> float:
    """Mean reward of one sampled rollout per prompt (the warmup's success measure)."""
    from trace.rollout import rollout_roots

    trees = rollout_roots(policy, env, prompts, [1] * len(prompts), sampling_spec(rollout_cfg, seed),
                          step=-1, ablation="warmup", backend=make_rollout_backend(policy, rollout_cfg, backend),
                          max_context_tokens=max_context_tokens)
    return float(np.mean([t.leaf_rewards()[0] for t in trees]))


# ---- warmup ------------------------------------------------------------------------------------------
@dataclass
class WarmupResult:
    """Outcome of the warmup SFT: success measured at each evaluation, and the step kept."""

    history: list[tuple[int, float]] = field(default_factory=list)
    chosen_step: int = 0
    chosen_success: float = 0.0
    reason: str = ""


def demonstration_trees(policy, env, prompts: Sequence[Prompt], demo_noise: float, seed: int) -> list[RolloutTree]:
    """Teacher-forced solver demonstrations, one trajectory per prompt."""
    from trace.rollout import trajectory_from_actions

    trees = []
    for i, prompt in enumerate(prompts):
        actions = env.solve(prompt, demo_noise=demo_noise, seed=step_seed(seed, i, "demo"))
        trees.append(trajectory_from_actions(policy, env, prompt, actions))
    return trees


def run_warmup(policy, env, train_prompts: Sequence[Prompt], cfg: Config, *,
               log_metrics: MetricsFn | None = None, progress: bool = True) -> WarmupResult:
    """Supervised fine-tuning on solver demonstrations, stopped in a band of mixed success.

    Every ``warmup.eval_every`` steps the sampled success on ``warmup.eval_prompts`` training prompts is
    measured and the weights are snapshotted. Training stops at the first measurement >= ``target_low``.
    The kept weights are the first snapshot within ``[target_low, target_high]``; if success jumped over the
    band, the snapshot closest to the band's middle; if ``max_steps`` ran out below the band, the last one.
    ``policy.model`` holds the kept weights on return.
    """
    from tqdm import tqdm

    from trace.policy.backends import mark_weights_updated
    from trace.update import PolicyUpdater

    wcfg = cfg.warmup
    result = WarmupResult()
    if not wcfg.enabled or wcfg.max_steps == 0:
        result.reason = "warmup disabled"
        return result
    demos = demonstration_trees(policy, env, train_prompts, wcfg.demo_noise, cfg.seed)
    updater = PolicyUpdater(policy.model, cfg.update.model_copy(update={"lr": wcfg.lr, "ppo_epochs": 1, "kl_coef": 0.0,
                                                                "gradient_checkpointing": False}),
                            seed=cfg.seed, pad_token_id=policy.tokenizer.pad_token_id,
                            max_tokens=cfg.policy.max_context_tokens)
    eval_prompts = list(train_prompts[: wcfg.eval_prompts])
    snapshots: list[tuple[int, float, dict]] = []
    middle = 0.5 * (wcfg.target_low + wcfg.target_high)

    def measure(step: int) -> float:
        success = sampled_success(policy, env, eval_prompts, cfg.rollout, seed=step_seed(cfg.seed, step, "warm"),
                                  max_context_tokens=cfg.policy.max_context_tokens)
        result.history.append((step, success))
        snapshots.append((step, success, {k: v.detach().clone() for k, v in policy.model.state_dict().items()}))
        if log_metrics:
            log_metrics({"warmup/success": success}, step)
        return success

    bar = tqdm(total=wcfg.max_steps, desc="warmup SFT", disable=not progress, leave=False)
    step = 0
    while step < wcfg.max_steps:
        rng = step_rng(cfg.seed, step, "sft")
        batch = [demos[i] for i in rng.choice(len(demos), size=min(wcfg.batch_size, len(demos)), replace=False)]
        metrics = updater.sft_step(batch)
        step += 1
        bar.update(1)
        if log_metrics and step % 10 == 0:
            log_metrics({"warmup/sft_loss": metrics.get("losses/sft", float("nan"))}, step)
        if step % wcfg.eval_every == 0:
            success = measure(step)
            bar.set_postfix(success=f"{success:.2f}")
            if success >= wcfg.target_low:
                break
    bar.close()
    if not snapshots or snapshots[-1][0] != step:
        measure(step)
    in_band = [s for s in snapshots if wcfg.target_low <= s[1] <= wcfg.target_high]
    if in_band:
        chosen, result.reason = in_band[0], "first measurement inside the band"
    elif snapshots[-1][1] > wcfg.target_high:
        chosen = min(snapshots, key=lambda s: (abs(s[1] - middle), s[0]))
        result.reason = "success jumped over the band: kept the measurement closest to its middle"
    else:
        chosen, result.reason = snapshots[-1], "max_steps reached below the band: kept the last weights"
    policy.model.load_state_dict(chosen[2])
    mark_weights_updated(policy.model)  # backends serving the policy (the shared vLLM engine) must refresh
    result.chosen_step, result.chosen_success = chosen[0], chosen[1]
    return result


# ---- seed rollouts -----------------------------------------------------------------------------------
def collect_seed_rollouts(policy, env, prompts: Sequence[Prompt], cfg: Config, *, progress: bool = True) -> list[RolloutTree]:
    """Bare rollouts of the initial policy plus random-anchor continuations: the predictor's warm-start data.

    ``seed_rollouts.group_size`` rollouts per prompt, then ``round(m * expansion_ratio)`` continuations per
    prompt on uniformly random visited prefixes, so the predictor sees labelled prefixes as well as roots.
    """
    from trace.rollout import expand_prefixes, rollout_roots

    scfg = cfg.seed_rollouts
    rng = step_rng(cfg.seed, -1, "seed_rollouts")
    backend = make_rollout_backend(policy, cfg.rollout)
    trees = rollout_roots(policy, env, prompts, [scfg.group_size] * len(prompts),
                          sampling_spec(cfg.rollout, step_seed(cfg.seed, -1, "seed")), step=-1,
                          ablation="seed", backend=backend, max_context_tokens=cfg.policy.max_context_tokens,
                          progress=progress)
    budgets = split_expansion_budget(np.full(len(trees), scfg.group_size),
                                     int(round(scfg.group_size * scfg.expansion_ratio * len(trees))))
    plan = plan_expansion(get_ablation("tree_random"), trees, None, budgets, rng)
    if plan.counts:
        expand_prefixes(policy, env, trees, plan.counts,
                        sampling_spec(cfg.rollout, step_seed(cfg.seed, -1, "seed_branches")),
                        backend=backend, max_context_tokens=cfg.policy.max_context_tokens)
    return trees


# ---- training ----------------------------------------------------------------------------------------
CHECKPOINT_DIR = "checkpoint"
STATE_FILE = "train_state.json"
PREDICTOR_FILE = "predictor.pt"


class Trainer:
    """Runs the training steps of one ablation, with checkpoints and resume.

    Args:
        cfg: the whole config (the trainer hands each library call its own section).
        ablation: arm name (``trace.allocation.baselines.ABLATIONS``).
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
        self.spec = get_ablation(ablation)
        self.ablation = self.spec.name
        self.policy = policy
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
        self.estimator = (cfg.advantages.estimator.value if cfg.advantages.estimator is not None
                          else self.spec.estimator)
        self.cumulative_tokens = 0.0
        self.cumulative_trajectories = 0.0
        self.next_step = 0
        self.checkpoint_step = 0  # next_step of the newest checkpoint saved or loaded
        self.history: list[dict] = []

    # ---- paths and checkpoints ------------------------------------------------------------------------
    @property
    def trees_root(self) -> Path:
        return self.run_dir / "trees"

    def _state_path(self) -> Path:
        return self.run_dir / CHECKPOINT_DIR / STATE_FILE

    def save_checkpoint(self, step_done: int) -> None:
        """Checkpoint after ``step_done`` steps: DeepSpeed state, predictor, counters (atomic state file last)."""
        ckpt = self.run_dir / CHECKPOINT_DIR
        tag = f"step{step_done:06d}"
        self.updater.save_checkpoint(ckpt, tag=tag)
        self.predictor.save(ckpt / f"{PREDICTOR_FILE}.{tag}")
        state = {"next_step": step_done, "tag": tag, "params_hash": self.cfg.resume_hash(),
                 "ablation": self.ablation, "cumulative_tokens": self.cumulative_tokens,
                 "cumulative_trajectories": self.cumulative_trajectories, "history": self.history}
        atomic_write_bytes(self._state_path(), json.dumps(state, indent=1).encode())
        for old in ckpt.glob("step*"):  # keep the newest DeepSpeed tag only
            if old.is_dir() and old.name != tag:
                shutil.rmtree(old, ignore_errors=True)
        for old in ckpt.glob(f"{PREDICTOR_FILE}.step*"):
            if old.name != f"{PREDICTOR_FILE}.{tag}":
                old.unlink(missing_ok=True)
        self.checkpoint_step = step_done

    def resume(self) -> int:
        """Load the last checkpoint if it belongs to these params; return the next step to run.

        A checkpoint of other params (a changed config other than ``train.num_steps``) is discarded and
        training starts at step 0; a checkpoint past ``train.num_steps`` runs nothing more.
        """
        import torch

        path = self._state_path()
        if not path.is_file():
            return 0
        state = json.loads(path.read_text())
        if state.get("params_hash") != self.cfg.resume_hash() or state.get("ablation") != self.ablation:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            return 0
        ckpt = self.run_dir / CHECKPOINT_DIR
        self.updater.load_checkpoint(ckpt, tag=state["tag"])
        self.predictor.load_state_dict(torch.load(ckpt / f"{PREDICTOR_FILE}.{state['tag']}", map_location="cpu",
                                                  weights_only=False))
        self.cumulative_tokens = state["cumulative_tokens"]
        self.cumulative_trajectories = state["cumulative_trajectories"]
        self.next_step = int(state["next_step"])
        self.checkpoint_step = self.next_step
        self.history = list(state.get("history", []))[: self.next_step]
        return self.next_step

    def window_trees(self, step: int) -> list[RolloutTree]:
        """Trees of steps ``[step - window + 1, step]`` read back from Parquet (the predictor's window)."""
        lo = max(0, step - self.cfg.predictor.window_steps + 1)
        out: list[RolloutTree] = []
        for s in range(lo, step + 1):
            path = tree_path(self.trees_root, self.ablation, s)
            if path.is_file():
                out.extend(read_trees(path))
        return out

    # ---- one step ----------------------------------------------------------------------------------------
    def _rollout(self, prompts, counts, step: int, salt: str) -> list[RolloutTree]:
        from trace.rollout import rollout_roots

        return rollout_roots(self.policy, self.env, prompts, list(map(int, counts)),
                             sampling_spec(self.cfg.rollout, step_seed(self.cfg.seed, step, salt)),
                             step=step, ablation=self.ablation, backend=self.backend,
                             max_context_tokens=self.cfg.policy.max_context_tokens)

    def _predict_roots(self, prompts: Sequence[Prompt]) -> np.ndarray:
        if not self.spec.uses_predictor:
            return np.full(len(prompts), np.nan)
        return np.asarray(self.predictor.predict_prompts(prompts, root_texts(self.env, prompts)), dtype=np.float64)

    def _expand(self, trees: list[RolloutTree], counts: np.ndarray, expansion_budget: int, step: int,
                timings: dict) -> int:
        """Stage 2 over ``rounds`` rounds; returns continuations that could not be placed."""
        from trace.rollout import expand_prefixes

        acfg = self.cfg.allocation
        if not self.spec.has_expansion or expansion_budget <= 0 or not trees:
            return expansion_budget
        per_round = split_expansion_budget(np.array([1] * acfg.rounds), expansion_budget)
        new_from: dict[int, list[int]] | None = None
        unspent = 0
        for rnd in range(acfg.rounds):
            budgets = split_expansion_budget(counts, int(per_round[rnd]) + unspent)
            anchor_probs = None
            if self.spec.prefix_rule == "trace":
                t0 = time.perf_counter()
                anchor_probs = {}
                ids = [[node_id for node_id, _ in candidate_anchors(tree, None if new_from is None
                                                                     else new_from.get(t_idx, []))]
                       for t_idx, tree in enumerate(trees)]
                for t_idx, (tree, node_ids, preds) in enumerate(zip(trees, ids, self.predictor.predict_trees(trees, ids))):
                    for node_id, v in zip(node_ids, preds):
                        anchor_probs[(t_idx, node_id)] = float(v)
                        tree.nodes[node_id].pred_success_prob = float(v)
                timings["time/predict"] = timings.get("time/predict", 0.0) + time.perf_counter() - t0
            plan = plan_expansion(self.spec, trees, anchor_probs, budgets,
                                  step_rng(self.cfg.seed, step, f"expand{rnd}"), acfg.treepo_width,
                                  new_only_from=new_from)
            sizes = [len(t.nodes) for t in trees]
            if plan.counts:
                t0 = time.perf_counter()
                expand_prefixes(self.policy, self.env, trees, plan.counts,
                                sampling_spec(self.cfg.rollout, step_seed(self.cfg.seed, step, f"branch{rnd}")),
                                backend=self.backend, max_context_tokens=self.cfg.policy.max_context_tokens)
                timings["time/expand"] = timings.get("time/expand", 0.0) + time.perf_counter() - t0
            new_from = {i: list(range(sizes[i], len(t.nodes))) for i, t in enumerate(trees)}
            unspent = plan.unspent
        return unspent

    def step(self, step: int) -> dict[str, float]:
        """Run one training step and write its trees; returns its metrics (also logged)."""
        from trace.advantages import assign_advantages
        from trace.metrics import rollout_metrics

        cfg, acfg = self.cfg, self.cfg.allocation
        timings: dict[str, float] = {}
        t_step = time.perf_counter()
        idx = candidate_indices(len(self.train_prompts), acfg.num_candidates, cfg.seed, step)
        candidates = [self.train_prompts[i] for i in idx]
        tie_keys = [p.prompt_uid for p in candidates]
        metrics: dict[str, float] = {}

        t0 = time.perf_counter()
        pred = self._predict_roots(candidates)
        timings["time/predict"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        if self.spec.root_rule == "dapo":
            sampled: list[RolloutTree] = []

            def rollout_fn(cand_idx: np.ndarray, n: int):
                trees = self._rollout([candidates[i] for i in cand_idx], [n] * len(cand_idx), step,
                                      f"dapo{len(sampled)}")
                sampled.extend(trees)
                return [t.leaf_rewards() for t in trees]

            try:
                result = run_dapo(rollout_fn, len(candidates), acfg.group_size, acfg.trajectory_budget,
                                  acfg.dapo_max_retries, step_rng(cfg.seed, step, "dapo"))
                kept = set(int(i) for i in result.kept_candidates)
                metrics["dapo/rounds"] = float(result.num_rounds)
            except NoMixedGroupError as err:
                # every sampled group agreed within the retry bound: nothing to learn from this step. Any other
                # error of the rollouts (retriever, backend, out of memory) is not an outcome and stops the run.
                kept = set()
                metrics["dapo/rounds"] = float(err.num_rounds)
                metrics["dapo/no_mixed_group"] = 1.0
            counts = np.zeros(len(candidates), dtype=np.int64)
            all_trees = sampled
            uid_kept = {candidates[i].prompt_uid for i in kept}
            trees = [t for t in sampled if t.prompt_uid in uid_kept]
            metrics["dapo/kept_groups"] = float(len(kept))
            expansion_budget = 0
        else:
            plan = plan_root_counts(self.spec, pred, trajectory_budget=acfg.trajectory_budget,
                                    expansion_ratio=acfg.expansion_ratio, group_size=acfg.group_size,
                                    m_min=acfg.m_min, m_max=acfg.m_max,
                                    knapsack_m_min=acfg.knapsack_m_min, tie_keys=tie_keys,
                                    exact_max_cells=acfg.exact_max_cells)
            counts = plan.counts
            for key in ("gap", "objective", "upper_bound"):
                if key in plan.info:
                    metrics[f"allocation/root_{key}"] = float(plan.info[key])
            active = np.flatnonzero(counts)
            trees = self._rollout([candidates[i] for i in active], counts[active], step, "roots")
            for tree, i in zip(trees, active):
                if self.spec.uses_predictor:
                    tree.root.pred_success_prob = float(pred[i])
                tree.root.num_branches = int(counts[i])
            expansion_budget = plan.expansion_budget
            counts = counts[active]
        timings["time/rollout"] = time.perf_counter() - t0

        unspent = self._expand(trees, counts, expansion_budget, step, timings) if self.spec.root_rule != "dapo" else 0
        if unspent > 0 and trees:
            # no trajectory had a non-terminal prefix (every rollout ended in one turn): keep the step at T
            # trajectories with extra bare rollouts from the roots, spread like the root allocation
            from trace.rollout import expand_prefixes

            extra = split_expansion_budget(counts, unspent)
            expand_prefixes(self.policy, self.env, trees,
                            {(i, 0): int(k) for i, k in enumerate(extra) if k > 0},
                            sampling_spec(cfg.rollout, step_seed(cfg.seed, step, "extra_roots")),
                            backend=self.backend, max_context_tokens=cfg.policy.max_context_tokens)
            metrics["allocation/extra_root_rollouts"] = float(unspent)
        if self.spec.root_rule == "dapo":
            all_for_metrics = all_trees
        else:
            all_for_metrics = trees

        t0 = time.perf_counter()
        if all_for_metrics:
            metrics.update(self.predictor.evaluate(all_for_metrics))
        window = self.window_trees(step - 1) + all_for_metrics
        if window:
            metrics.update({k: v for k, v in self.predictor.fit(window).items() if isinstance(v, (int, float))})
        timings["time/predictor_fit"] = time.perf_counter() - t0

        for tree in all_for_metrics:
            for node in tree.nodes:
                node.advantage = None
        if trees:
            assign_advantages(trees, self.estimator, eps=cfg.advantages.eps, std_floor=cfg.advantages.std_floor,
                              clip=cfg.advantages.clip)
        metrics.update(rollout_metrics(all_for_metrics, num_candidates=len(candidates)))
        if self.spec.root_rule == "dapo":
            # only kept groups carry gradient signal
            metrics.update({k: v for k, v in rollout_metrics(trees, len(candidates)).items()
                            if k in ("effective_ratio", "effective_token_ratio")} if trees else
                           {"effective_ratio": 0.0, "effective_token_ratio": 0.0})
            if trees:
                kept_leaves = sum(t.num_trajectories() for t in trees)
                total_leaves = sum(t.num_trajectories() for t in all_trees)
                metrics["effective_ratio"] *= kept_leaves / total_leaves
                kept_tok = sum(t.num_generated_tokens() for t in trees)
                total_tok = sum(t.num_generated_tokens() for t in all_trees)
                metrics["effective_token_ratio"] *= kept_tok / max(total_tok, 1)

        t0 = time.perf_counter()
        if trees:
            metrics.update(self.updater.rl_step(trees, temperature=cfg.rollout.temperature))
        timings["time/update"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        write_trees([t.copy_without_state() for t in all_for_metrics], tree_path(self.trees_root, self.ablation, step))
        timings["time/write"] = time.perf_counter() - t0

        self.cumulative_tokens += metrics.get("tokens/generated", 0.0)
        self.cumulative_trajectories += metrics.get("rollout/trajectories", 0.0)
        metrics["tokens/cumulative"] = self.cumulative_tokens
        metrics["rollout/cumulative_trajectories"] = self.cumulative_trajectories
        metrics["accuracy/train"] = metrics.get("reward/mean", 0.0)
        if (step + 1) % cfg.train.eval_every == 0 or step + 1 == cfg.train.num_steps:
            t0 = time.perf_counter()
            ev, _ = evaluate_policy(self.policy, self.env, self.eval_prompts[: cfg.train.eval_prompts], cfg.rollout,
                                    seed=step_seed(cfg.seed, 0, "eval"), backend=self.backend,
                                    max_context_tokens=cfg.policy.max_context_tokens)
            metrics["accuracy/eval"] = ev["accuracy/greedy"]
            timings["time/eval"] = time.perf_counter() - t0
        timings["time/step"] = time.perf_counter() - t_step
        metrics.update(timings)
        self.log_metrics(metrics, step)
        return metrics

    def run(self, until_step: int | None = None, on_step: Callable[[int, dict], None] | None = None) -> list[dict]:
        """Run steps ``next_step .. until_step - 1`` (default ``train.num_steps``), checkpointing every
        ``train.checkpoint_every`` steps and at the end. Returns each step's metrics."""
        from tqdm import tqdm

        end = self.cfg.train.num_steps if until_step is None else min(until_step, self.cfg.train.num_steps)
        out = []
        bar = tqdm(range(self.next_step, end), desc=f"train {self.ablation}", disable=not self.progress, leave=False)
        for step in bar:
            metrics = self.step(step)
            out.append(metrics)
            self.history.append({"step": step, **metrics})
            self.next_step = step + 1
            bar.set_postfix(reward=f"{metrics.get('reward/mean', 0):.2f}", eff=f"{metrics.get('effective_ratio', 0):.2f}")
            if self.next_step % self.cfg.train.checkpoint_every == 0 or self.next_step == self.cfg.train.num_steps:
                self.save_checkpoint(self.next_step)
            if on_step:
                on_step(step, metrics)
        return out

    def summary(self) -> dict[str, float]:
        """Means over all steps run so far of the headline metrics, and the last in-training evaluation."""
        out: dict[str, float] = {"train/steps": float(len(self.history))}
        for key in ("effective_ratio", "effective_token_ratio", "active_prompt_ratio", "mixed_group_ratio",
                    "reward/mean", "tokens/generated", "rollout/trajectories", "tools/calls", "time/step",
                    "predictor/brier", "predictor/auc"):
            vals = [h[key] for h in self.history if key in h]
            if vals:
                out[f"mean/{key}"] = float(np.mean(vals))
        evals = [h["accuracy/eval"] for h in self.history if "accuracy/eval" in h]
        if evals:
            out["last/accuracy_eval"] = float(evals[-1])
        out["tokens/cumulative"] = self.cumulative_tokens
        return out
