"""Reading params files: strict YAML (a key written twice is an error with both line numbers) -> ``Config``.

``read_params_file`` is the one reader of params YAML; ``load_config`` reads a file, applies dotted
overrides and validates the mapping with ``trace.configuration.config.config_from_dict``. Every problem raises
``ConfigError`` naming the file, the key and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from trace.configuration import config
from trace.configuration.config import Config, ConfigError


_YAML_MERGE_TAG = "tag:yaml.org,2002:merge"


def _duplicate_key(node: yaml.Node, constructor: yaml.constructor.SafeConstructor,
                   path: tuple[str, ...] = (), visited: set[int] | None = None) -> tuple[str, int, int] | None:
    """The first mapping key given twice under ``node``: (dotted key, first line, second line), 1-based.

    Keys are compared as the values YAML reads them as (``1`` and ``"1"`` differ, ``lr`` and ``"lr"`` do
    not). Keys a ``<<`` merge brings in may be overridden; only keys written twice in one mapping count.
    A node reached again through an alias is checked once.
    """
    visited = set() if visited is None else visited
    if id(node) in visited:
        return None
    visited.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first_line: dict = {}
        for key_node, value_node in node.value:
            if key_node.tag == _YAML_MERGE_TAG:
                continue
            try:
                key = constructor.construct_object(key_node, deep=True)
                hash(key)
            except (yaml.YAMLError, TypeError):
                key = (key_node.tag, str(getattr(key_node, "value", key_node)))
            line = key_node.start_mark.line + 1
            dotted = ".".join(path + (str(key),)).replace(".[", "[")
            if key in first_line:
                return dotted, first_line[key], line
            first_line[key] = line
            found = _duplicate_key(value_node, constructor, path + (str(key),), visited)
            if found:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for idx, item in enumerate(node.value):
            found = _duplicate_key(item, constructor, path + (f"[{idx}]",), visited)
            if found:
                return found
    return None


def parse_params_yaml(text: str, source: str = "<params>") -> Any:
    """Parse params YAML strictly: like ``yaml.safe_load``, but a key repeated in one mapping is an error.

    ``yaml.safe_load`` keeps the last of two equal keys, so a second ``update:`` section would silently
    replace the first whole and its keys would fall back to their defaults.

    Args:
        text: the YAML document.
        source: the file name, for messages.

    Returns:
        The parsed document (``None`` for an empty one).

    Raises:
        ConfigError: invalid YAML, or a repeated key (names the dotted key, both line numbers and ``source``).
    """
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is None:
            return None
        found = _duplicate_key(node, yaml.constructor.SafeConstructor())
        if found:
            key, first, second = found
            raise ConfigError(f"params file {source}: key {key!r} is given twice (lines {first} and {second}); "
                              "YAML would keep only the last and silently drop the first: merge them into one")
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"params file {source} is not valid YAML: {err}") from None


def read_params_file(path: str | Path) -> dict:
    """Read a params YAML file strictly (``parse_params_yaml``): every params file is read through here.

    Args:
        path: the YAML file.

    Returns:
        The top-level mapping (``{}`` for an empty file).

    Raises:
        ConfigError: the file is missing, is not valid YAML, repeats a key, or is not a mapping.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"params file {path} not found; pass --params PATH or create it (see params.yaml)")
    data = parse_params_yaml(path.read_text(), str(path)) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"params file {path} must hold a mapping of sections, got {type(data).__name__}")
    return data


def set_dotted(data: dict, key: str, value: Any, source: str = "<params>") -> None:
    """Set the dotted ``key`` (``"train.num_steps"``) of a params mapping to ``value``, creating sections.

    Raises:
        ConfigError: the key is empty or has an empty part, or a part before the last names a value that is
            not a section (``seed.x`` when ``seed`` is a number); the message names the key and ``source``.
    """
    parts = key.split(".")
    if not all(part.strip() for part in parts):
        raise ConfigError(f"override {key!r}: a key is dotted section names, e.g. train.num_steps")
    node = data
    for depth, part in enumerate(parts[:-1]):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            section = ".".join(parts[:depth + 1])
            raise ConfigError(f"override {key!r}: {section} is a value ({node!r} in {source}), not a section "
                              f"with keys; set {section}=VALUE instead, or pick a key of a section")
    node[parts[-1]] = value


def load_config(path: str | Path = "params.yaml", overrides: dict | None = None) -> Config:
    """Load and validate a params file.

    Args:
        path: YAML file.
        overrides: dotted keys to set after loading, e.g. ``{"train.num_steps": 3}``.

    Raises:
        ConfigError: the file is missing, is not a YAML mapping, repeats a key, or holds an invalid / unknown
            key; or an override's key passes through a value that is not a section.
    """
    path = Path(path)
    data = read_params_file(path)
    for key, value in (overrides or {}).items():
        set_dotted(data, key, value, source=str(path))
    # looked up on the module at call time, so that trace.configuration.stages.record_param_reads sees the configs made here
    return config.config_from_dict(data, str(path))
