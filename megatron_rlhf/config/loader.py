"""Load a typed run configuration from YAML with inheritance and dotted overrides.

    config = load_config(RunConfig, "examples/ppo_tiny.yaml", ["rollout.ppo_epochs=2"])

A YAML file may name a ``base:`` file (relative to itself) whose values it overrides; chains are
followed. Values are merged onto the dataclass defaults with OmegaConf's structured configs, so an
unknown key or a value of the wrong type is refused with the key's dotted name, and each
dataclass's ``__post_init__`` then checks the meaning of the values.

Relative paths: ``base:`` and every file or directory the run reads (the keys a schema lists in
its ``INPUT_PATHS``: data files, checkpoints to start from, tokenizer files) are relative to the
folder of the YAML file that names them, as OmegaConf and Hydra users expect, so a config works
from any working directory; the same keys given as ``a.b=c`` overrides are relative to the
working directory. Both become absolute when loaded (so a run's saved ``config.yaml`` loads from
anywhere); absolute and ``~`` paths are kept. What a run writes (``run_dir``, ``out_dir``,
``checkpoint.save_dir``, caches) stays relative to the working directory.

Words YAML reads as booleans: ``off``, ``on``, ``yes`` and ``no`` (YAML 1.1, which OmegaConf
follows, on the command line and in files) are read as false and true, and a string field would
then hold ``'False'``. A schema lists its fields that take such a word in ``BOOLEAN_WORDS``
(dotted key -> the values false and true stand for), and their booleans become those values.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

T = TypeVar("T")
BASE_KEY = "base"


class ConfigError(ValueError):
    """A configuration file or override that cannot be used; the message says which and why."""


def _absolute(value: Any, folder: Path) -> Any:
    """``value`` joined to ``folder`` when it is a relative path; anything else unchanged (a
    blank value too, which the schema's own check refuses)."""
    if not isinstance(value, str) or not value.strip() or "${" in value:
        return value
    if Path(value).expanduser().is_absolute():
        return value
    return os.path.normpath(folder / value)


def _resolve_input_paths(node: DictConfig, keys: Sequence[str], folder: Path) -> None:
    """Make the relative paths under ``keys`` (dotted) of ``node`` relative to ``folder``."""
    for key in keys:
        value = OmegaConf.select(node, key, default=None, throw_on_missing=False)
        if isinstance(value, ListConfig):
            OmegaConf.update(node, key, [_absolute(item, folder) for item in value],
                             merge=False)
        elif isinstance(value, str):
            OmegaConf.update(node, key, _absolute(value, folder), merge=False)


def _boolean_words(node: DictConfig, words: dict[str, tuple[str, str]]) -> None:
    """Replace the booleans YAML made of ``off``/``on``/``yes``/``no`` under ``words``' keys
    with the values they stand for (module docstring)."""
    for key, (false, true) in words.items():
        value = OmegaConf.select(node, key, default=None, throw_on_missing=False)
        if isinstance(value, bool):
            OmegaConf.update(node, key, true if value else false, merge=False)


def _read_yaml_chain(path: Path, keys: Sequence[str],
                     seen: tuple[Path, ...] = ()) -> DictConfig:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: 'base:' chain loops back to itself via {list(seen)}")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        node = OmegaConf.load(path)
    except Exception as error:  # noqa: BLE001 - YAML parser errors have many types
        raise ConfigError(f"{path}: not valid YAML: {error}") from error
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    base = node.pop(BASE_KEY, None)
    _resolve_input_paths(node, keys, path.parent)
    if base is None:
        return node
    base_path = (path.parent / str(base)).resolve()
    if not base_path.is_file():
        raise ConfigError(f"{path}: base: {base} ({base_path}) does not exist")
    return OmegaConf.merge(_read_yaml_chain(base_path, keys, (*seen, path)), node)


def load_config(schema: type[T], path: str | Path | None = None,
                overrides: list[str] | None = None) -> T:
    """Build a ``schema`` instance from defaults, a YAML file and ``a.b=c`` overrides.

    Relative paths under ``schema.INPUT_PATHS`` are made absolute: against the folder of the
    YAML file that gives them, or the working directory for an override (module docstring).

    Raises:
        ConfigError: unreadable YAML, an unknown key, a badly typed value or an override not of
            the form ``a.b=c``; ``ValueError`` from a dataclass's own validation passes through.
    """
    if not is_dataclass(schema):
        raise TypeError(f"{schema!r} is not a dataclass")
    keys = getattr(schema, "INPUT_PATHS", ())
    words = getattr(schema, "BOOLEAN_WORDS", {})
    merged = OmegaConf.structured(schema)
    source, empty_value = "defaults", False
    try:
        if path is not None:
            source = str(path)
            node = _read_yaml_chain(Path(path), keys)
            _boolean_words(node, words)
            merged = OmegaConf.merge(merged, node)
        for item in overrides or []:
            source, empty_value = f"override {item!r}", item.endswith("=")
            if "=" not in item:
                raise ConfigError(f"override {item!r} must look like section.key=value")
            node = OmegaConf.from_dotlist([item])
            _resolve_input_paths(node, keys, Path.cwd())
            _boolean_words(node, words)
            merged = OmegaConf.merge(merged, node)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None) or "?"
        if empty_value:  # OmegaConf reads ``a.b=`` as null, which a typed field refuses
            raise ConfigError(f"{source}: {key} has no value; "
                              f"{_empty_value_hint(merged, key)}") from None
        reason = str(error.msg).splitlines()[0]
        if isinstance(error, ConfigKeyError | ConfigAttributeError):  # a key of no field
            raise ConfigError(f"{source}: unknown config key {key!r}: {reason}") from None
        raise ConfigError(f"{source}: invalid value for key {key!r}: {reason}") from None


def _empty_value_hint(merged: DictConfig, key: str) -> str:
    """How to write an empty value of ``key``'s type on the command line."""
    current = OmegaConf.select(merged, key, default=None, throw_on_missing=False)
    if isinstance(current, ListConfig):
        return f"for an empty list write {key}=[]"
    if isinstance(current, DictConfig):
        return f"for an empty mapping write {key}={{}}"
    if isinstance(current, str):
        return f"for an empty string write {key}=''"
    return f"give one, e.g. {key}={current}"


def to_yaml(config: Any) -> str:
    """The resolved configuration as YAML (for the run directory)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))
