"""cluster.storage on a folder and on a real S3 API (moto's server on loopback): the same calls, the
same results; and the driver's view of checkpoints (only complete ones count)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster import storage


@pytest.fixture
def root(storage_root: str) -> str:
    return storage_root


def test_round_trip(root: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("a")
    (src / "sub" / "b.bin").write_bytes(b"\x00\x01" * 1000)
    (src / "sub" / "skip.me").write_text("no")
    dest = storage.join(root, "run", "thing")
    assert not storage.exists(dest) and storage.list_names(dest) == []
    storage.upload(src, dest, skip=("skip.me",))
    assert storage.list_names(dest) == ["a.txt", "sub"]
    assert storage.list_names(storage.join(dest, "sub")) == ["b.bin"]
    back = storage.download(dest, tmp_path / "back")
    assert (back / "sub" / "b.bin").read_bytes() == b"\x00\x01" * 1000 and (back / "a.txt").read_text() == "a"
    storage.write_text(storage.join(root, "run", "note.json"), '{"x": 1}')
    assert json.loads(storage.read_text(storage.join(root, "run", "note.json"))) == {"x": 1}
    storage.delete(storage.join(root, "run"))
    assert not storage.exists(dest)
    with pytest.raises(storage.StorageError, match="not found"):
        storage.download(dest, tmp_path / "again")


def test_staged_uploads_only_on_success(root: str) -> None:
    where = storage.join(root, "adapter")
    with pytest.raises(RuntimeError), storage.staged(where) as local:
        local.mkdir(parents=True, exist_ok=True)  # the writer's job, as in every real one
        (local / "half.bin").write_bytes(b"x")
        raise RuntimeError("the writer died")
    assert storage.exists(storage.join(where, "half.bin")) == (
        not storage.is_uri(where)
    )  # a folder is written in place
    with storage.staged(where) as local:
        local.mkdir(parents=True, exist_ok=True)
        (local / "adapter_config.json").write_text("{}")
    assert storage.exists(storage.join(where, "adapter_config.json"))
    assert (storage.fetch(where) / "adapter_config.json").read_text() == "{}"
    with storage.staged(where) as local:  # written again (a fresh run of the same name): fetched again
        local.mkdir(parents=True, exist_ok=True)
        (local / "adapter_config.json").write_text('{"r": 8}')
    assert (storage.fetch(where) / "adapter_config.json").read_text() == '{"r": 8}'


def test_mirror_pushes_what_changed(root: str, tmp_path: Path) -> None:
    local = tmp_path / "driver"
    local.mkdir()
    mirror = storage.Mirror(local, storage.join(root, "run"))
    (local / "metrics.jsonl").write_text("1\n")
    (local / "report").mkdir()
    (local / "report" / "summary.md").write_text("# r")
    assert mirror.push() == 2
    assert mirror.push() == 0  # nothing changed
    (local / "metrics.jsonl").write_text("1\n2\n")
    assert mirror.push() == 1
    assert storage.read_text(storage.join(root, "run", "metrics.jsonl")) == "1\n2\n"
    again = storage.Mirror(tmp_path / "elsewhere", storage.join(root, "run"))
    again.pull(skip=("report",))
    assert sorted(p.name for p in again.local.iterdir()) == ["metrics.jsonl"]


def test_paths_resolve_outside_a_job_and_inside_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(storage.RAY_JOB_ENV, raising=False)
    assert storage.resolve("runs") == str(tmp_path / "runs")
    monkeypatch.setenv(storage.RAY_JOB_ENV, "{}")  # what Ray's job supervisor sets in a job's driver
    assert storage.resolve("runs") == str(Path("~/mcprl/runs").expanduser())
    assert storage.resolve("s3://b/runs") == "s3://b/runs"
    assert storage.join("s3://b/runs?scheme=http", "x", "y") == "s3://b/runs/x/y?scheme=http"


def test_a_bad_location_names_itself() -> None:
    with pytest.raises(storage.StorageError, match="nosuchscheme://x"):
        storage.exists("nosuchscheme://x/y")
