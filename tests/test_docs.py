"""The docs site: its generated reference pages match the code, and `mkdocs build --strict` passes (a broken
link or anchor fails it)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def gen_docs() -> ModuleType:
    """scripts/gen_docs.py, loaded from its file (scripts/ is no package: nothing at run time imports it)."""
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_pages_are_up_to_date(tmp_path: Path) -> None:
    gen = gen_docs()
    written = gen.write(tmp_path)
    assert {p.name for p in written} == {"config.md", "cli.md", "metrics.md"}
    stale = [p.name for p in written if (gen.REFERENCE / p.name).read_text() != p.read_text()]
    assert not stale, f"docs/reference/{stale} differ from the code: run `python scripts/gen_docs.py` and commit"


def test_reference_pages_cover_the_code() -> None:
    """Every config key and every entry point has its entry (the generator misses none it should find)."""
    from configs.loader import _key_paths
    from configs.schema import Config

    gen = gen_docs()
    config = (gen.REFERENCE / "config.md").read_text().replace("[]", "")  # list items' keys, as the loader names them
    keys = list(_key_paths(Config))
    assert len(keys) > 300
    missing = [k for k in keys if f"`{k}`" not in config]
    assert not missing, f"config keys missing from docs/reference/config.md: {missing[:10]}"
    cli = (gen.REFERENCE / "cli.md").read_text()
    for module in ("jobs.train", "jobs.evaluate", "jobs.export", "jobs.serve_model", "bench", "tasks.schema"):
        assert f"## `python -m {module}`" in cli and f"usage: python -m {module} " in cli, module


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()
