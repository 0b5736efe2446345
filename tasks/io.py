"""Task files: read and write rows as `.json` (one list), `.jsonl` (one row a line) or `.parquet`.

Rows are plain dicts here (not `TaskRow`s): the gate (`tasks/validate.py`) must see bad rows as they are.

Parquet layout. The fixed structure of a task row is stored as native Parquet columns (structs and
lists, so `reward_spec.ground_truth.complexity` can be queried like any column). Three fields do not
fit one column type: `tool_sequence[].params` and `extra_info` are free-form objects whose keys vary
per row, and `final_answer.value` is a number or a string. Those are stored as JSON strings and
decoded on read (the file's metadata lists them under `mcprl.json_fields`), so their contents come
back exactly: keys, key order, ints vs floats. Fixed fields that are missing from a row are stored
as null and are left out again on read, except `final_answer`, where null is a legal value: a row
without one reads back with `final_answer: null` (the same task to `TaskRow`). Numbers in typed
columns come back in the column's type (a tolerance of 0 as 0.0, a max_turns of 4.0 as 4). A row
that does not fit the layout (an unknown key, a wrong type) cannot be written to Parquet: write
JSONL instead.
A Parquet file without our metadata (written by another tool) is read as pyarrow gives it.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

FORMATS = (".json", ".jsonl", ".parquet")
_META_KEY = b"mcprl.json_fields"
# Paths (struct fields; [] = every list item) stored as JSON strings in Parquet.
_JSON_FIELDS = (
    "reward_spec.ground_truth.tool_sequence[].params",
    "reward_spec.ground_truth.final_answer.value",
    "extra_info",
)
_NULLABLE = {"final_answer"}  # fixed fields where null is a value, not "missing"


class TaskFileError(ValueError):
    """A task file that cannot be read or written; the message names the file and the line or row."""


def read_rows(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All rows of a `.json`, `.jsonl` or `.parquet` task file, as dicts."""
    path = Path(path)
    suffix = _suffix(path)
    if not path.is_file():
        raise TaskFileError(f"{path}: no such file")
    if suffix == ".parquet":
        return _read_parquet(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TaskFileError(f"{path}: cannot read: {e}") from e
    return _parse_json(path, text) if suffix == ".json" else _parse_jsonl(path, text)


def write_rows(rows: Iterable[dict[str, Any]], path: str | os.PathLike[str]) -> None:
    """Write rows to `path` (format from the suffix); all or nothing: a temp file renamed into place."""
    path = Path(path)
    suffix = _suffix(path)
    rows = list(rows)
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise TaskFileError(f"{path}: row {i} is a {type(row).__name__}, not an object")
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".parquet":
        table = _to_table(path, rows)  # before the temp file: a row that does not fit leaves nothing behind
        _atomic(path, lambda f: _write_table(table, f))
        return
    try:
        if suffix == ".json":
            text = json.dumps(rows, ensure_ascii=False, indent=1) + "\n"
        else:
            text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    except (TypeError, ValueError) as e:
        raise TaskFileError(f"{path}: a row is not JSON-serialisable: {e}") from e
    _atomic(path, lambda f: f.write(text.encode("utf-8")))


# --------------------------------------------------------------------------- JSON / JSONL


def _suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise TaskFileError(f"{path}: unknown task file type {suffix or '(none)'!r}; use one of {', '.join(FORMATS)}")
    return suffix


def _parse_json(path: Path, text: str) -> list[dict[str, Any]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TaskFileError(f"{path}: line {e.lineno}, column {e.colno}: invalid JSON: {e.msg}") from e
    if not isinstance(data, list):
        raise TaskFileError(f"{path}: expected a JSON list of rows, got {_json_type(data)}")
    for i, row in enumerate(data, 1):
        if not isinstance(row, dict):
            raise TaskFileError(f"{path}: row {i}: expected a JSON object, got {_json_type(row)}")
    return data


def _parse_jsonl(path: Path, text: str) -> list[dict[str, Any]]:
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():  # blank lines (e.g. a trailing one) are not rows
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskFileError(f"{path}: line {lineno}, column {e.colno}: invalid JSON: {e.msg}") from e
        if not isinstance(row, dict):
            raise TaskFileError(f"{path}: line {lineno}: expected a JSON object, got {_json_type(row)}")
        rows.append(row)
    return rows


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _atomic(path: Path, write: Callable[[Any], Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------- Parquet


def _arrow_schema() -> Any:
    import pyarrow as pa

    step = pa.struct([("step", pa.int64()), ("server", pa.string()), ("tool", pa.string()), ("params", pa.string())])
    final_answer = pa.struct([("value", pa.string()), ("tolerance", pa.float64()), ("description", pa.string())])
    ground_truth = pa.struct(
        [
            ("task_id", pa.string()),
            ("complexity", pa.string()),
            ("max_turns", pa.int64()),
            ("success", pa.struct([("must_call_tool", pa.string())])),
            ("tool_sequence", pa.list_(step)),
            ("limits", pa.struct([("max_servers", pa.int64()), ("max_tools", pa.int64())])),
            ("final_answer", final_answer),
        ]
    )
    return pa.schema(
        [
            ("data_source", pa.string()),
            ("env_class", pa.string()),
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("reward_spec", pa.struct([("method", pa.string()), ("ground_truth", ground_truth)])),
            ("extra_info", pa.string()),
        ],
        metadata={_META_KEY: json.dumps(list(_JSON_FIELDS)).encode()},
    )


def _json_paths() -> set[tuple[str, ...]]:
    return {tuple(p.split(".")) for p in _JSON_FIELDS}


def _encode(value: Any, type_: Any, path: tuple[str, ...], where: str) -> Any:
    """A row's value made to fit the Arrow type at `path`: JSON fields become strings."""
    import pyarrow as pa

    if path in _json_paths():
        return json.dumps(value, ensure_ascii=False)
    if value is None:
        return None
    if pa.types.is_struct(type_):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object")
        names = {type_.field(i).name for i in range(type_.num_fields)}
        unknown = sorted(set(value) - names)
        if unknown:  # pyarrow would drop them silently
            raise ValueError(f"{where}: field {unknown[0]!r} has no Parquet column")
        return {
            f.name: _encode(value[f.name], f.type, (*path, f.name), f"{where}.{f.name}")
            for f in (type_.field(i) for i in range(type_.num_fields))
            if f.name in value
        }
    if pa.types.is_list(type_):
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list")
        inner = (*path[:-1], path[-1] + "[]")
        return [_encode(v, type_.value_type, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    # Arrow would coerce silently (4.5 -> 4 in an int64 column): only what the column holds exactly.
    if pa.types.is_integer(type_):
        if isinstance(value, float) and value.is_integer():
            return int(value)  # JSON has one number type: 4.0 is the integer 4
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif pa.types.is_floating(type_):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    else:
        ok = isinstance(value, str)
    if not ok:
        raise ValueError(f"{where}: {value!r} does not fit a {type_} column")
    return value


def _to_table(path: Path, rows: list[dict[str, Any]]) -> Any:
    import pyarrow as pa

    schema = _arrow_schema()
    root = pa.struct(list(schema))
    records = []
    for i, row in enumerate(rows, 1):
        try:
            records.append(_encode(row, root, (), "row"))
        except (TypeError, ValueError) as e:
            raise TaskFileError(f"{path}: row {i} does not fit the Parquet layout: {e} (write JSONL instead)") from e
    try:
        return pa.Table.from_pylist(records, schema=schema)
    except (pa.ArrowException, TypeError, ValueError) as e:
        for i, record in enumerate(records, 1):  # find the row Arrow refused: its error does not say
            try:
                pa.Table.from_pylist([record], schema=schema)
            except (pa.ArrowException, TypeError, ValueError) as row_error:
                raise TaskFileError(
                    f"{path}: row {i} does not fit the Parquet layout: {row_error} (write JSONL instead)"
                ) from row_error
        raise TaskFileError(f"{path}: cannot write Parquet: {e}") from e


def _write_table(table: Any, f: Any) -> None:
    import pyarrow.parquet as pq

    pq.write_table(table, f)


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise TaskFileError(f"{path}: cannot read Parquet: {e}") from e
    meta = table.schema.metadata or {}
    if _META_KEY not in meta:
        return table.to_pylist()
    json_paths = {tuple(p.split(".")) for p in json.loads(meta[_META_KEY])}
    rows = []
    for i, record in enumerate(table.to_pylist(), 1):
        try:
            rows.append(_decode(record, (), json_paths))
        except ValueError as e:
            raise TaskFileError(f"{path}: row {i}: {e}") from e
    return rows


def _decode(value: Any, path: tuple[str, ...], json_paths: set[tuple[str, ...]]) -> Any:
    if path in json_paths:
        if value is None:
            return None
        try:
            return json.loads(value)
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"{'.'.join(path)}: invalid JSON: {e}") from e
    if isinstance(value, dict):
        return {
            k: _decode(v, (*path, k), json_paths)
            for k, v in value.items()
            if v is not None or k in _NULLABLE  # null = the row had no such field
        }
    if isinstance(value, list):
        inner = (*path[:-1], path[-1] + "[]")
        return [_decode(v, inner, json_paths) for v in value]
    return value
