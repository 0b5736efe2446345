"""Run untrusted Python code in a bubblewrap sandbox.

What the program sees (bwrap mode):
- a fresh root, read-only: /usr, /bin, /lib*, and the server's own base interpreter (its real path and
  stdlib, `sys.base_prefix`). The venv's site-packages are *not* visible: the program gets the stdlib
  only, so nothing installed for the server (API clients, keys in config modules) leaks in;
- a private tmpfs /tmp of `tmp_size_mb` (its cwd, where its code lies as /tmp/main.py), another for
  /dev/shm; a read-only minimal /dev; no /etc, no $HOME, nothing of the repo;
- its own pid, net (no interfaces but a loopback of its own), ipc and uts namespaces; a cleared
  environment; no_new_privs; no capabilities; a seccomp filter that forbids new user namespaces;
- rlimits CPU, AS (memory), NPROC (processes and threads), FSIZE, CORE=0, set by a small bootstrap
  right before the code starts.

RLIMIT_NPROC binds only when the program's uid, as the kernel sees it, is not 0: root is exempt. bwrap's
`--unshare-user` run by root maps the sandbox to uid 0 outside, so as root we use no user namespace:
bwrap keeps only CAP_SETUID/CAP_SETGID and the bootstrap switches to a fresh, unused uid per run (so
concurrent runs do not share one process budget), which leaves it no capabilities. Run by a normal
user, bwrap makes a user namespace (uid 65534 inside, the caller's uid outside) where NPROC is counted
per namespace.

Killing: the sandbox runs in its own process group; on the wall-time limit, an output flood or the
caller's cancellation we SIGKILL it, and `--die-with-parent` plus the pid namespace take every process
inside with it. The CPU and memory limits are the kernel's (SIGXCPU/SIGKILL, failed allocations).

Without bwrap the code runs only when `allow_unsandboxed` is set: same rlimits, as the caller's user,
in a temporary directory, with nothing else isolated; the result says `sandboxed: false`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import platform
import secrets
import shutil
import signal
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from configs.schema import SandboxConfig
from mcp_servers.errors import InvalidArguments, SandboxError

# Runs inside the sandbox before the user's code: set limits, leave root, run the code in a child and
# report its exact wait status and CPU time on a private fd (an exit code alone cannot tell
# `sys.exit(137)` from a kill). The child closes that fd and the bootstrap is not dumpable, so the
# code cannot reach it to write a fake report.
_BOOTSTRAP = """\
import ctypes, os, resource as R, sys
cpu, mem, nproc, fsize, uid, status_fd = map(int, sys.argv[1:7])
for lim, val in ((R.RLIMIT_CPU, (cpu, cpu + 1)), (R.RLIMIT_AS, (mem, mem)), (R.RLIMIT_NPROC, (nproc, nproc)),
                 (R.RLIMIT_FSIZE, (fsize, fsize)), (R.RLIMIT_CORE, (0, 0))):
    R.setrlimit(lim, val)
if uid >= 0:
    os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: the code may not reach our fds via /proc
if not (os.access(sys.executable, os.X_OK) and os.access(sys.argv[7], os.R_OK)):
    sys.exit(f"sandbox bootstrap: uid {os.getuid()} cannot run {sys.executable} {sys.argv[7]}")
pid = os.fork()
if pid == 0:
    os.close(status_fd)
    os.execv(sys.executable, [sys.executable, "-I", sys.argv[7]])
_, status = os.waitpid(pid, 0)
ru = R.getrusage(R.RUSAGE_CHILDREN)
os.write(status_fd, f"{status} {ru.ru_utime + ru.ru_stime}".encode())
code = os.waitstatus_to_exitcode(status)
os._exit(code if code >= 0 else 128 - code)
"""

_CHUNK = 65536
_UNSANDBOXED = (
    "UNSANDBOXED: bubblewrap is missing; ran with rlimits only (allow_unsandboxed): no filesystem or "
    "network isolation, and no process limit when the server runs as root"
)
_UID_BASE, _UID_COUNT = 1 << 30, 1 << 20  # fresh uids for root mode; nobody owns files there
_uids_in_use: set[int] = set()


@dataclass
class RunResult:
    """What a program did. A non-zero exit is a normal result; limits raise SandboxError instead."""

    stdout: str
    stderr: str
    exit_code: int
    duration_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    sandboxed: bool = True
    cpu_time_s: float | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def find_bwrap() -> str | None:
    """Path of the bubblewrap binary, or None."""
    return shutil.which("bwrap")


async def sandbox_health(cfg: SandboxConfig) -> str | None:
    """None when a sandboxed run works here, else the reason (for health checks)."""
    try:
        res = await run_sandboxed("print(6 * 7)", cfg)
    except SandboxError as e:
        return str(e)
    if res.stdout.strip() != "42":
        return f"sandbox probe failed (exit {res.exit_code}): {res.stderr.strip()[-300:]}"
    if not res.sandboxed:
        return "bubblewrap is missing; running code unsandboxed (allow_unsandboxed is set)"
    return None


@functools.cache
def _uid_pool_mapped() -> bool:
    """Whether our user namespace maps the fresh-uid pool (containers often map only 0-65535)."""

    def covered(path: str) -> bool:
        with open(path) as f:
            for line in f:
                inside, _, count = map(int, line.split())
                if inside <= _UID_BASE and _UID_BASE + _UID_COUNT <= inside + count:
                    return True
        return False

    try:
        return covered("/proc/self/uid_map") and covered("/proc/self/gid_map")
    except OSError:
        return False


def _pick_uid() -> int:
    if not _uid_pool_mapped():
        return 65534  # nobody: safe, but concurrent runs then share one NPROC budget
    while (uid := _UID_BASE + secrets.randbelow(_UID_COUNT)) in _uids_in_use:
        pass
    return uid


def _python_dirs() -> list[str]:
    """Directories the interpreter needs: its prefix (stdlib, libpython) and its binary's folder."""
    exe_dir = os.path.dirname(os.path.realpath(sys.executable))
    prefix = os.path.realpath(sys.base_prefix)
    dirs = [prefix] if exe_dir.startswith(prefix + os.sep) else [prefix, exe_dir]
    return [d for d in dirs if d != "/usr" and not d.startswith("/usr/")]


def _ancestors(path: str) -> list[str]:
    """'/a/b/c' -> ['/a', '/a/b']"""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


# seccomp: forbid new user namespaces (unshare/clone with CLONE_NEWUSER). In one, an unprivileged
# program gets CAP_SYS_ADMIN over new mounts: it could mount an unbounded tmpfs and fill the host's RAM,
# and it reaches much more kernel code. clone3 hides its flags from seccomp: ENOSYS makes libc fall back
# to clone. Foreign-arch syscalls (int 0x80, x32) are refused outright.
_SECCOMP_ARCH = {  # machine: (AUDIT_ARCH_*, __NR_unshare, __NR_clone)
    "x86_64": (0xC000003E, 272, 56),
    "aarch64": (0xC00000B7, 97, 220),
}
_CLONE_NEWUSER, _NR_CLONE3 = 0x10000000, 435
_ALLOW, _EPERM, _ENOSYS = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38


def _seccomp_program() -> bytes | None:
    """The classic-BPF filter for bwrap --seccomp, or None on an architecture we have no table for."""
    if (arch := _SECCOMP_ARCH.get(platform.machine())) is None:
        return None
    audit_arch, nr_unshare, nr_clone = arch
    ld, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JSET|K, BPF_RET|K
    prog = [  # (code, jump if true, jump if false, k); jumps skip that many instructions
        (ld, 0, 0, 4),  # 0: A = arch
        (jeq, 0, 8, audit_arch),  # 1: foreign arch -> 10 EPERM
        (ld, 0, 0, 0),  # 2: A = syscall nr
        (jset, 6, 0, 0x40000000),  # 3: x32 ABI -> 10 EPERM
        (jeq, 6, 0, _NR_CLONE3),  # 4: -> 11 ENOSYS
        (jeq, 1, 0, nr_unshare),  # 5: -> 7
        (jeq, 0, 2, nr_clone),  # 6: -> 7, else 9 ALLOW
        (ld, 0, 0, 16),  # 7: A = low word of args[0] (the flags)
        (jset, 1, 0, _CLONE_NEWUSER),  # 8: -> 10 EPERM
        (ret, 0, 0, _ALLOW),  # 9
        (ret, 0, 0, _EPERM),  # 10
        (ret, 0, 0, _ENOSYS),  # 11
    ]
    return b"".join(struct.pack("<HBBI", *insn) for insn in prog)


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _bwrap_argv(bwrap: str, cfg: SandboxConfig, code_fd: int, seccomp_fd: int | None) -> list[str]:
    argv = [bwrap, *"--unshare-pid --unshare-net --unshare-ipc --unshare-uts --unshare-cgroup-try".split()]
    argv += "--die-with-parent --new-session --clearenv --setenv PATH /usr/bin:/bin".split()
    argv += "--setenv HOME /tmp --setenv LANG C.UTF-8 --ro-bind /usr /usr".split()
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(d):  # merged /usr: keep the symlink
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    for d in _python_dirs():
        # bwrap would create the bind's parents (e.g. /root/.pyenv) 0700 like the host's: open them
        argv += [arg for parent in _ancestors(d) for arg in ("--perms", "0755", "--dir", parent)]
        argv += ["--ro-bind", d, d]
    size = str(cfg.tmp_size_mb << 20)
    argv += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", size, "--tmpfs", "/tmp"]
    # /dev/shm (multiprocessing's semaphores) gets its own bounded tmpfs; /dev itself goes read-only,
    # else an unbounded tmpfs would be writable where the sandbox owns it (user-namespace mode)
    argv += ["--perms", "1777", "--size", size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
    argv += ["--perms", "0444", "--file", str(code_fd), "/tmp/main.py"]
    argv += ["--chdir", "/tmp", "--remount-ro", "/"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    if os.geteuid() == 0:
        # No user namespace (see the module doc): keep only what the bootstrap needs to leave root.
        argv += "--cap-drop ALL --cap-add CAP_SETUID --cap-add CAP_SETGID".split()
    else:
        argv += "--unshare-user --uid 65534 --gid 65534 --disable-userns".split()
    return argv


def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


async def _read_capped(stream: asyncio.StreamReader, cap: int, on_overflow: Callable[[], None]) -> tuple[bytes, bool]:
    """Keep at most `cap` bytes; on more, call `on_overflow` (which kills the sandbox) and discard the rest
    up to EOF. Reading on matters: a stream left with over twice its limit buffered pauses its pipe, which
    then never sees EOF, and `proc.wait()` waits for every pipe to close (it would end at the wall limit)."""
    buf, over = bytearray(), False
    while chunk := await stream.read(_CHUNK):
        if over:
            continue
        room = cap - len(buf)
        buf += chunk[:room]
        if len(chunk) > room:
            over = True
            on_overflow()
    return bytes(buf), over


async def _drain(proc: asyncio.subprocess.Process) -> None:
    """Read the pipes to EOF (discarding) so their transports close; bounded, as the writers are dead."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(1):
            for stream in (proc.stdout, proc.stderr):
                while await stream.read(_CHUNK):
                    pass


async def _feed(stream: asyncio.StreamWriter, data: bytes) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the program may not read it
        if data:
            stream.write(data)
            await stream.drain()
        stream.close()


async def run_sandboxed(code: str, cfg: SandboxConfig, stdin: str = "") -> RunResult:
    """Run `code` with `python -I` under the sandbox and the limits of `cfg`.

    Raises InvalidArguments for empty code, SandboxError when the sandbox is unavailable (and
    unsandboxed runs are not allowed) or the program was killed by the memory, CPU or wall-time limit.
    Cancelling the call kills the whole sandbox at once.
    """
    if not code.strip():
        raise InvalidArguments("`code` is empty")
    bwrap = find_bwrap()
    if bwrap is None and not cfg.allow_unsandboxed:
        raise SandboxError(
            "sandbox unavailable: bubblewrap (bwrap) is not installed. Install it (`make sandbox`, or "
            "apt-get install bubblewrap), or set tools.servers.python.sandbox.allow_unsandboxed=true to run code "
            "without isolation (unsafe: trusted code only)"
        )
    with contextlib.ExitStack() as stack:
        status_r, status_w = os.pipe()  # the bootstrap's report: "<wait status> <cpu seconds>"
        stack.callback(os.close, status_r)
        # Closed exactly once: after the spawn, or here if the spawn failed. Closing an fd number twice
        # could close whatever a concurrent run was given that number in between.
        write_end = stack.enter_context(_OwnedFd(status_w))
        env, cwd, uid = {}, "/", -1  # bwrap needs no environment (and clears the program's anyway)
        if bwrap:
            code_fd = _memfd("main.py", code.encode(errors="replace"))  # bwrap copies it to /tmp/main.py
            stack.callback(os.close, code_fd)
            pass_fds = [status_w, code_fd]
            seccomp_fd = None
            if (program := _seccomp_program()) is not None:
                seccomp_fd = _memfd("seccomp", program)
                stack.callback(os.close, seccomp_fd)
                pass_fds.append(seccomp_fd)
            prefix, script = _bwrap_argv(bwrap, cfg, code_fd, seccomp_fd), "/tmp/main.py"
            if os.geteuid() == 0:
                uid = _pick_uid()
                _uids_in_use.add(uid)
                stack.callback(_uids_in_use.discard, uid)
        else:
            cwd = stack.enter_context(tempfile.TemporaryDirectory(prefix="mcprl-py-"))
            prefix, script, pass_fds = [], os.path.join(cwd, "main.py"), [status_w]
            with open(script, "w", encoding="utf-8", errors="replace") as f:
                f.write(code)
            env = {"PATH": "/usr/bin:/bin", "HOME": cwd, "LANG": "C.UTF-8"}
        limits = [cfg.cpu_time_s, cfg.memory_mb << 20, cfg.max_processes, cfg.tmp_size_mb << 20, uid, status_w]
        argv = [*prefix, os.path.realpath(sys.executable), "-I", "-S", "-c", _BOOTSTRAP, *map(str, limits), script]
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            pass_fds=pass_fds,
            start_new_session=True,  # one process group to kill
            env=env,
            cwd=cwd,
        )
        write_end.close()  # only the sandbox holds it now
        out, err, flooded = await _collect(proc, cfg, stdin.encode(errors="replace"))
        duration = time.monotonic() - start
        os.set_blocking(status_r, False)  # every writer is gone, but never hang the loop on it
        try:
            report = [float(x) for x in os.read(status_r, 256).split()]
        except (BlockingIOError, ValueError):
            report = []

    stdout, stderr = out[0].decode(errors="replace"), err[0].decode(errors="replace")
    notes = [] if bwrap else [_UNSANDBOXED]
    cpu = report[1] if len(report) == 2 else None
    if len(report) == 2:
        exit_code = os.waitstatus_to_exitcode(int(report[0]))
    elif flooded:
        exit_code = -signal.SIGKILL
    else:  # the sandbox failed before the code ran (bwrap error, interpreter not reachable, ...)
        raise SandboxError(f"sandbox failed to start (exit {proc.returncode}): {stderr.strip()[-500:]}")
    if flooded:
        notes.append(f"output limit: the program was stopped after {cfg.max_output_bytes} bytes on one stream")
    elif exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and cpu and cpu >= cfg.cpu_time_s):
        raise SandboxError(f"killed by the sandbox: CPU time {cfg.cpu_time_s} s exceeded")
    elif exit_code != 0 and not err[1] and stderr.strip().rsplit("\n", 1)[-1].startswith("MemoryError"):
        # RLIMIT_AS makes allocations fail: Python dies of MemoryError rather than of a signal
        raise SandboxError(f"killed by the sandbox: memory limit {cfg.memory_mb} MB exceeded")
    return RunResult(
        stdout=stdout,
        stderr=stderr,
        exit_code=exit_code,
        duration_s=round(duration, 3),
        stdout_truncated=out[1],
        stderr_truncated=err[1],
        sandboxed=bwrap is not None,
        cpu_time_s=None if cpu is None else round(cpu, 3),
        notes=notes,
    )


async def _collect(
    proc: asyncio.subprocess.Process, cfg: SandboxConfig, stdin: bytes
) -> tuple[tuple[bytes, bool], tuple[bytes, bool], bool]:
    """Feed stdin, read both streams (capped) until exit; kill on wall time, flood or cancellation."""
    flooded = False

    def flood() -> None:
        nonlocal flooded
        flooded = True
        _kill(proc)

    try:
        async with asyncio.timeout(cfg.wall_time_s):
            out, err, _ = await asyncio.gather(
                _read_capped(proc.stdout, cfg.max_output_bytes, flood),
                _read_capped(proc.stderr, cfg.max_output_bytes, flood),
                _feed(proc.stdin, stdin),
            )
            await proc.wait()
    except TimeoutError:
        raise SandboxError(f"killed by the sandbox: wall time {cfg.wall_time_s:g} s exceeded") from None
    finally:
        _kill(proc)  # a no-op after a normal exit; on a timeout or cancellation it takes the tree down
        await proc.wait()
        await _drain(proc)
    return out, err, flooded


class _OwnedFd(contextlib.AbstractContextManager):
    """An fd closed once, early by `close()` or at the latest on exit."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def __exit__(self, *exc: object) -> None:
        self.close()
