"""Load the config tree from YAML plus `--set a.b=c` overrides, and fail early with readable errors."""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from configs.schema import Config, OpenAIConfig

CONFIG_DIR = Path(__file__).resolve().parent

# Keys the system reads from the environment (and from `.env`). Values of these never get printed.
SECRET_ENV_VARS = (
    "OPENAI_API_KEY",
    "POLYGON_API_KEY",
    "FMP_API_KEY",
    "TAVILY_API_KEY",
    "SLACK_BOT_TOKEN",
    "WANDB_API_KEY",
    "MCPRL_TOOLS_TOKEN",
)
_SECRET_KEY_PATTERN = re.compile(r"(api_?key|token|secret|password|authorization)", re.IGNORECASE)


class ConfigError(ValueError):
    """A config could not be loaded; the message names the file and the key."""


def load_dotenv_file(path: str | Path = ".env") -> None:
    """Read `.env` when present; variables already set in the environment win."""
    from dotenv import load_dotenv

    if Path(path).is_file():
        load_dotenv(path, override=False)


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b=c` → (["a", "b"], c) with c parsed as YAML, so numbers, booleans and lists keep their type."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set tools.http.port=8001")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {item!r}: value is not valid YAML: {e}") from None
    return key.strip().split("."), value


def set_items(sets: Mapping[str, Any]) -> list[str]:
    """`{"a.b": c}` → `["a.b=c", ...]` (what `load_config` takes as overrides), each value written so that
    `parse_override` reads it back as it was: strings and paths as they are unless YAML would read them as
    something else (`off`, `null`: then quoted), anything else as JSON (None as null, lists and mappings in flow
    form). A float in exponent form (1e-05) comes back as a string, which the config's float fields take."""
    out = []
    for key, value in sets.items():
        text = str(value) if isinstance(value, Path) else value
        if not isinstance(text, str) or yaml.safe_load(text or "''") != text:
            text = json.dumps(text)
        out.append(f"{key}={text}")
    return out


def set_args(sets: Mapping[str, Any]) -> list[str]:
    """`set_items` as command-line arguments: `["--set", "a.b=c", ...]`."""
    return [arg for item in set_items(sets) for arg in ("--set", item)]


def apply_override(tree: dict[str, Any], path: list[str], value: Any, source: str) -> None:
    """Set `tree[path[0]][path[1]]... = value`, making sections on the way; `source` names it in errors."""
    node = tree
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: {'.'.join(path[: i + 1])} is not a section, cannot set {'.'.join(path)}")
        node = child
    node[path[-1]] = value


def format_errors(err: ValidationError, source: str) -> str:
    """A pydantic error as one line per bad key: `  a.b: message (got value)`."""
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key{did_you_mean(e['loc'])}")
        else:
            got = e.get("input")
            shown = "" if isinstance(got, dict | list) or got is None else f" (got {got!r})"
            lines.append(f"  {key}: {e['msg']}{shown}")
    return "\n".join(lines)


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The config section type in a field's annotation (`X`, `X | None`, `list[X]`), or None for a value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        if found := section_model(arg):
            return found
    return None


def _key_paths(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, field in model.model_fields.items():
        yield prefix + name
        if sub := section_model(field.annotation):
            yield from _key_paths(sub, f"{prefix}{name}.")


def did_you_mean(loc: Sequence[str | int]) -> str:
    """For an unknown key at `loc`: "; did you mean <key path>?" naming a close sibling, else the same key in
    another section; "" when nothing is near."""
    model: type[BaseModel] | None = Config
    for part in loc[:-1]:
        if isinstance(part, int):  # a list item: the section type was taken from the list's annotation
            continue
        field = model.model_fields.get(part) if model else None
        model = section_model(field.annotation) if field else None
    name = str(loc[-1])
    if model is not None:
        close = difflib.get_close_matches(name, list(model.model_fields), n=1, cutoff=0.6)
        if close:
            return f"; did you mean {'.'.join(str(p) for p in [*loc[:-1], close[0]])}?"
    elsewhere = [k for k in _key_paths(Config) if k.rsplit(".", 1)[-1] == name]
    return f"; did you mean {' or '.join(elsewhere[:3])}?" if elsewhere else ""


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load `path` (YAML; None = all defaults), apply overrides, validate the whole tree."""
    source = str(path) if path else "<defaults>"
    tree: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections, got {type(tree).__name__}")
    for item in overrides:
        keys, value = parse_override(item)
        apply_override(tree, keys, value, f"--set {item}")
    if overrides:
        source += " + --set " + " ".join(overrides)
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(format_errors(e, source)) from None


def redact(value: Any, key: str = "") -> Any:
    """A copy of a config dump with secret-looking values masked, safe to print or log."""
    if isinstance(value, dict):
        return {k: redact(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, key) for v in value]
    if isinstance(value, str) and value:
        if _SECRET_KEY_PATTERN.search(key):
            return "***"
        for name in SECRET_ENV_VARS:
            secret = os.environ.get(name)
            if secret and len(secret) >= 4 and secret in value:
                value = value.replace(secret, "***")
    return value


def dump_config(cfg: Config) -> str:
    """The config as YAML with secrets masked."""
    return yaml.safe_dump(redact(cfg.model_dump(mode="json")), sort_keys=False)


# Environment variables that point any OpenAI-compatible section at another model or server.
OPENAI_ENV = {"OPENAI_MODEL": "model", "OPENAI_BACKEND": "backend", "OPENAI_BASE_URL": "base_url"}


def apply_openai_env(openai: OpenAIConfig, prefix: str, overrides: list[str], environ: Mapping[str, str]) -> None:
    """OPENAI_MODEL / OPENAI_BACKEND / OPENAI_BASE_URL into the section at `prefix` (e.g.
    `generation.openai`), except keys a `--set` names: the command line wins over the environment."""
    set_keys = {o.split("=", 1)[0].strip() for o in overrides}
    for var, key in OPENAI_ENV.items():
        raw = environ.get(var, "").strip()
        if raw and f"{prefix}.{key}" not in set_keys:
            try:
                setattr(openai, key, raw)
            except ValidationError as e:
                raise ConfigError(f"environment {var}={raw}: {'; '.join(err['msg'] for err in e.errors())}") from None
