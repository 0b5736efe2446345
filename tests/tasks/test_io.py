"""Task files: JSON, JSONL and Parquet; exact round trips; errors that name the file and the line."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.io import FORMATS, TaskFileError, read_rows, write_rows
from tasks.schema import TaskRow

FIXTURE = Path(__file__).parent / "fixtures" / "gate_rows.jsonl"


def varied_rows() -> list[dict[str, Any]]:
    """Rows whose free-form parts differ in keys, types and nesting from row to row."""
    base = json.loads(FIXTURE.read_text().splitlines()[0])
    rows = [base]

    r = copy.deepcopy(base)
    gt = r["reward_spec"]["ground_truth"]
    gt["task_id"] = "varied-2"
    gt["tool_sequence"][0]["params"] = {"ticker": "AAPL", "limit": 3, "ratio": 0.5, "flag": True, "none": None}
    gt["tool_sequence"][1]["params"] = {"channel": "markets", "text": 'ünïcödé ✓ "quotes"\nnew line'}
    gt["final_answer"] = {"value": "Apple Inc.", "tolerance": 0.0, "description": ""}
    r["extra_info"] = {"split": "train", "nested": {"list": [1, 2.0, "3", [4]], "empty": {}}, "n": None}
    rows.append(r)

    r = copy.deepcopy(base)
    gt = r["reward_spec"]["ground_truth"]
    gt["task_id"] = "varied-3"
    gt["final_answer"] = None
    gt["tool_sequence"][0]["params"] = {}
    gt["tool_sequence"][1]["params"] = {"z_last": 1, "a_first": 2}  # key order is kept
    r["prompt"] = r["prompt"][1:]
    r["extra_info"] = {}
    rows.append(r)

    r = copy.deepcopy(base)  # optional fields left out
    gt = r["reward_spec"]["ground_truth"]
    gt["task_id"] = "varied-4"
    gt["final_answer"] = {"value": 7}  # an int stays an int
    del gt["tool_sequence"][1]["params"]
    del r["extra_info"], r["env_class"], r["reward_spec"]["method"]
    rows.append(r)
    return rows


def dumps(rows: list[dict[str, Any]]) -> str:
    """Exact comparison: dict equality would take 1 == 1.0 == True."""
    return json.dumps(rows, sort_keys=True)


@pytest.mark.parametrize("suffix", FORMATS)
def test_round_trip_is_exact(tmp_path: Path, suffix: str) -> None:
    rows = varied_rows()
    path = tmp_path / f"tasks{suffix}"
    write_rows(rows, path)
    back = read_rows(path)
    assert back == rows
    assert dumps(back) == dumps(rows)
    assert [list(r) for r in back[:3]] == [list(r) for r in rows[:3]]  # field order, for full rows
    params = [s.get("params") for r in back for s in r["reward_spec"]["ground_truth"]["tool_sequence"]]
    assert list(params[5]) == ["z_last", "a_first"]
    assert [p["ticker"] for p in params[:3:2]] == ["NVDA", "AAPL"]
    assert list(tmp_path.iterdir()) == [path]  # the temp file was renamed, not left behind


def test_parquet_missing_final_answer_reads_as_null(tmp_path: Path) -> None:
    row = varied_rows()[0]
    del row["reward_spec"]["ground_truth"]["final_answer"]
    write_rows([row], tmp_path / "t.parquet")
    (back,) = read_rows(tmp_path / "t.parquet")
    assert back["reward_spec"]["ground_truth"]["final_answer"] is None
    assert TaskRow.model_validate(back) == TaskRow.model_validate(row)


def test_parquet_layout_is_columnar_with_json_free_form_fields(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    write_rows(varied_rows(), path)
    table = pq.read_table(path)
    assert table.column_names == ["data_source", "env_class", "prompt", "reward_spec", "extra_info"]
    truth = table.schema.field("reward_spec").type.field("ground_truth").type
    assert truth.field("max_turns").type == pa.int64()
    step = truth.field("tool_sequence").type.value_type
    assert step.field("params").type == pa.string()
    assert table.schema.field("extra_info").type == pa.string()
    assert json.loads(table.column("extra_info")[1].as_py())["split"] == "train"
    complexity = [r["ground_truth"]["complexity"] for r in table.column("reward_spec").to_pylist()]
    assert complexity == ["medium"] * 4
    assert b"mcprl.json_fields" in table.schema.metadata


def test_fixture_survives_all_formats(tmp_path: Path) -> None:
    """The gate's bad rows keep their content, bad parts included, through JSON and JSONL."""
    rows = read_rows(FIXTURE)
    for suffix in (".json", ".jsonl"):
        write_rows(rows, tmp_path / f"f{suffix}")
        assert dumps(read_rows(tmp_path / f"f{suffix}")) == dumps(rows)


def test_parquet_refuses_rows_that_do_not_fit(tmp_path: Path) -> None:
    good = varied_rows()[0]
    extra = copy.deepcopy(good)
    extra["answer"] = 1
    with pytest.raises(TaskFileError, match=r"row 2 .*'answer'.*JSONL"):
        write_rows([good, extra], tmp_path / "t.parquet")
    for field, value in (("max_turns", "four"), ("max_turns", 4.5), ("max_turns", True), ("task_id", 7)):
        wrong = copy.deepcopy(good)
        wrong["reward_spec"]["ground_truth"][field] = value
        with pytest.raises(TaskFileError, match=rf"row 3 does not fit.*ground_truth\.{field}: "):
            write_rows([good, good, wrong], tmp_path / "t.parquet")
    wrong = copy.deepcopy(good)
    wrong["reward_spec"]["ground_truth"]["final_answer"]["tolerance"] = "0.1"
    with pytest.raises(TaskFileError, match=r"row 1 does not fit.*tolerance"):
        write_rows([wrong], tmp_path / "t.parquet")
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_parquet_keeps_numbers_in_their_column_type(tmp_path: Path) -> None:
    row = varied_rows()[0]
    row["reward_spec"]["ground_truth"]["max_turns"] = 4.0
    row["reward_spec"]["ground_truth"]["final_answer"]["tolerance"] = 0
    write_rows([row], tmp_path / "t.parquet")
    (back,) = read_rows(tmp_path / "t.parquet")
    truth = back["reward_spec"]["ground_truth"]
    assert (truth["max_turns"], truth["final_answer"]["tolerance"]) == (4, 0.0)
    assert isinstance(truth["max_turns"], int) and isinstance(truth["final_answer"]["tolerance"], float)


def test_foreign_parquet_is_read_as_is(tmp_path: Path) -> None:
    path = tmp_path / "other.parquet"
    pq.write_table(pa.Table.from_pylist([{"data_source": "x", "extra_info": {"a": 1}}]), path)
    assert read_rows(path) == [{"data_source": "x", "extra_info": {"a": 1}}]


# --------------------------------------------------------------------------- errors


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TaskFileError, match=r"nope\.jsonl: no such file"):
        read_rows(tmp_path / "nope.jsonl")


def test_unknown_suffix(tmp_path: Path) -> None:
    path = write(tmp_path / "rows.csv", "a,b\n")
    with pytest.raises(TaskFileError, match=r"rows\.csv: unknown task file type '\.csv'"):
        read_rows(path)
    with pytest.raises(TaskFileError, match="unknown task file type"):
        write_rows([], tmp_path / "rows.txt")


def test_jsonl_bad_line_names_its_number(tmp_path: Path) -> None:
    path = write(tmp_path / "rows.jsonl", '{"a": 1}\n\n{"a": 2}\n{"a": \n')
    with pytest.raises(TaskFileError, match=r"rows\.jsonl: line 4, column \d+: invalid JSON"):
        read_rows(path)


def test_jsonl_line_that_is_not_an_object(tmp_path: Path) -> None:
    path = write(tmp_path / "rows.jsonl", '{"a": 1}\n[1, 2]\n')
    with pytest.raises(TaskFileError, match=r"line 2: expected a JSON object, got a list"):
        read_rows(path)


def test_jsonl_blank_lines_are_skipped(tmp_path: Path) -> None:
    path = write(tmp_path / "rows.jsonl", '\n{"a": 1}\n   \n{"b": 2}\n\n')
    assert read_rows(path) == [{"a": 1}, {"b": 2}]


def test_json_bad_syntax_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path / "rows.json", '[\n {"a": 1},\n {"a": 2,}\n]\n')
    with pytest.raises(TaskFileError, match=r"rows\.json: line 3, column \d+: invalid JSON"):
        read_rows(path)


def test_json_that_is_not_a_list(tmp_path: Path) -> None:
    path = write(tmp_path / "rows.json", '{"data_source": "x"}')
    with pytest.raises(TaskFileError, match=r"expected a JSON list of rows, got an object"):
        read_rows(path)


def test_json_list_item_that_is_not_an_object(tmp_path: Path) -> None:
    path = write(tmp_path / "rows.json", '[{"a": 1}, 5]')
    with pytest.raises(TaskFileError, match=r"row 2: expected a JSON object, got a number"):
        read_rows(path)


def test_corrupt_parquet(tmp_path: Path) -> None:
    path = write(tmp_path / "rows.parquet", "not parquet at all")
    with pytest.raises(TaskFileError, match=r"rows\.parquet: cannot read Parquet"):
        read_rows(path)


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"a": "\xff"}\n')
    with pytest.raises(TaskFileError, match="cannot read"):
        read_rows(path)


def test_write_refuses_non_objects_and_unserialisable_values(tmp_path: Path) -> None:
    with pytest.raises(TaskFileError, match="row 2 is a list"):
        write_rows([{"a": 1}, [1]], tmp_path / "t.jsonl")  # type: ignore[list-item]
    with pytest.raises(TaskFileError, match="not JSON-serialisable"):
        write_rows([{"a": {1, 2}}], tmp_path / "t.json")
    assert list(tmp_path.iterdir()) == []


def test_task_file_error_is_a_value_error() -> None:
    assert issubclass(TaskFileError, ValueError)


@pytest.mark.parametrize("suffix", FORMATS)
def test_read_rows_give_what_the_strict_model_takes(tmp_path: Path, suffix: str) -> None:
    """The IO edge hands the gate plain Python values (no numpy, no tuples): strict TaskRow accepts every row
    read back, a server-only must_call_tool included."""
    rows = varied_rows()
    rows[0]["reward_spec"]["ground_truth"]["success"]["must_call_tool"] = "polygon"
    path = tmp_path / f"tasks{suffix}"
    write_rows(rows, path)
    back = read_rows(path)
    assert back[0]["reward_spec"]["ground_truth"]["success"]["must_call_tool"] == "polygon"
    assert [TaskRow.model_validate(r) for r in back] == [TaskRow.model_validate(r) for r in rows]
