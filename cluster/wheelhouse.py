"""A wheelhouse for a GPU machine that has torch, transformers and peft but none of our other dependencies.

The GPU machines lent to this project (Python 3.12, CUDA torch, transformers, peft) have neither Ray nor
the project's other runtime dependencies, no network, and take at most 64 MiB per call. This module builds,
here, every wheel they lack for `jobs.train` with `rollout.backend: hf`, packs them into parts that each fit
one call, and on the machine puts them back together, checks them and installs them:

    python -m cluster.wheelhouse build [--python-version 3.12] [--model-dir DIR ...]    # here: download + pack
    python3 -m cluster.wheelhouse install --parts DIR --venv DIR [--cache DIR]        # there: unpack + install

`build` takes the runtime dependencies from pyproject.toml less what the image brings (`IMAGE_PROVIDES`:
torch, transformers, peft; vLLM is an extra and the hf backend never imports it), downloads their wheels for
the target Python and manylinux platform through pip's configured index, builds a wheel here for a pure-Python
dependency published only as an sdist, and packs the wheels, a requirements.txt and any model folders (as
tars) into `parts/p01`, `p02`, ... of at most `--part-mib` each. A file larger than a part (Ray's wheel is
~79 MB) is cut into byte chunks that land in different parts. Every part holds the same manifest.json: each
file's name, size and sha256, and where its chunks are, with theirs.

`install` needs only the standard library and pip: it checks every chunk (a corrupt or missing part is named),
rejoins the files, checks each whole, makes a venv with --system-site-packages (so the image's CUDA torch is
the one used) and installs with `pip install --no-index --find-links`. The GPU machine's side, end to end:
cluster/gpu_box.sh. The sequence of calls that carries the parts there: docs/performance/index.md,
"`jobs.train` on a lent GPU machine".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / ".cache" / "gpu-wheelhouse"
MANIFEST = "manifest.json"
REQUIREMENTS = "requirements.txt"
FORMAT = 1
# What the GPU image brings (with their CUDA dependencies): never downloaded, never installed over.
IMAGE_PROVIDES = frozenset({"torch", "transformers", "peft"})
# The lowest glibc that torch's own wheels need: a machine running CUDA torch has at least this one.
DEFAULT_GLIBC = (2, 28)
# Under the 64 MiB a call carries, leaving room for the working tree that travels with it.
DEFAULT_PART_MIB = 56
_MANIFEST_ROOM = 256 * 1024  # a part's budget keeps this much for its manifest
_CHUNK = 1 << 20


class WheelhouseError(RuntimeError):
    """A wheelhouse that cannot be built, put back together or installed; the message says which part or file."""


# --------------------------------------------------------------------------- what to download


def _name(requirement: str) -> str:
    """The normalised project name of a PEP 508 requirement (`ray[default]==2.6` → `ray`)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not match:
        raise WheelhouseError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def requirements(pyproject: Path = ROOT / "pyproject.toml", image: Iterable[str] = IMAGE_PROVIDES) -> list[str]:
    """The project's runtime dependencies less those the GPU image already holds."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    skip = {_name(x) for x in image}
    return [d for d in deps if _name(d) not in skip]


def platforms(glibc: tuple[int, int] = DEFAULT_GLIBC) -> list[str]:
    """pip's --platform values for a manylinux x86_64 machine with `glibc`: pip takes each tag literally
    (manylinux_2_28 does not imply manylinux2014), so every older one is named too."""
    major, minor = glibc
    tags = [f"manylinux_{major}_{m}_x86_64" for m in range(minor, 4, -1)]
    legacy = {17: "manylinux2014_x86_64", 12: "manylinux2010_x86_64", 5: "manylinux1_x86_64"}
    return tags + [tag for m, tag in legacy.items() if m <= minor]


# --------------------------------------------------------------------------- download


def _pip(python: str, *args: str, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-m", "pip", *args], capture_output=True, text=True, timeout=timeout)


def download(
    reqs: list[str],
    dest: Path,
    python_version: str,
    glibc: tuple[int, int] = DEFAULT_GLIBC,
    pip_python: str = sys.executable,
) -> list[Path]:
    """The wheels of `reqs` and everything they need, for CPython `python_version` on manylinux x86_64, in
    `dest`. Kept across calls: a `dest` whose stamp matches the request is used without asking the index."""
    stamp = dest / ".stamp.json"
    want = {"requirements": reqs, "python": python_version, "platforms": platforms(glibc)}
    wheels_dir = dest / "wheels"
    if stamp.is_file() and json.loads(stamp.read_text()) == want:
        return sorted(wheels_dir.glob("*.whl"))
    shutil.rmtree(wheels_dir, ignore_errors=True)  # a changed request: no stale wheel may travel
    wheels_dir.mkdir(parents=True)
    built = dest / "built"  # wheels made here from sdists (pure Python only)
    built.mkdir(exist_ok=True)
    target = ["--only-binary=:all:", "--implementation", "cp", "--python-version", python_version]
    for tag in want["platforms"]:
        target += ["--platform", tag]
    tried: set[str] = set()
    while True:
        proc = _pip(pip_python, "download", *target, "--find-links", str(built), "-d", str(wheels_dir), *reqs)
        if proc.returncode == 0:
            break
        missing = re.search(r"No matching distribution found for ([^\s;]+)", proc.stderr)
        if not missing or missing.group(1) in tried:
            raise WheelhouseError(f"pip download failed:\n{proc.stderr.strip()[-3000:]}")
        tried.add(missing.group(1))
        _wheel_from_sdist(missing.group(1), built, pip_python)
    stamp.write_text(json.dumps(want))
    return sorted(wheels_dir.glob("*.whl"))


def _wheel_from_sdist(requirement: str, out: Path, pip_python: str) -> None:
    """A dependency with no wheel for the target (func_timeout has only an sdist): build its wheel here,
    which serves any Python 3 only if it is pure Python."""
    before = set(out.glob("*.whl"))
    proc = _pip(pip_python, "wheel", "--no-deps", "-w", str(out), requirement)
    made = set(out.glob("*.whl")) - before
    if proc.returncode != 0 or not made:
        raise WheelhouseError(f"{requirement} has no wheel for the target and its sdist did not build:\n{proc.stderr}")
    for wheel in made:
        if not wheel.name.endswith("-none-any.whl"):
            wheel.unlink()
            raise WheelhouseError(f"{requirement} has no wheel for the target, and its sdist builds {wheel.name}, "
                                  "a wheel for this machine only")  # fmt: skip


# --------------------------------------------------------------------------- pack and unpack


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class _Piece:
    source: Path
    offset: int
    size: int
    file: str  # its name inside the part
    part: str = ""


@dataclass
class _Part:
    name: str
    free: int
    pieces: list[_Piece] = field(default_factory=list)


def pack(files: list[Path], parts_dir: Path, part_bytes: int, meta: dict | None = None) -> dict:
    """`files` into `parts_dir/p01`, `p02`, ... each of at most `part_bytes` (its manifest included). A file
    bigger than a part's room is cut into chunks (`NAME.chunk1of2`, ...); whole files and chunks are placed
    largest first into the first part with room. Returns the manifest that every part holds."""
    room = part_bytes - _MANIFEST_ROOM
    if room <= 0:
        raise WheelhouseError(f"parts of {part_bytes} bytes leave no room beside the manifest")
    names = [f.name for f in files]
    if len(set(names)) != len(names):
        raise WheelhouseError(f"two files share a name: {sorted(n for n in names if names.count(n) > 1)}")
    pieces: list[_Piece] = []
    for f in files:
        size = f.stat().st_size
        n = max(1, -(-size // room))
        if n == 1:
            pieces.append(_Piece(f, 0, size, f.name))
        else:
            pieces += [_Piece(f, i * room, min(room, size - i * room), f"{f.name}.chunk{i + 1}of{n}") for i in range(n)]
    parts: list[_Part] = []
    for piece in sorted(pieces, key=lambda p: (-p.size, p.file)):
        home = next((p for p in parts if p.free >= piece.size), None)
        if home is None:
            home = _Part(f"p{len(parts) + 1:02d}", room)
            parts.append(home)
        home.pieces.append(piece)
        home.free -= piece.size
        piece.part = home.name
    shutil.rmtree(parts_dir, ignore_errors=True)
    digests: dict[str, str] = {}
    for part in parts:
        (parts_dir / part.name).mkdir(parents=True)
        for piece in part.pieces:
            dest = parts_dir / part.name / piece.file
            digests[piece.file] = _copy_range(piece.source, piece.offset, piece.size, dest)
    manifest = {
        **(meta or {}),
        "format": FORMAT,
        "parts": {p.name: sum(x.size for x in p.pieces) for p in parts},
        "files": [
            {
                "name": f.name,
                "size": f.stat().st_size,
                "sha256": sha256(f),
                "chunks": [
                    {"part": p.part, "file": p.file, "size": p.size, "sha256": digests[p.file]}
                    for p in sorted((p for p in pieces if p.source == f), key=lambda p: p.offset)
                ],
            }
            for f in files
        ],
    }
    text = json.dumps(manifest, indent=1)
    if len(text.encode()) > _MANIFEST_ROOM:
        raise WheelhouseError(f"the manifest ({len(text)} bytes) outgrew the room kept for it")
    for part in parts:
        (parts_dir / part.name / MANIFEST).write_text(text)
    return manifest


def _copy_range(source: Path, offset: int, size: int, dest: Path) -> str:
    digest = hashlib.sha256()
    with source.open("rb") as src, dest.open("wb") as out:
        src.seek(offset)
        left = size
        while left:
            block = src.read(min(_CHUNK, left))
            if not block:
                raise WheelhouseError(f"{source} ended before byte {offset + size}")
            digest.update(block)
            out.write(block)
            left -= len(block)
    return digest.hexdigest()


def read_manifest(parts_dir: Path) -> dict:
    found = sorted(parts_dir.glob(f"p*/{MANIFEST}"))
    if not found:
        raise WheelhouseError(f"no part (p01/{MANIFEST}, ...) under {parts_dir}")
    manifest = json.loads(found[0].read_text())
    if manifest.get("format") != FORMAT:
        raise WheelhouseError(f"{found[0]}: manifest format {manifest.get('format')}, this code reads {FORMAT}")
    return manifest


def unpack(parts_dir: Path, out: Path) -> list[Path]:
    """The files of the parts under `parts_dir`, rejoined into `out` after every chunk and every whole file
    matched its size and sha256. A file already in `out` with the right digest is kept as it is."""
    manifest = read_manifest(parts_dir)
    missing = [p for p in manifest["parts"] if not (parts_dir / p / MANIFEST).is_file()]
    if missing:
        raise WheelhouseError(f"part(s) {', '.join(missing)} missing under {parts_dir}: carry them first "
                              f"({len(manifest['parts'])} parts in all)")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    done: list[Path] = []
    for entry in manifest["files"]:
        dest = out / entry["name"]
        if dest.is_file() and dest.stat().st_size == entry["size"] and sha256(dest) == entry["sha256"]:
            done.append(dest)
            continue
        for chunk in entry["chunks"]:
            path = parts_dir / chunk["part"] / chunk["file"]
            if not path.is_file():
                raise WheelhouseError(f"part {chunk['part']}: {chunk['file']} is missing; carry part "
                                      f"{chunk['part']} again")  # fmt: skip
            size, digest = path.stat().st_size, sha256(path)
            if size != chunk["size"] or digest != chunk["sha256"]:
                raise WheelhouseError(
                    f"part {chunk['part']}: {chunk['file']} is corrupt ({size} bytes, sha256 {digest[:12]}…; the "
                    f"manifest says {chunk['size']} bytes, {chunk['sha256'][:12]}…); carry part {chunk['part']} again"
                )
        tmp = dest.with_name(dest.name + ".partial")
        with tmp.open("wb") as f:
            for chunk in entry["chunks"]:
                with (parts_dir / chunk["part"] / chunk["file"]).open("rb") as src:
                    shutil.copyfileobj(src, f, _CHUNK)
        if sha256(tmp) != entry["sha256"]:
            tmp.unlink()
            raise WheelhouseError(f"{entry['name']}: its chunks check but the whole does not; rebuild the wheelhouse")
        tmp.replace(dest)
        done.append(dest)
    return done


# --------------------------------------------------------------------------- build and install


def build(
    out: Path = DEFAULT_OUT,
    python_version: str = "3.12",
    glibc: tuple[int, int] = DEFAULT_GLIBC,
    part_mib: float = DEFAULT_PART_MIB,
    model_dirs: Iterable[Path] = (),
) -> tuple[Path, dict]:
    """Download and pack the wheelhouse for `python_version`: its parts are `out/cpXY/parts/p*`."""
    tag = "cp" + python_version.replace(".", "")
    folder = out / tag
    reqs = requirements()
    wheels = download(reqs, folder, python_version, glibc)
    extras = folder / "extras"
    shutil.rmtree(extras, ignore_errors=True)
    extras.mkdir(parents=True)
    (extras / REQUIREMENTS).write_text("\n".join(reqs) + "\n")
    files = [*wheels, extras / REQUIREMENTS]
    for model in model_dirs:
        if not (model / "config.json").is_file():
            raise WheelhouseError(f"{model} is not a model folder (no config.json)")
        tar = extras / f"model-{model.name}.tar"
        with tarfile.open(tar, "w") as t:
            t.add(model, arcname=f"models/{model.name}")
        files.append(tar)
    meta = {"python": python_version, "platforms": platforms(glibc), "requirements": REQUIREMENTS}
    manifest = pack(files, folder / "parts", int(part_mib * 2**20), meta)
    return folder / "parts", manifest


def make_venv(venv: Path, extra_site: Path | None = None) -> Path:
    """A venv that sees this interpreter's packages (the image's CUDA torch) behind its own; returns its python.

    `--system-site-packages` reaches only the base interpreter's site-packages, and the GPU image's python3 is
    itself a venv (/opt/torch/.venv): its site-packages, and `extra_site` (the CPU test's stand-in for an
    image), go into a .pth file, which puts them after the venv's own."""
    import site

    python = venv / "bin" / "python"
    if not python.is_file():
        made = subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)])
        if made.returncode != 0:
            raise WheelhouseError(f"{sys.executable} -m venv failed (exit {made.returncode}): see above")
    sites = site.getsitepackages() if sys.prefix != sys.base_prefix else []
    sites += [str(extra_site.resolve())] if extra_site is not None else []
    if sites:
        own = next((venv / "lib").glob("python3*/site-packages"))
        (own / "zz_image_site.pth").write_text("".join(f"{x}\n" for x in sites))
    return python


def install(parts_dir: Path, venv: Path, cache: Path | None = None, extra_site: Path | None = None) -> Path:
    """Unpack the parts, then install their wheels into `venv` (made with --system-site-packages, so the
    machine's torch serves) without any index; model tars go under `cache`. Returns the venv's python."""
    manifest = read_manifest(parts_dir)
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if manifest["python"] != here:
        raise WheelhouseError(f"the wheelhouse is for Python {manifest['python']}, this is {here} ({sys.executable})")
    files = unpack(parts_dir, parts_dir.parent / "unpacked")
    wheels = parts_dir.parent / "unpacked"
    for tar in (f for f in files if f.suffix == ".tar"):
        if cache is None:
            raise WheelhouseError(f"{tar.name} needs --cache (the folder MCPRL_CACHE names) to go to")
        with tarfile.open(tar) as t:
            t.extractall(cache, filter="data")
    python = make_venv(venv, extra_site)
    proc = subprocess.run([str(python), "-m", "pip", "install", "--no-index", "--find-links", str(wheels),
                           "-r", str(wheels / manifest["requirements"])])  # fmt: skip
    if proc.returncode != 0:
        raise WheelhouseError(f"pip install from {wheels} failed (exit {proc.returncode}): see above")
    return python


# --------------------------------------------------------------------------- CLI


def _glibc(text: str) -> tuple[int, int]:
    major, minor = text.split(".")
    return int(major), int(minor)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cluster.wheelhouse",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download the wheels for the GPU machine and pack them into parts (here)")
    b.add_argument("--out", type=Path, default=DEFAULT_OUT)
    b.add_argument("--python-version", default="3.12")
    b.add_argument("--glibc", type=_glibc, default=DEFAULT_GLIBC, help="the target's glibc (default 2.28)")
    b.add_argument("--part-mib", type=float, default=DEFAULT_PART_MIB)
    b.add_argument("--model-dir", type=Path, action="append", default=[], help="a model folder to carry (repeatable)")
    i = sub.add_parser("install", help="check, rejoin and install the parts (on the GPU machine)")
    i.add_argument("--parts", type=Path, required=True, help="the folder holding p01, p02, ...")
    i.add_argument("--venv", type=Path, required=True)
    i.add_argument("--cache", type=Path, help="where model tars are unpacked (MCPRL_CACHE)")
    i.add_argument("--extra-site", type=Path, help=argparse.SUPPRESS)
    p.epilog = "".join(sub.format_usage() for sub in (b, i))  # each command's options, in the one --help
    args = p.parse_args(argv)
    try:
        if args.cmd == "build":
            parts, manifest = build(args.out, args.python_version, args.glibc, args.part_mib, args.model_dir)
            total = sum(f["size"] for f in manifest["files"])
            print(f"{len(manifest['files'])} files, {total / 2**20:.1f} MiB, in {len(manifest['parts'])} parts "
                  f"under {parts}:")  # fmt: skip
            for name, size in manifest["parts"].items():
                print(f"  {name}: {size / 2**20:.1f} MiB")
        else:
            python = install(args.parts, args.venv, args.cache, args.extra_site)
            print(f"installed: {python}")
    except WheelhouseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
