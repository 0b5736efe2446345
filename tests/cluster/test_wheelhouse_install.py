"""The GPU machine's install path, run here: the wheelhouse built for this machine's Python, cut into parts,
rejoined, installed by cluster/gpu_box.sh into a fresh venv over a stand-in for the image (a site-packages
holding only torch, transformers, peft and what they need), then a short ci-tiny jobs.train with the HF
engine in that venv. It downloads from the package index (once: the wheels stay under .cache/)."""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import wheelhouse

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
HERE = f"{sys.version_info.major}.{sys.version_info.minor}"
IMAGE = ("torch", "transformers", "peft")  # what the GPU image brings


def _index_reachable(tmp: Path) -> str:
    """'' when pip's configured index serves a small wheel, else why not."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(tmp), "tenacity"],
            capture_output=True, text=True, timeout=90,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return "pip download timed out"
    return "" if proc.returncode == 0 else proc.stderr.strip().splitlines()[-1]


def _closure(names: tuple[str, ...]) -> set[str]:
    """The installed distributions `names` need, themselves included (extras left out)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = wheelhouse._name(todo.pop())
        if name in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # a marker-excluded or optional requirement
        seen.add(name)
        todo += [r for r in dist.requires or [] if "extra ==" not in r and "extra==" not in r]
    return seen


def image_site(dest: Path) -> Path:
    """A folder of links to this venv's torch, transformers, peft and their dependencies: the GPU image's
    site-packages as far as the wheelhouse is concerned."""
    dest.mkdir()
    for name in _closure(IMAGE):
        dist = md.distribution(name)
        site = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            link = dest / top
            if (site / top).exists() and not link.exists():
                link.symlink_to(site / top)
    return dest


@pytest.mark.timeout(1800)
def test_gpu_box_installs_the_wheelhouse_and_trains_with_the_hf_engine(tmp_path):
    stamp = wheelhouse.DEFAULT_OUT / f"cp{HERE.replace('.', '')}" / ".stamp.json"
    if not stamp.is_file() and (why := _index_reachable(tmp_path / "probe")):
        pytest.skip(f"the package index is unreachable ({why}): this test downloads the wheelhouse once")
    from actors.models import resolve_model

    parts, manifest = wheelhouse.build(python_version=HERE, model_dirs=[resolve_model("tiny-random")])
    assert len(manifest["parts"]) >= 2  # Ray's wheel alone outgrows a part: chunks are rejoined below
    assert not {wheelhouse._name(f["name"].split("-")[0]) for f in manifest["files"]} & {"torch", "vllm"}

    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(PYTHON=sys._base_executable, PARTS=str(parts), VENV=str(venv), MCPRL_CACHE=str(tmp_path / "cache"),
               EXTRA_SITE=str(image_site(tmp_path / "image")))  # fmt: skip
    data = tmp_path / "data"
    args = ["--config", "configs/ci-tiny.yaml", "--set", f"train.storage={tmp_path / 'runs'}",
            "--set", f"data.train={data / 'tasks.train.jsonl'}",
            "--set", f"data.validation={data / 'tasks.validation.jsonl'}"]  # fmt: skip
    proc = subprocess.run(["bash", str(ROOT / "cluster" / "gpu_box.sh"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1700)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "wheelhouse installed" in out and "torch" in out
    table = out[out.index("learner tok/s") :].splitlines()
    med = next(line for line in table if line.startswith("med"))
    assert all(float(x) > 0 for x in med.split()[1:5]), table  # step s, learner and rollout tok/s, push s
    assert re.search(r"^\s+2\s", "\n".join(table), re.M), table  # ci-tiny's two GRPO steps

    # What the venv imports: Ray from the wheelhouse, torch from the image, and no vLLM anywhere.
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import importlib.util as u, ray, torch; print(ray.__file__); print(torch.__file__); "
         "print(u.find_spec('vllm'))"],
        capture_output=True, text=True, env=env, check=True,
    ).stdout.split()  # fmt: skip
    assert where[0].startswith(str(venv)) and where[1].startswith(str(tmp_path / "image")) and where[2] == "None"
