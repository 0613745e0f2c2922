"""A run's configuration from its sources: schema defaults <- a YAML file <- dotted `key=value`
overrides, then validated (validate.py); an error names the file or the override that gave the key."""

from __future__ import annotations

import os
from typing import List, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from specdraft.config.schema import TrainConfig, _unknown_key_message, _validation_message
from specdraft.config.validate import _validate, _validate_drafts
from specdraft.errors import SpecdraftError
from specdraft.paths import specdraft_home


# `${specdraft_home:}` in a YAML config: where `specdraft demo` caches its target and data.
if not OmegaConf.has_resolver("specdraft_home"):
    OmegaConf.register_resolver("specdraft_home", lambda: str(specdraft_home()))


def load_config(path: Optional[str], overrides: List[str] = (), inputs_built: bool = True) -> DictConfig:
    """Schema defaults <- YAML file <- `key=value` overrides, validated; raises SpecdraftError.
    A key the schema lacks is blamed on where it was given: the file, or the override itself.
    inputs_built False: every check but those of the target, data files and eval prompts, which
    are not built yet (`specdraft demo`, before it builds them)."""
    layers = [OmegaConf.structured(TrainConfig)]
    cfg = layers[0]
    if path is not None:
        layers.append(read_yaml(path))
        cfg = _merge(cfg, layers[-1], lambda key: path)
    layers.append(_parse_overrides(overrides))
    cfg = _merge(cfg, layers[-1], lambda key: _override_naming(key, overrides))
    overridden = {item.split("=", 1)[0] for item in overrides}
    source_of = lambda key: _override_naming(key, overrides) if key in overridden else (path or "command line")  # noqa: E731
    if cfg.drafts is None:
        _validate(cfg, path or "command line", given_draft_keys(layers[1:]), source_of, inputs_built)
    else:
        _validate_drafts(cfg, path or "command line", given_draft_keys(layers[1:]), inputs_built)
    return cfg


def check_overrides(overrides: List[str]) -> None:
    """Each `key=value` names a schema key and a value of its type (SpecdraftError naming the
    override), checked alone: before a file is read or a long job starts."""
    _merge(OmegaConf.structured(TrainConfig), _parse_overrides(overrides), lambda key: _override_naming(key, overrides))


def _merge(cfg: DictConfig, layer: DictConfig, source_of) -> DictConfig:
    """cfg <- layer; an error is one line led by source_of(the offending key)."""
    try:
        return OmegaConf.merge(cfg, layer)
    except ConfigKeyError as err:
        raise SpecdraftError(f"{source_of(err.full_key)}: {_unknown_key_message(err)}") from None
    except ValidationError as err:
        raise SpecdraftError(f"{source_of(err.full_key)}: {_validation_message(err)}") from None
    except OmegaConfBaseException as err:
        raise SpecdraftError(f"{source_of(err.full_key)}: {str(err).splitlines()[0]}") from None
    except TypeError as err:  # e.g. a list over a mapping of an untyped key (draft.loss)
        raise SpecdraftError(f"{source_of(None)}: cannot merge it into the config ({err})") from None


def _override_naming(key: Optional[str], overrides: List[str]) -> str:
    """ "override 'k=v'" for the override that set `key` (or a key under it); all of them if unsure."""
    for item in overrides:
        given = item.split("=", 1)[0]
        if key and (given == key or given.startswith(f"{key}.") or str(key).startswith(f"{given}.")):
            return f"override '{item}'"
    return "overrides " + " ".join(overrides)


def given_draft_keys(layers: List[DictConfig]) -> List[str]:
    """The `draft.` keys a YAML file or an override sets (the schema's defaults are not given)."""
    keys: List[str] = []
    for layer in layers:
        draft = layer.get("draft") if isinstance(layer, DictConfig) else None
        if isinstance(draft, DictConfig):
            keys.extend(str(k) for k in draft.keys())
    return list(dict.fromkeys(keys))


def read_yaml(path: str) -> DictConfig:
    """A YAML config file as a mapping; a directory, a missing file or a syntax error (with its
    file:line:column) is one line."""
    import yaml

    if os.path.isdir(path):
        raise SpecdraftError(f"{path}: is a directory, not a YAML config file")
    if not os.path.isfile(path):
        raise SpecdraftError(f"{path}: config file not found")
    try:
        loaded = OmegaConf.load(path)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
        raise SpecdraftError(f"{where}: not valid YAML: {err.problem or err.context}") from None
    except Exception as err:  # other parser errors: still "not valid YAML", in one line
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise SpecdraftError(f"{path}: not valid YAML: {first}") from None
    if not isinstance(loaded, DictConfig):
        raise SpecdraftError(f"{path}: expected a mapping of config keys at the top level")
    return loaded


def _parse_overrides(overrides: List[str]) -> DictConfig:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise SpecdraftError(f"override '{item}': expected key=value")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as err:
        raise SpecdraftError(f"overrides: {str(err).splitlines()[0]}") from None
