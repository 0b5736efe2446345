"""Where a run's outputs live: `train.storage`, a folder or an object-store URI.

A location is a plain string, so it travels to any actor on any node:
- a path (`/mnt/shared/runs`, `runs`): a local or shared-filesystem folder; pathlib does the work;
- a URI (`s3://bucket/runs`, `gs://bucket/runs`): pyarrow.fs does the work. Credentials and endpoints
  come the usual way (for S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, or an IAM
  role), or from the URI's query (`s3://b/runs?endpoint_override=host:port&scheme=http`).

Whoever writes a file puts it into storage, and whoever reads it takes it from there: a learner on
another node writes a checkpoint into a node-local folder (`staged`) and uploads it; a reader
downloads it (`fetch`). On a path the two are the same folder and nothing is copied, so a path is
right for one node or a filesystem every node mounts; a URI is right for anything else.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import posixpath
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Set by Ray's job supervisor in a submitted job's driver: its working directory is deleted with the job.
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
JOB_STORAGE_HOME = "~/mcprl"


class StorageError(RuntimeError):
    """A storage location that cannot be read or written; the message names it."""


def default_cache_dir(cache_dir: str = "") -> Path:
    """The mcprl cache: `cache_dir`, else $MCPRL_CACHE, else ~/.cache/mcprl."""
    return Path(cache_dir or os.environ.get("MCPRL_CACHE") or "~/.cache/mcprl").expanduser()


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive use of `path`'s lock among this node's processes and threads."""
    # flock belongs to the open file, so this excludes other threads as well as other processes.
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def is_uri(location: str) -> bool:
    return "://" in location and not location.startswith("file://")


def resolve(location: str) -> str:
    """An absolute path or a URI. A relative path resolves against the current directory, except in a
    submitted Ray job, whose working directory goes away with the job: there against ~/mcprl."""
    if is_uri(location):
        return location
    path = Path(location.removeprefix("file://")).expanduser()
    if not path.is_absolute() and os.environ.get(RAY_JOB_ENV):
        path = Path(JOB_STORAGE_HOME).expanduser() / path
    return str(path.absolute())


def node_path(location: str, key: str) -> Path:
    """A file that the driver reads or writes on its own node (task files, evaluation results), resolved like
    any storage location (a relative path in a submitted job lands under ~/mcprl, not in the job's working
    directory). `key` names the setting in the error for a URI."""
    resolved = resolve(location)
    if is_uri(resolved):
        raise StorageError(f"{key} {location}: a URI; this file is read and written on the driver's node: give a path")
    return Path(resolved)


def join(location: str, *parts: str) -> str:
    """`location/part/...`; a URI keeps its query string at the end."""
    if not is_uri(location):
        return str(Path(location, *parts))
    base, sep, query = location.partition("?")
    return posixpath.join(base, *parts) + sep + query


def name(location: str) -> str:
    return posixpath.basename(location.partition("?")[0].rstrip("/"))


def _fs(location: str) -> tuple[Any, str]:
    import pyarrow.fs as pafs

    try:
        return pafs.FileSystem.from_uri(location)
    except Exception as e:  # pyarrow names the scheme, not the setting
        raise StorageError(f"storage {location!r}: {e}") from e


def _call(location: str, what: str, fn: Any) -> Any:
    try:
        return fn()
    except StorageError:
        raise
    except Exception as e:  # pyarrow's errors say what failed, not which of our locations
        raise StorageError(f"storage {location!r}: {what} failed: {type(e).__name__}: {e}") from e


def exists(location: str) -> bool:
    if not is_uri(location):
        return Path(location).exists()
    import pyarrow.fs as pafs

    fs, path = _fs(location)
    return _call(location, "stat", lambda: fs.get_file_info(path).type) != pafs.FileType.NotFound


def list_names(location: str) -> list[str]:
    """The names directly under a folder; [] when it does not exist."""
    if not is_uri(location):
        folder = Path(location)
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    import pyarrow.fs as pafs

    fs, path = _fs(location)
    infos = _call(location, "list", lambda: fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)))
    return sorted(posixpath.basename(i.path) for i in infos)


def read_text(location: str) -> str:
    if not is_uri(location):
        return Path(location).read_text(encoding="utf-8")
    fs, path = _fs(location)

    def read() -> str:
        with fs.open_input_stream(path) as f:
            return f.read().decode("utf-8")

    return _call(location, "read", read)


def write_text(location: str, text: str) -> None:
    """Whole or not at all: a local file is written aside and renamed; an object PUT is atomic."""
    if not is_uri(location):
        dest = Path(location)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(dest)
        return
    fs, path = _fs(location)

    def write() -> None:
        with fs.open_output_stream(path) as f:
            f.write(text.encode("utf-8"))

    _call(location, "write", write)


def delete(location: str) -> None:
    """A file or a whole folder; nothing if it is not there."""
    if not is_uri(location):
        path = Path(location)
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        return
    import pyarrow.fs as pafs

    fs, path = _fs(location)
    kind = _call(location, "stat", lambda: fs.get_file_info(path).type)
    if kind == pafs.FileType.Directory:
        _call(location, "delete", lambda: fs.delete_dir(path))
    elif kind == pafs.FileType.File:
        _call(location, "delete", lambda: fs.delete_file(path))


def upload(local: str | Path, location: str, *, skip: tuple[str, ...] = ()) -> None:
    """Copy a local file or folder to `location` (a folder: its files, recursively; names in `skip`,
    at any depth, stay behind). Onto the same local path it is a no-op."""
    local = Path(local)
    if not is_uri(location):
        dest = Path(location)
        if dest.absolute() == local.absolute():
            return
        if local.is_dir():
            shutil.copytree(local, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*skip))
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(local, dest)
        return
    fs, path = _fs(location)
    files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
    for file in files:
        rel = "" if file == local else file.relative_to(local).as_posix()
        if skip and any(part in skip for part in Path(rel).parts):
            continue
        target = posixpath.join(path, rel) if rel else path

        def put(file: Path = file, target: str = target) -> None:
            with file.open("rb") as src, fs.open_output_stream(target) as dst:
                shutil.copyfileobj(src, dst, 8 << 20)

        _call(location, f"upload of {file}", put)


def download(location: str, local: str | Path) -> Path:
    """Copy a stored file or folder to `local` (replacing what is there) and return `local`."""
    local = Path(local)
    if not is_uri(location):
        src = Path(location)
        if not src.exists():
            raise StorageError(f"storage {location!r}: not found")
        if local.exists():
            delete(str(local))
        if src.is_dir():
            shutil.copytree(src, local)
        else:
            local.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, local)
        return local
    import pyarrow.fs as pafs

    fs, path = _fs(location)
    info = _call(location, "stat", lambda: fs.get_file_info(path))
    if info.type == pafs.FileType.NotFound:
        raise StorageError(f"storage {location!r}: not found")
    if local.exists():
        delete(str(local))
    if info.type == pafs.FileType.File:
        entries = [(info, local)]
    else:
        found = _call(location, "list", lambda: fs.get_file_info(pafs.FileSelector(path, recursive=True)))
        entries = [(i, local / posixpath.relpath(i.path, path)) for i in found if i.type == pafs.FileType.File]
        local.mkdir(parents=True, exist_ok=True)
    for entry, target in entries:
        target.parent.mkdir(parents=True, exist_ok=True)

        def get(entry: Any = entry, target: Path = target) -> None:
            with fs.open_input_stream(entry.path) as src, target.open("wb") as dst:
                shutil.copyfileobj(src, dst, 8 << 20)

        _call(location, f"download of {entry.path}", get)
    return local


def fetch(location: str) -> Path:
    """A local folder or file holding what `location` holds: the path itself, or, for a URI, a copy in
    this node's cache, downloaded once per node for each version of the stored files (their names, sizes
    and times): a run's `sft/` or `final_adapter/` written again by a fresh run is downloaded again."""
    if not is_uri(location):
        return Path(location)
    import pyarrow.fs as pafs

    fs, path = _fs(location)
    info = _call(location, "stat", lambda: fs.get_file_info(path))
    if info.type == pafs.FileType.NotFound:
        raise StorageError(f"storage {location!r}: not found")
    found = (
        [info]
        if info.type == pafs.FileType.File
        else _call(location, "list", lambda: fs.get_file_info(pafs.FileSelector(path, recursive=True)))
    )
    stamp = sorted((i.path, i.size, i.mtime_ns) for i in found if i.type == pafs.FileType.File)
    key = hashlib.sha1(f"{location}{stamp}".encode()).hexdigest()[:16]
    folder = default_cache_dir() / "storage" / f"{name(location) or 'root'}-{key}"
    done = folder.with_name(folder.name + ".done")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(folder.with_name(folder.name + ".lock")):  # one download per node, not per actor
        if not done.exists():
            download(location, folder)
            done.touch()
    return folder


@contextlib.contextmanager
def staged(location: str) -> Iterator[Path]:
    """A local folder to write `location`'s files into: the folder itself for a path (created by the
    writer, so a write refused before it starts leaves nothing), else a node-local temporary one,
    uploaded on success (a failed write uploads nothing)."""
    if not is_uri(location):
        yield Path(location)
        return
    with tempfile.TemporaryDirectory(prefix="mcprl-stage-") as tmp:
        yield Path(tmp)
        upload(tmp, location)


class Mirror:
    """A local folder kept in step with a storage location: `push()` uploads the files changed since
    the last push. The driver writes its small files (metrics, config, report, W&B) locally, where
    the libraries that write them want a disk, and pushes after every step."""

    def __init__(self, local: str | Path, location: str) -> None:
        self.local = Path(local)
        self.location = location
        self._sent: dict[str, tuple[int, int]] = {}

    @property
    def in_place(self) -> bool:
        """The local folder is the location itself: nothing to push."""
        return not is_uri(self.location) and Path(self.location).absolute() == self.local.absolute()

    def pull(self, *, skip: tuple[str, ...] = ()) -> None:
        """Copy the location's top-level entries (but those in `skip`) into the local folder."""
        if self.in_place:
            return
        self.local.mkdir(parents=True, exist_ok=True)
        for entry in list_names(self.location):
            if entry not in skip:
                download(join(self.location, entry), self.local / entry)
        self._sent = {}

    def push(self) -> int:
        """Upload what changed; returns the number of files sent."""
        if self.in_place or not self.local.is_dir():
            return 0
        sent = 0
        for file in sorted(p for p in self.local.rglob("*") if p.is_file()):
            rel = file.relative_to(self.local).as_posix()
            st = file.stat()
            if self._sent.get(rel) == (st.st_size, st.st_mtime_ns):
                continue
            upload(file, join(self.location, *rel.split("/")))
            self._sent[rel] = (st.st_size, st.st_mtime_ns)
            sent += 1
        return sent
