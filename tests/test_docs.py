"""The docs site: its generated reference pages match the code, and `mkdocs build --strict` passes (a broken
link or anchor fails it)."""

from __future__ import annotations

import importlib.util
import os
import re
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
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's banner on MkDocs 2.0: mkdocs is pinned at 1.6
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()
    concepts = (tmp_path / "site" / "concepts" / "index.html").read_text()
    assert "md-header" in concepts, "the site is not built with the Material theme"


def test_the_commands_the_docs_show_exist() -> None:
    """Every `python -m <module> ...` in the README and the docs names an entry point, with options its --help
    lists, and the jobs' `--set KEY=...` name config keys (one line at a time: a command continued with `\\`
    is checked up to its line's end)."""
    from configs.loader import _key_paths
    from configs.schema import Config

    cli = (ROOT / "docs" / "reference" / "cli.md").read_text()
    helps = dict(re.findall(r"## `python -m (\S+)`\n\n```text\n(.*?)```", cli, re.S))
    keys = set(_key_paths(Config))
    ours = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    pages = [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").rglob("*.md")) if "reference" not in p.parts)]
    wrong, seen = [], 0
    for page in pages:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for module, rest in re.findall(r"python -m (\w+(?:\.\w+)*)([^`\n]*)", line):
                where = f"{page.relative_to(ROOT)}:{n}: python -m {module}"
                if module not in helps:
                    if module.split(".")[0] in ours:
                        wrong.append(f"{where}: no such entry point")
                    continue
                seen += 1
                for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", rest):
                    if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", helps[module]):
                        wrong.append(f"{where}: no option {flag}")
                if module.startswith("jobs."):
                    for key in re.findall(r"--set '?([\w.]+)=", rest):
                        if key not in keys:
                            wrong.append(f"{where}: no config key {key}")
    assert seen > 30, f"only {seen} commands found: the scan is broken"
    assert not wrong, "commands in the docs that the code does not have:\n" + "\n".join(wrong)


def test_the_make_targets_and_files_the_docs_name_exist() -> None:
    """Every `make <target>` in the README and the how-to pages is a Makefile target, and every repository path
    they name in backticks (a folder/file.ext; outputs under runs/, report/, site/, bench_results/ aside) exists."""
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    pages = [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").rglob("*.md")) if "reference" not in p.parts)]
    wrong, seen = [], 0
    for page in pages:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            where = f"{page.relative_to(ROOT)}:{n}"
            for target in re.findall(r"`make ([\w-]+)", line):
                seen += 1
                if target not in targets:
                    wrong.append(f"{where}: no make target {target}")
            for path in re.findall(r"`((?:[\w.-]+/)+[\w.-]+\.(?:py|ya?ml|sh|json|toml|md))`", line):
                seen += 1
                if not path.startswith(("runs/", "report/", "site/", "bench_results/")) and not (ROOT / path).exists():
                    wrong.append(f"{where}: no file {path}")
    assert seen > 30, f"only {seen} targets and paths found: the scan is broken"
    assert not wrong, "targets and files the docs name that the repository does not have:\n" + "\n".join(wrong)
