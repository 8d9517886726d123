"""Which params each pipeline stage reads, and what a stage's resumable state is keyed by.

``STAGE_PARAMS`` is the one table of the params each DVC stage reads: the stage flows log exactly these
values as the MLflow params of a stage run (``stage_params``), and ``dvc.yaml`` lists at least these keys
for the stage, so that changing any of them reruns the stage. A table entry is a dotted key of
``params.yaml``: a whole section (``"task"``) or one value (``"update.zero_stage"``).

Invariants, both checked by ``tests/test_stages.py``:
- every param a stage reads is covered by its entry, except the ``NON_RESULT_PARAMS`` (the reads are
  recorded with ``record_param_reads`` while the real stage flows run on ``tests/params_tiny.yaml``, so the
  table cannot drift from the code);
- ``dvc.yaml`` lists every key of a stage's entry for that stage (``dvc_stage_params``, ``uncovered``).

Deliberately narrow entries: ``warmup`` builds its updater from the ``update`` section with ``lr``,
``ppo_epochs``, ``kl_coef`` and ``gradient_checkpointing`` replaced by its own values, so it lists only the
``update`` keys it keeps; a training-only change (``-S update.lr=...``) does not rerun warmup.
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Iterable, Iterator, Mapping

# Params that decide where or how a stage runs, never what it computes: a stage may read them without
# listing them (the keys Config.params_hash leaves out). train.ablations and train.seeds: which arms and
# seeds exist (each (arm, seed) is its own train@ stage, its seed in the command); train.steps_per_task:
# training steps per Prefect task; train.checkpoint_dir: where checkpoints are kept; tracking: where MLflow
# logs; launch: on how many ranks train@ runs.
NON_RESULT_PARAMS: tuple[str, ...] = ("train.ablations", "train.seeds", "train.steps_per_task",
                                      "train.checkpoint_dir", "tracking", "launch")

_WARMUP_UPDATE_KEYS = ("update.weight_decay", "update.micro_batch_size", "update.max_grad_norm",
                       "update.zero_stage", "update.bf16", "update.offload_optimizer", "update.lora")

STAGE_PARAMS: dict[str, tuple[str, ...]] = {
    "prepare": ("seed", "task"),
    "warmup": ("seed", "task", "policy", "warmup", "rollout", *_WARMUP_UPDATE_KEYS, "evaluate"),
    "seed_rollouts": ("seed", "task", "policy", "rollout", "seed_rollouts", "warmup.seed"),
    "fit_predictor": ("seed", "task", "policy", "predictor", "warmup.seed"),
    "train": ("seed", "task", "policy", "rollout", "predictor", "allocation", "advantages", "update",
              "train.num_steps", "train.token_budget", "train.eval_every_tokens", "train.checkpoint_every",
              "train.eval_every", "train.eval_prompts",
              "train.eval_samples", "train.probe_prompts", "train.probe_samples", "train.prompt_pool",
              "evaluate.temperature"),
    "evaluate": ("seed", "task", "policy", "rollout", "evaluate"),
    "report": ("seed", "train.ablations", "train.seeds", "evaluate.pass_k", "evaluate.num_prompts", "evaluate.split",
               "report",
               "tracking"),
}


def _lookup(cfg, key: str):
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def stage_params(cfg, stage: str) -> dict:
    """The values of the params ``stage`` reads (``STAGE_PARAMS``), nested like ``params.yaml``.

    Args:
        cfg: ``trace.configuration.config.Config``.
        stage: a DVC stage name without the ``@item`` suffix (``"train"``, not ``"train@trace"``).

    Returns:
        e.g. ``{"seed": 0, "update": {"zero_stage": 0, ...}}``: sections as JSON-ready mappings, enums as
        their values (the stage's MLflow params, logged flattened).

    Raises:
        KeyError: ``stage`` is not in ``STAGE_PARAMS`` (the message lists the stages).
    """
    from enum import Enum

    from pydantic import BaseModel

    if stage not in STAGE_PARAMS:
        raise KeyError(f"unknown stage {stage!r}; stages with a params table: {sorted(STAGE_PARAMS)}")
    out: dict = {}
    for key in STAGE_PARAMS[stage]:
        value = _lookup(cfg, key)
        if isinstance(value, BaseModel):
            value = value.model_dump(mode="json")
        elif isinstance(value, Enum):
            value = value.value
        elif isinstance(value, tuple):
            value = [v.value if isinstance(v, Enum) else v for v in value]
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def is_covered(key: str, listed: Iterable[str]) -> bool:
    """True when ``key`` is one of ``listed`` or lies inside one of them (``"update.lr"`` in ``"update"``;
    ``""`` covers every key)."""
    return any(p == "" or key == p or key.startswith(p + ".") for p in listed)


def uncovered(keys: Iterable[str], listed: Iterable[str], exempt: Iterable[str] = ()) -> list[str]:
    """Sorted ``keys`` that no entry of ``listed`` (nor of ``exempt``) covers."""
    listed, exempt = list(listed), list(exempt)
    return sorted({k for k in keys if not is_covered(k, listed) and not is_covered(k, exempt)})


def _dvc_stages(dvc_yaml: Path) -> dict:
    import yaml

    data = yaml.safe_load(Path(dvc_yaml).read_text()) or {}
    stages = data.get("stages")
    if not isinstance(stages, dict):
        raise ValueError(f"{dvc_yaml} has no 'stages' mapping")
    return {name: (body.get("do", body) if isinstance(body, dict) else {}) for name, body in stages.items()}


def dvc_stage_params(dvc_yaml: str | Path) -> dict[str, list[str]]:
    """The params keys ``dvc.yaml`` lists per stage (a ``foreach`` stage: its ``do`` block).

    Args:
        dvc_yaml: path of ``dvc.yaml``.

    Returns:
        ``{stage: [dotted key, ...]}``; a stage that tracks the whole ``params.yaml`` (``- params.yaml:``)
        gets ``[""]``, which covers every key.

    Raises:
        ValueError: the file has no ``stages`` mapping, or a stage reads params from a file other than
            ``params.yaml`` (name the file's keys in ``params.yaml`` instead).
    """
    out: dict[str, list[str]] = {}
    for name, body in _dvc_stages(Path(dvc_yaml)).items():
        keys: list[str] = []
        for entry in body.get("params", []) or []:
            if isinstance(entry, str):
                keys.append(entry)
                continue
            for file, file_keys in dict(entry).items():
                if file != "params.yaml":
                    raise ValueError(f"{dvc_yaml}: stage {name} reads params from {file}; only params.yaml "
                                     "is checked against trace.configuration.stages.STAGE_PARAMS")
                keys.extend(file_keys or [""])
        out[name] = keys
    return out


def missing_params(data: Mapping, listed: Mapping[str, list[str]]) -> dict[str, list[str]]:
    """Per stage, the listed params keys that a params mapping does not set (DVC refuses to run such a stage).

    Args:
        data: the params file as read (nested mapping), before defaults are filled in.
        listed: ``dvc_stage_params`` of ``dvc.yaml``.

    Returns:
        ``{stage: [missing dotted key, ...]}`` for the stages that miss any (``""`` entries never miss).
    """
    out: dict[str, list[str]] = {}
    for stage, keys in listed.items():
        for key in keys:
            node = data
            for part in key.split(".") if key else []:
                if not isinstance(node, Mapping) or part not in node:
                    out.setdefault(stage, []).append(key)
                    break
                node = node[part]
    return out


def stage_deps(dvc_yaml: str | Path, stage: str, item: str | Mapping[str, object] | None = None) -> list[str]:
    """The ``deps`` paths ``dvc.yaml`` lists for ``stage``, with the stage's item filled in.

    Args:
        dvc_yaml: path of ``dvc.yaml``.
        stage: the stage name without ``@...``.
        item: a ``foreach`` stage's item (replaces ``${item}``), a ``matrix`` stage's item as a mapping
            (``{"ablation": "trace", "seed": 0}`` replaces ``${item.ablation}`` and ``${item.seed}``), or None
            to leave the paths as written.

    Raises:
        KeyError: ``dvc.yaml`` has no stage ``stage``.
    """
    stages = _dvc_stages(Path(dvc_yaml))
    if stage not in stages:
        raise KeyError(f"{dvc_yaml} has no stage {stage!r}; stages: {sorted(stages)}")
    if item is None:
        fill = {}
    elif isinstance(item, Mapping):
        fill = {f"${{item.{key}}}": str(value) for key, value in item.items()}
    else:
        fill = {"${item}": str(item)}
    deps = []
    for entry in stages[stage].get("deps", []) or []:
        path = entry if isinstance(entry, str) else next(iter(dict(entry)))
        for placeholder, value in fill.items():
            path = path.replace(placeholder, value)
        deps.append(path)
    return deps


def _is_bytecode(path: Path) -> bool:
    return "__pycache__" in path.parts or path.suffix in (".pyc", ".pyo")


def deps_digest(root: str | Path, paths: Iterable[str]) -> str:
    """sha256 (first 12 hex chars) of the contents of ``paths`` under ``root``, files and folders alike.

    Bytecode (``__pycache__``, ``*.pyc``) is left out, as ``.dvcignore`` leaves it out of DVC's hashes; a
    missing path hashes as missing (the stage itself then fails on it).
    """
    root = Path(root)
    digest = hashlib.sha256()
    for rel in sorted(paths):
        path = root / rel
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            name = file.relative_to(root).as_posix()
            if _is_bytecode(file.relative_to(root)):
                continue
            digest.update(name.encode() + b"\0")
            digest.update(hashlib.sha256(file.read_bytes()).digest() if file.is_file() else b"<missing>")
    return digest.hexdigest()[:12]


# ---- recording the params a stage reads ---------------------------------------------------------------
class ParamReads:
    """Dotted params keys read while ``record_param_reads`` is active, grouped by a label (the stage)."""

    def __init__(self) -> None:
        self.by_stage: dict[str, set[str]] = {}
        self.current: str | None = None

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Attribute the reads inside the block to stage ``name``."""
        previous, self.current = self.current, name
        self.by_stage.setdefault(name, set())
        try:
            yield
        finally:
            self.current = previous

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Attribute the reads inside the block to no stage (e.g. logging the table's own values)."""
        previous, self.current = self.current, None
        try:
            yield
        finally:
            self.current = previous

    def add(self, key: str) -> None:
        if self.current is not None:
            self.by_stage[self.current].add(key)

    def __getitem__(self, stage: str) -> set[str]:
        return self.by_stage.get(stage, set())


# methods of a config that identify a run rather than feed a result: reads inside them are not recorded
_IDENTITY_METHODS = frozenset({"params_hash", "resume_hash"})
# methods that read every value of their section at once
_WHOLE_SECTION_METHODS = frozenset({"model_dump", "model_dump_json", "dict", "json"})


@contextlib.contextmanager
def record_param_reads() -> Iterator[ParamReads]:
    """Record every param read from a ``trace.configuration.config.Config`` (and its sections) loaded inside the block.

    Configs made by ``trace.configuration.config.config_from_dict`` (so also ``load_config``) while recording are watched;
    the checks that run while a config is validated are not reads of a stage. A read is a field access
    reached from a watched config: ``cfg.update.zero_stage`` records
    ``"update.zero_stage"``; ``model_dump`` on a section records the whole section; ``model_copy(update=...)``
    gives a copy whose replaced fields are not params (not recorded) and whose other fields record as the
    original's. Reads inside ``params_hash`` / ``resume_hash`` (run identity) are not recorded. Only code in
    this process is seen; attribute access on configs is slower while recording (tests only).

    Yields:
        ``ParamReads``: use ``with reads.stage(name): ...`` to attribute reads to a stage.
    """
    import trace.configuration.config as config_module
    from trace.configuration.config import _Section

    reads = ParamReads()
    # id -> (object kept alive so its id is not reused, dotted path, fields not taken from params)
    paths: dict[int, tuple[object, str, frozenset]] = {}
    suspended = [0]

    def register(obj, path: str, masked: frozenset = frozenset()) -> None:
        paths[id(obj)] = (obj, path, masked)

    def join(path: str, name: str) -> str:
        return f"{path}.{name}" if path else name

    def getattribute(self, name: str):
        value = object.__getattribute__(self, name)
        if name.startswith("_") or suspended[0]:
            return value
        entry = paths.get(id(self))
        if entry is None:
            return value
        _, path, masked = entry
        if name in type(self).model_fields:
            if name in masked:
                return value
            if isinstance(value, _Section):
                if id(value) not in paths:
                    register(value, join(path, name))
            else:
                reads.add(join(path, name))
            return value
        if name in _IDENTITY_METHODS:
            def identity(*args, **kwargs):
                suspended[0] += 1
                try:
                    return value(*args, **kwargs)
                finally:
                    suspended[0] -= 1
            return identity
        if name in _WHOLE_SECTION_METHODS:
            reads.add(path)
            return value
        if name == "model_copy":
            def model_copy(*args, **kwargs):
                update = kwargs.get("update") if "update" in kwargs else (args[0] if args else None)
                copy = value(*args, **kwargs)
                register(copy, path, masked | frozenset(update or {}))
                return copy
            return model_copy
        return value

    config_from_dict = config_module.config_from_dict

    def watched_config_from_dict(*args, **kwargs):
        cfg = config_from_dict(*args, **kwargs)
        register(cfg, "")
        return cfg

    config_module.config_from_dict = watched_config_from_dict
    _Section.__getattribute__ = getattribute
    try:
        yield reads
    finally:
        del _Section.__getattribute__
        config_module.config_from_dict = config_from_dict

