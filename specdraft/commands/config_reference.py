"""The configuration reference page (docs/config-reference.md), generated from the schema.

Every key's meaning is the comment the schema gives it (config/schema.py's TrainConfig / WandbConfig, each
family's `options` dataclass, `SHARED_KEYS` in drafts/): written once, beside the key, read here.
`python -m specdraft.commands.config_reference > docs/config-reference.md` (`make docs` runs it).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import typing
from typing import Any, Dict, List, Tuple

from specdraft.config import TrainConfig, WandbConfig
from specdraft.drafts import SHARED_KEYS, SPECS


def field_comments(cls: type) -> Dict[str, str]:
    """{field: its comment} of a dataclass and its dataclass bases: the comment on the field's
    line, else the comment lines right above it."""
    found: Dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        source = textwrap.dedent(inspect.getsource(klass))
        comments = {
            tok.start[0]: tok.string.lstrip("#").strip()
            for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT
        }
        lines = source.splitlines()
        body = ast.parse(source).body[0].body
        for node in body:
            if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
                continue
            trailing = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
            above: List[str] = []
            n = node.lineno - 1
            while n in comments and lines[n - 1].lstrip().startswith("#"):
                above.insert(0, comments[n])
                n -= 1
            found[node.target.id] = " ".join(trailing or above)
    return found


def type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return " or ".join(type_name(a) for a in rest) + " or null"
    if origin in (list, List):
        return f"list of {type_name(args[0])}" if args else "list"
    if hint is Any:
        return "any"
    return getattr(hint, "__name__", str(hint))


def default_text(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if value == "???":
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)


Row = Tuple[str, str, str, str, str]  # key, type, default, families, meaning


def reference_rows() -> List[Row]:
    """One row per key of the schema, in the schema's order: top-level keys, `wandb.`, `draft.`."""
    rows: List[Row] = []
    for prefix, cls in (("", TrainConfig), ("wandb.", WandbConfig)):
        hints, meaning = typing.get_type_hints(cls), field_comments(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                continue  # a section (draft, wandb): its keys are rows of their own
            rows.append((prefix + f.name, type_name(hints[f.name]), default_text(f), "all", meaning[f.name]))
    draft_rows: Dict[str, Row] = {}
    draft_fields = {f.name: f for f in dataclasses.fields(_draft_schema())}
    draft_hints = typing.get_type_hints(_draft_schema())
    for name, text in SHARED_KEYS.items():
        draft_rows[name] = (
            f"draft.{name}",
            type_name(draft_hints[name]),
            default_text(draft_fields[name]),
            "all",
            text,
        )
    meanings = {name: field_comments(cls.options) for name, cls in SPECS.items()}
    for key in draft_fields:
        if key in SHARED_KEYS:
            continue
        readers = [name for name in SPECS if key in meanings[name]]
        # a key two families read with other meanings (target_layers' default): each family's
        by_meaning: Dict[str, List[str]] = {}
        for name in readers:
            by_meaning.setdefault(meanings[name][key], []).append(name)
        text = (
            next(iter(by_meaning))
            if len(by_meaning) == 1
            else "; ".join(f"{', '.join(names)}: {m}" for m, names in by_meaning.items())
        )
        families = "all" if len(readers) == len(SPECS) else ", ".join(readers)
        draft_rows[key] = (f"draft.{key}", type_name(draft_hints[key]), default_text(draft_fields[key]), families, text)
    return rows + list(draft_rows.values())


def _draft_schema() -> type:
    return typing.get_type_hints(TrainConfig)["draft"]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def reference_markdown() -> str:
    out = [
        "# Configuration reference",
        "",
        "Every key of a run's config, with its type, its default and the draft families that read it.",
        "Training keys are top level; `draft.` keys sit under `draft:`, `wandb.` keys under `wandb:`. A",
        "key of another family is refused (`not a key of draft.type ...`). `specdraft config CONFIG",
        "[key=value ...]` prints a config resolved with every default, as a run records it in",
        "`config.yaml`.",
        "",
        "<!-- Generated by `python -m specdraft.commands.config_reference` from the schema's comments",
        "     (specdraft/config/schema.py, specdraft/drafts/): edit those, then `make docs`. -->",
        "",
        "| key | type | default | families | meaning |",
        "|---|---|---|---|---|",
    ]
    for key, kind, default, families, meaning in reference_rows():
        out.append(f"| `{key}` | {_cell(kind)} | `{_cell(default)}` | {families} | {_cell(meaning)} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(reference_markdown(), end="")
