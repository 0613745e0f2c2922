"""The run configuration: a typed schema, YAML files plus dotted `key=value` overrides.

Training keys are top level (as in LongSpec's flat config); draft-specific ones sit under `draft.`.
Everything is validated here, once, so the rest of the code can trust the values.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import hashlib
import json
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from specdraft.drafts import FAMILIES, SHARED_KEYS, DraftConfig, check_family_keys, draft_family, family_keys
from specdraft.drafts.objectives import validate_objective_options
from specdraft.atomic import write_atomic
from specdraft.errors import SpecdraftError
from specdraft.paths import specdraft_home
from specdraft.parallel.checks import sequence_parallel_key_refusal
from specdraft.target.model import check_packed_documents, check_sequence_length, check_tokenizer, load_target_config
from specdraft.run import step_of

# `${specdraft_home:}` in a YAML config: where `specdraft demo` caches its target and data.
if not OmegaConf.has_resolver("specdraft_home"):
    OmegaConf.register_resolver("specdraft_home", lambda: str(specdraft_home()))

# The demo configs live once, in the package (configs/demo*.yaml are links to them), so
# `specdraft demo --config NAME` finds every one an installed package ships.
PACKAGED_CONFIGS = Path(__file__).parent / "configs"
DEMO_CONFIG = PACKAGED_CONFIGS / "demo.yaml"


def demo_config_path(name: Optional[str]) -> str:
    """`specdraft demo --config`: a bare name (demo-eagle3) is a packaged config, else a path."""
    if name is None:
        return str(DEMO_CONFIG)
    packaged = PACKAGED_CONFIGS / f"{name}.yaml"
    if packaged.is_file():
        return str(packaged)
    if not os.path.isfile(name):
        shipped = sorted(p.stem for p in PACKAGED_CONFIGS.glob("*.yaml"))
        raise SpecdraftError(f"--config {name}: neither a packaged demo config ({', '.join(shipped)}) "
                             f"nor a file")
    return name

def family_demo_configs() -> dict:
    """{draft.type: path} of the packaged demo configs: each family brings its own demo*.yaml."""
    found = {}
    for path in sorted(PACKAGED_CONFIGS.glob("demo*.yaml")):
        found.setdefault(str(OmegaConf.load(path).draft.get("type", "glide")), str(path))
    return found


PRECISIONS = ("fp32", "bf16")
TARGET_PLACEMENTS = ("auto", "replicated", "partitioned")


@dataclass
class WandbConfig:
    project: Optional[str] = None  # None: W&B off
    mode: str = "offline"  # offline needs no network; "online" syncs
    run_name: Optional[str] = None  # the W&B run's name; None: W&B picks one


@dataclass
class TrainConfig:
    target: str = "???"  # local HF directory of the frozen target (weights + tokenizer)
    data_files: Any = "???"  # jsonl / parquet: a path, a glob or a list of them
    eval_prompts: Optional[str] = None  # jsonl of prompts for tau every eval_steps
    # the chat template's enable_thinking (Qwen3-style templates) for the data and the eval prompts,
    # as the server is run; None: the template's default
    thinking: Optional[bool] = None
    data_cache_dir: Optional[str] = None  # tokenised + packed data; default $SPECDRAFT_HOME/data
    max_seq_length: int = 512  # tokens per packed training sequence
    # true: a row with nothing to learn (no assistant turn, template refusal, empty answers) or with
    # turns not trained yet (a tool turn, null content) stops the data build naming file:line;
    # false: it is skipped and counted in the start-up summary
    data_strict: bool = False
    # packed conversations: positions restart and attention stops at each conversation border
    # (target and draft); false: a window is one stream across borders (LongSpec's packing)
    document_mask: bool = True
    per_device_batch_size: int = 2  # sequences per rank per micro step
    gradient_accumulation_steps: int = 1  # micro steps per optimizer step
    learning_rate: float = 5e-4  # AdamW peak learning rate (LongSpec's)
    weight_decay: float = 0.1  # applied to matrices only, never to norms
    adam_beta1: float = 0.9  # AdamW beta1
    adam_beta2: float = 0.95  # AdamW beta2
    adam_eps: float = 1e-6  # AdamW epsilon
    max_grad_norm: float = 1.0  # 0 disables clipping
    num_train_epochs: int = 1  # used when max_steps < 0
    max_steps: int = -1  # optimizer steps; overrides num_train_epochs when > 0
    warmup_proportion: float = 0.1  # linear warmup over this share of the steps ...
    warmup_steps: int = -1  # ... unless given in steps here
    min_lr_ratio: float = 0.0  # cosine decays to learning_rate * min_lr_ratio
    logging_steps: int = 10  # metrics.jsonl / TensorBoard / progress bar every N steps
    save_steps: int = 200  # checkpoint + draft export every N steps (and at the end)
    eval_steps: int = -1  # tau on eval_prompts every N steps; <= 0 disables
    eval_temperature: float = 0.0  # the in-training tau's sampling temperature (0: greedy)
    keep_last: int = 2  # committed checkpoint slots kept (2 = LongSpec's last_ds/last_2ds)
    resume: str = "auto"  # auto: newest committed slot; no; or a slot / run directory path
    seed: int = 42  # data order, per-batch randomness and initial weights; a resume keeps it
    precision: str = "fp32"  # fp32 | bf16 (fp16 is refused: the chunked losses' gradients would underflow)
    zero_stage: int = 2  # DeepSpeed ZeRO stage 0-3
    # ZeRO-3: the frozen target "replicated" on every device (no gathers), "partitioned" (for
    # targets that do not fit), or "auto": replicated when the memory model says it fits
    target_placement: str = "auto"
    # ranks sharing each sequence (Ulysses sequence parallelism): T / N tokens each; divides the
    # world size, max_seq_length and the target's attention heads
    sequence_parallel_size: int = 1
    loss_chunk_size: int = 0  # tokens per cross-entropy chunk; 0: from the vocab (~256 MiB fp32 logits)
    output_dir: str = "runs/default"  # the run directory: config.yaml, ckpt/, step_<N>/ exports, metrics
    export_formats: Optional[List[str]] = None  # serving formats each save writes beside native; None: the family's
    draft: DraftConfig = field(default_factory=DraftConfig)
    # several drafts trained from one target pass: {name: the keys of a `draft:` section, plus
    # PER_DRAFT_KEYS}; None: the one `draft:` above (see "several drafts" below)
    drafts: Optional[Dict[str, Any]] = None
    wandb: WandbConfig = field(default_factory=WandbConfig)


def load_config(path: Optional[str], overrides: List[str] = ()) -> DictConfig:
    """Schema defaults <- YAML file <- `key=value` overrides, validated; raises SpecdraftError.
    A key the schema lacks is blamed on where it was given: the file, or the override itself."""
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
        _validate(cfg, path or "command line", given_draft_keys(layers[1:]), source_of)
    else:
        _validate_drafts(cfg, path or "command line", given_draft_keys(layers[1:]))
    return cfg


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
    """"override 'k=v'" for the override that set `key` (or a key under it); all of them if unsure."""
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


def _all_keys(node: DictConfig, prefix: str = "") -> List[str]:
    keys = []
    for key in node.keys():
        dotted = f"{prefix}{key}"
        keys.append(dotted)
        child = OmegaConf.select(node, str(key), throw_on_missing=False)
        if isinstance(child, DictConfig):
            keys.extend(_all_keys(child, dotted + "."))
    return keys


def _unknown_key_message(err: ConfigKeyError) -> str:
    key = err.full_key or str(getattr(err, "key", ""))
    known = _all_keys(OmegaConf.structured(TrainConfig))
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"unknown key '{key}'{hint}"


def _validation_message(err: ValidationError) -> str:
    schema_type = TrainConfig
    for part in str(err.full_key).split("."):
        hints = typing.get_type_hints(schema_type) if dataclasses.is_dataclass(schema_type) else {}
        schema_type = hints.get(part)
    expected = getattr(schema_type, "__name__", None) or str(schema_type).replace("typing.", "")
    return f"key '{err.full_key}': value {err.value!r} is not a valid {expected}"


def _validate(cfg: DictConfig, source: str, draft_keys: List[str] = (), source_of=None) -> None:
    def fail(key: str, why: str) -> None:
        raise SpecdraftError(f"{source_of(key) if source_of else source}: key '{key}': {why}")

    for key in ("target", "data_files"):
        if OmegaConf.is_missing(cfg, key):
            fail(key, "is required")
    if cfg.precision == "fp16":
        # the chunked losses compute the draft's gradient in the forward pass, before DeepSpeed's
        # fp16 loss scale exists, so small gradients would underflow to zero in fp16
        fail("precision", "fp16 is not supported for training (the chunked losses' gradients would underflow "
                          "before loss scaling); use bf16")
    if cfg.precision not in PRECISIONS:
        fail("precision", f"{cfg.precision!r} is not one of {', '.join(PRECISIONS)}")
    if cfg.zero_stage not in (0, 1, 2, 3):
        fail("zero_stage", f"{cfg.zero_stage} is not one of 0, 1, 2, 3")
    if cfg.target_placement not in TARGET_PLACEMENTS:
        fail("target_placement", f"{cfg.target_placement!r} is not one of {', '.join(TARGET_PLACEMENTS)}")
    family = draft_family(cfg.draft.type, source)
    check_family_keys(family, draft_keys, source)
    for key in ("max_seq_length", "per_device_batch_size", "gradient_accumulation_steps",
                "logging_steps", "save_steps", "keep_last"):
        if OmegaConf.select(cfg, key) < 1:
            fail(key, f"must be >= 1, got {OmegaConf.select(cfg, key)}")
    if cfg.loss_chunk_size < 0:
        fail("loss_chunk_size", f"must be >= 0 (0: sized from the vocab), got {cfg.loss_chunk_size}")
    if cfg.max_steps <= 0 and cfg.num_train_epochs < 1:
        fail("num_train_epochs", "must be >= 1 when max_steps is not set")
    if not 0.0 <= cfg.warmup_proportion < 1.0:
        fail("warmup_proportion", f"must be in [0, 1), got {cfg.warmup_proportion}")
    if cfg.learning_rate <= 0:
        fail("learning_rate", f"must be > 0, got {cfg.learning_rate}")
    validate_objective_options(cfg.draft, source, family.default_loss, lk_family=family.lk_loss)
    if cfg.eval_temperature < 0:
        fail("eval_temperature", f"must be >= 0, got {cfg.eval_temperature}")
    if not os.path.isdir(cfg.target):
        fail("target", f"directory not found: {cfg.target}")
    if cfg.draft.init_from is not None and not os.path.exists(cfg.draft.init_from):
        fail("draft.init_from", f"not found: {cfg.draft.init_from}")
    target_config = _target_config_if_readable(cfg.target)
    if target_config is not None:  # a model directory: it must hold a tokenizer and cover the sequences
        check_tokenizer(cfg.target, f"{source}: key 'target'")
        check_sequence_length(target_config, cfg.max_seq_length, source)
        check_packed_documents(target_config, cfg.document_mask, source)
    refusal = sequence_parallel_key_refusal(cfg.sequence_parallel_size, cfg.max_seq_length, target_config, family,
                                            cfg.draft, FAMILIES)
    if refusal:
        fail(*refusal)
    family.validate_config(cfg.draft, target_config, source, cfg.max_seq_length)
    for name in cfg.export_formats or ():
        if name not in family.serving_formats:
            fail("export_formats", f"{name!r} is not a serving format of draft.type {cfg.draft.type!r} "
                                   f"(it has: {', '.join(family.serving_formats) or 'none besides native'})")
    if str(cfg.resume).lower() in ("no", "false", "none", "off"):  # YAML reads a bare `no` as False
        cfg.resume = "no"
    resolve_data_files(cfg.data_files, source)
    if cfg.eval_steps > 0 and cfg.eval_prompts is not None and not os.path.isfile(cfg.eval_prompts):
        fail("eval_prompts", f"file not found: {cfg.eval_prompts}")  # read only when tau is measured


def data_world(cfg: DictConfig, world_size: int) -> int:
    """The ranks reading distinct batches: the ranks of one sequence-parallel group read the same."""
    return world_size // cfg.get("sequence_parallel_size", 1)


def _target_config_if_readable(target_dir: str):
    """The target's transformers config, for the draft's checks against it (layer ids, vocab);
    None when the directory has no config.json yet (training start fails on it with its own message)."""
    if not os.path.isfile(os.path.join(target_dir, "config.json")):
        return None
    return load_target_config(target_dir)


def resolve_data_files(spec: Any, source: str = "config", key: str = "key 'data_files'") -> List[str]:
    """A path, a glob or a list of them -> sorted unique existing files; a miss is an error, and
    so is a directory (its files are not guessed)."""
    items = list(spec) if OmegaConf.is_list(spec) or isinstance(spec, (list, tuple)) else [spec]
    files: List[str] = []
    for item in items:
        item = str(item)
        if os.path.isdir(item):
            raise SpecdraftError(f"{source}: {key}: {item} is a directory; name its files or a glob such as "
                                 f"{os.path.join(item, '*.jsonl')}")
        matches = sorted(glob.glob(item)) if glob.has_magic(item) else [item]
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise SpecdraftError(f"{source}: {key}: no file matches {item}")
        files.extend(matches)
    if not files:
        raise SpecdraftError(f"{source}: {key}: no input files given")
    return list(dict.fromkeys(files))


def config_identity(cfg: DictConfig) -> dict:
    """Identity of the draft a checkpoint holds: draft architecture and data layout. (The target is
    identified by its content, see target.weights.target_identity, not by its path.) A run of
    several drafts: the identity of each, by name."""
    if cfg.get("drafts") is not None:
        return {name: config_identity(draft_view(cfg, name)) for name in cfg.drafts}
    draft = own_draft_keys(cfg)
    draft.pop("init_from", None)  # where a run started, not what it trains: resume ignores it
    draft.pop("gradient_checkpointing", None)  # memory, not the draft: a resume may switch it
    draft = draft_family(cfg.draft.type).identity_options(draft, _target_config_if_readable(cfg.target))
    return {"draft": draft, "max_seq_length": cfg.max_seq_length}


def config_hash(cfg: DictConfig) -> str:
    return hashlib.sha256(json.dumps(config_identity(cfg), sort_keys=True).encode()).hexdigest()[:16]


def identity_change(saved: Optional[dict], cfg: DictConfig) -> str:
    """Why a checkpoint's identity (its COMMITTED `config_identity`) differs from this run's: each
    differing key with both values. A checkpoint from before that record: its hash only."""
    if not saved:
        return ("saved with another draft or max_seq_length (config hash differs; this checkpoint does not "
                "record its keys)")
    old, new = _dotted(saved), _dotted(config_identity(cfg))
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k, "unset") != new.get(k, "unset"))
    changes = ", ".join(f"{k}: saved {old.get(k, 'unset')!r}, this run {new.get(k, 'unset')!r}" for k in keys)
    return f"saved with other settings ({changes}); set them back to resume, or choose a new output_dir"


def _dotted(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_dotted(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def own_draft_keys(cfg: DictConfig) -> dict:
    """`draft.type`, `draft.init_from` (when set) and the keys its family reads: another family's
    defaults are not part of this draft (adding a key to one family leaves the others' checkpoints
    resumable)."""
    own = family_keys(draft_family(cfg.draft.type))
    draft = OmegaConf.to_container(cfg.draft, resolve=True)
    return {key: value for key, value in draft.items()
            if key in own or key == "type" or (key in SHARED_KEYS and value is not None)}


def resolved_config_yaml(cfg: DictConfig) -> str:
    """The resolved config with every default, its `draft:` section limited to the family's own
    keys: what a run records in config.yaml and `specdraft config` prints."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if cfg.get("drafts") is None:
        resolved.pop("drafts", None)  # a one-draft run's file as it always was
        resolved["draft"] = own_draft_keys(cfg)
    else:
        del resolved["draft"]
        resolved["drafts"] = {name: dict(own_draft_keys(draft_view(cfg, name)),
                                         **{k: v for k, v in entry.items() if k in PER_DRAFT_KEYS})
                              for name, entry in resolved["drafts"].items()}
    return OmegaConf.to_yaml(OmegaConf.create(resolved))


def save_config(cfg: DictConfig, path: Path) -> None:
    write_atomic(path, resolved_config_yaml(cfg))


# -- several drafts (`drafts:`) -------------------------------------------------------------------
# A run may train several drafts from one target pass: `drafts: {name: {type: ..., family keys,
# PER_DRAFT_KEYS}}`. Each draft is configured as the same run with its keys under `draft:` would
# be (draft_view), so every check, hash and builder of a one-draft run serves each draft.

# the keys a draft of a several-draft run may set for itself; the rest of the run is shared
PER_DRAFT_KEYS = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "max_grad_norm",
                  "warmup_proportion", "warmup_steps", "min_lr_ratio", "export_formats")
DRAFT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # a folder name on every filesystem
RESERVED_NAMES = ("ckpt", "latest", "committed", "consolidated")  # names the run directory uses


def draft_names(cfg: DictConfig) -> List[Optional[str]]:
    """The drafts of a run: [None] for a one-draft run (its files where they always were), else
    the names under `drafts:`, in order."""
    return [None] if cfg.get("drafts") is None else [str(name) for name in cfg.drafts]


def draft_view(cfg: DictConfig, name: Optional[str]) -> DictConfig:
    """The run as it would be configured to train draft `name` alone: its keys under `draft:`,
    its PER_DRAFT_KEYS at the top level, no `drafts:`. name None: the one-draft run itself."""
    if name is None:
        return cfg
    entry = OmegaConf.to_container(cfg.drafts[name], resolve=True)
    base = OmegaConf.to_container(cfg, resolve=True)
    base.pop("drafts")
    base["draft"] = {k: v for k, v in entry.items() if k not in PER_DRAFT_KEYS}
    base.update({k: v for k, v in entry.items() if k in PER_DRAFT_KEYS})
    return OmegaConf.merge(OmegaConf.structured(TrainConfig), base)


def _validate_drafts(cfg: DictConfig, source: str, draft_keys: List[str]) -> None:
    """A several-draft run: the names, then each draft as a run of its own would be checked, its
    errors naming `drafts.<name>.<key>`."""
    if draft_keys:
        raise SpecdraftError(f"{source}: key 'drafts': give either draft: (one draft) or drafts: (several), not both "
                             f"(draft.{draft_keys[0]} is set)")
    if not isinstance(cfg.drafts, DictConfig) or len(cfg.drafts) == 0:
        raise SpecdraftError(f"{source}: key 'drafts': expected a mapping of draft names to draft sections")
    seen = {}
    for name in cfg.drafts:
        name = str(name)
        if not DRAFT_NAME.fullmatch(name) or name.lower() in RESERVED_NAMES or step_of(name.lower()) is not None:
            raise SpecdraftError(f"{source}: key 'drafts.{name}': a draft name must be 1-64 letters, digits, '_' or "
                                 f"'-', starting with a letter or digit, neither step_<N> nor any of "
                                 f"{', '.join(RESERVED_NAMES)} "
                                 f"(it names the draft's folders)")
        if name.lower() in seen:
            raise SpecdraftError(f"{source}: key 'drafts.{name}': the same folder name as drafts.{seen[name.lower()]} "
                                 f"on a case-insensitive filesystem")
        seen[name.lower()] = name
        if not isinstance(cfg.drafts[name], DictConfig):
            raise SpecdraftError(f"{source}: key 'drafts.{name}': expected a draft section (type: and its keys)")
    for name in cfg.drafts:
        name = str(name)
        own = [str(k) for k in cfg.drafts[name] if str(k) not in PER_DRAFT_KEYS]
        try:
            view = draft_view(cfg, name)
            _validate(view, source, own)
        except ConfigKeyError as err:
            raise SpecdraftError(_as_draft_key(_unknown_key_message(err), name, source)) from None
        except ValidationError as err:
            raise SpecdraftError(_as_draft_key(_validation_message(err), name, source)) from None
        except (SpecdraftError, OmegaConfBaseException) as err:
            raise SpecdraftError(_as_draft_key(str(err).splitlines()[0], name, source)) from None
        family = draft_family(view.draft.type)
        if len(cfg.drafts) > 1 and family.moves_target_positions(view.draft):
            raise SpecdraftError(f"{source}: key 'drafts.{name}': this draft moves the target's positions per batch "
                                 f"(GLIDE's anchor_offset), and the drafts of one run share one target pass; "
                                 f"train it alone")


def _as_draft_key(message: str, name: str, source: str) -> str:
    """An error about a draft's view, naming the key as the user wrote it: drafts.<name>.<key>."""
    message = re.sub(r"'draft\.", f"'drafts.{name}.", message)
    for key in PER_DRAFT_KEYS:
        message = message.replace(f"key '{key}'", f"key 'drafts.{name}.{key}'")
    return message if message.startswith(f"{source}:") else f"{source}: {message}"
