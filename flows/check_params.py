"""Stage ``check_params``: validate ``params.yaml`` before any other stage runs.

``dvc.yaml`` makes it the first stage: it tracks the whole params file, so DVC runs it whenever a param
changed, and ``prepare`` depends on its output, so it runs before every other stage. An invalid or unknown
value stops ``dvc repro`` / ``dvc exp run`` there, within a second or two, printing each bad key with its
value, the rule it breaks and how to fix it (no traceback). Its output (``--out data/params_checked``) is
one fixed line, so a passing check never invalidates ``prepare``. It imports neither torch, Prefect nor
MLflow.

Usage:
    python -m flows.check_params [--params params.yaml] [-S key=value ...] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CHECKED_TEXT = "params.yaml passed trace.configuration.config validation\n"

UNDO_HINT = ("Fix the value in {name} (or in the -S option) and run again. A failed `dvc exp run -S ...` "
             "leaves its values in params.yaml: `git diff params.yaml` shows them, `git checkout params.yaml` "
             "restores the committed file.")


def parse_overrides(items: list[str]) -> dict:
    """``["train.num_steps=100", ...]`` -> ``{"train.num_steps": 100}``, values read as YAML (as ``dvc exp run -S``).

    A leading ``+`` or ``++`` (``dvc exp run -S +task.files.train_path=...``: Hydra's "add a key the file lacks")
    is dropped: the check validates the resulting params whether or not the file had the key.

    Raises:
        ConfigError: an item without ``=``, or a value that is not valid YAML (the message shows the item and
            the expected form).
    """
    import yaml

    from trace.configuration.config import ConfigError

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        key = key[2:] if key.startswith("++") else key.removeprefix("+")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must be KEY=VALUE, e.g. train.num_steps=100")
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            problem = str(getattr(err, "problem", None) or err).strip()
            raise ConfigError(f"override {item!r}: the value {value!r} is not valid YAML ({problem}); write it as "
                              "in params.yaml, e.g. train.seeds=[0,1,2] or update.lr=3.0e-4, and quote the "
                              "whole -S argument in the shell") from None
    return out


def check_params(path: str | Path, overrides: dict | None = None, undo_hint: bool = True) -> str | None:
    """Validate a params file (with optional dotted-key overrides) against ``trace.configuration.config``.

    Args:
        path: the params file.
        overrides: dotted keys set on top of the file, e.g. ``{"train.num_steps": 3}``; the file is not changed.
        undo_hint: end the message with how to undo values a failed ``dvc exp run -S`` left in params.yaml.

    Returns:
        ``None`` when valid, else the message to print: every bad key with its value and rule, then the fix.
    """
    from trace.configuration.config import ConfigError
    from trace.configuration.params_file import load_config

    try:
        cfg = load_config(path, overrides=overrides)
    except ConfigError as err:
        if undo_hint:
            return f"{err}\n{UNDO_HINT.format(name=Path(path).name)}"
        return f"{err}\nFix the value and run again; {Path(path).name} is unchanged."
    dvc_yaml = Path(path).resolve().parent / "dvc.yaml"
    if Path(path).name == "params.yaml" and dvc_yaml.is_file():
        return _missing_dvc_params(Path(path), dvc_yaml, cfg, overrides or {})
    return None


def _missing_dvc_params(path: Path, dvc_yaml: Path, cfg, overrides: dict) -> str | None:
    """DVC refuses a stage whose listed params the file does not set: name each with its default value."""
    import yaml

    from trace.configuration.stages import dvc_stage_params, missing_params

    data = yaml.safe_load(path.read_text()) or {}
    for key in overrides:
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = True
    missing = missing_params(data, dvc_stage_params(dvc_yaml))
    if not missing:
        return None
    lines = [f"{path} lacks params that {dvc_yaml.name} tracks (dvc refuses to run a stage without them):"]
    for key in sorted({k for keys in missing.values() for k in keys}):
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        stages = ", ".join(s for s, keys in missing.items() if key in keys)
        if hasattr(value, "model_dump"):  # a whole section (dvc.yaml tracks e.g. `report`)
            value = value.model_dump(mode="json")
        shown = json.dumps(getattr(value, "value", value))
        lines.append(f"  - {key} (read by {stages}): add it, e.g. its default {key.split('.')[-1]}: {shown}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default=str(REPO_ROOT / "params.yaml"), help="params file (default params.yaml)")
    parser.add_argument("-S", "--set-param", action="append", default=[], dest="overrides",
                        help="check with this override KEY=VALUE (repeatable), as dvc exp run -S")
    parser.add_argument("--out", default=None, help="on success write a fixed line to this file (the DVC stage's output)")
    args = parser.parse_args(argv)
    from trace.errors import user_errors

    with user_errors():
        problem = check_params(args.params, parse_overrides(args.overrides))
    if problem:
        print(problem, file=sys.stderr)
        raise SystemExit(1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(CHECKED_TEXT)


if __name__ == "__main__":
    main()
