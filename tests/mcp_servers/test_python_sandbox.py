"""The python tool's sandbox, for real: bubblewrap, rlimits and kills, run as whatever user pytest is (CI: root)."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path

import pytest
from fastmcp import Client

from configs.schema import PythonToolConfig, SandboxConfig
from mcp_servers import build_server, sandbox
from mcp_servers.errors import InvalidArguments, SandboxError
from mcp_servers.sandbox import run_sandboxed

pytestmark = pytest.mark.timeout(60)
needs_bwrap = pytest.mark.skipif(
    sandbox.find_bwrap() is None, reason="bubblewrap is not installed (apt-get install bubblewrap)"
)
REPO = Path(__file__).resolve().parents[2]


def cfg(**kw) -> SandboxConfig:
    return SandboxConfig(**{"wall_time_s": 10.0, "cpu_time_s": 5, **kw})


def tagged(code: str, tag: str) -> str:
    """Code that re-executes itself with `tag` in its command line, so the test can find its processes."""
    return f"import os, sys\nos.execv(sys.executable, [sys.executable, '-I', '-c', {code!r}, {tag!r}])"


def processes_with(tag: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if tag.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


async def wait_gone(tag: str, within: float = 2.0) -> list[int]:
    deadline = time.monotonic() + within
    while (left := processes_with(tag)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return left


def my_zombies() -> list[int]:
    zombies = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state == "Z" and int(ppid) == os.getpid():
            zombies.append(int(pid))
    return zombies


async def zombies_left(before: list[int], within: float = 3.0) -> list[int]:
    """This process's zombie children, other than those of `before` (another test's, in a whole-suite run),
    still there after `within` s: asyncio's child watcher reaps an exited child from its own thread, which
    on a crowded machine can take a moment; a leaked child stays."""
    deadline = time.monotonic() + within
    while (zombies := sorted(set(my_zombies()) - set(before))) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return zombies


# --------------------------------------------------------------------------- normal runs


@needs_bwrap
async def test_harmless_program_prints_computes_and_reads_stdin():
    code = (
        "import math, os, sys\n"
        "print(math.factorial(20), sum(range(10)))\n"
        "print(sys.stdin.read().upper(), end='')\n"
        "print(os.getuid(), os.getcwd())\n"
    )
    res = await run_sandboxed(code, cfg(), stdin="hello\n")
    assert res.exit_code == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[:2] == ["2432902008176640000 45", "HELLO"]
    uid, cwd = lines[2].split()
    assert int(uid) != 0 and cwd == "/tmp"  # never root inside, even when the server is
    assert res.sandboxed and not res.stdout_truncated and not res.stderr_truncated
    assert res.duration_s > 0 and res.cpu_time_s is not None


@needs_bwrap
async def test_failing_program_is_a_normal_result():
    res = await run_sandboxed("def f():\n    raise ValueError('boom')\nf()", cfg())
    assert res.exit_code == 1
    assert "ValueError: boom" in res.stderr and 'File "/tmp/main.py"' in res.stderr
    assert (await run_sandboxed("import sys; sys.exit(3)", cfg())).exit_code == 3


async def test_empty_code_is_invalid():
    with pytest.raises(InvalidArguments):
        await run_sandboxed("  \n", cfg())


@needs_bwrap
async def test_sandbox_health_probe():
    assert await sandbox.sandbox_health(cfg()) is None


# --------------------------------------------------------------------------- isolation


@needs_bwrap
async def test_no_network_even_to_a_loopback_server():
    accepted = 0

    async def on_connect(reader, writer):
        nonlocal accepted
        accepted += 1
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    code = (
        "import socket\n"
        "print([name for _, name in socket.if_nameindex()])\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        "    print('CONNECTED')\n"
        "except OSError as e:\n"
        "    print('blocked', type(e).__name__)\n"
    )
    async with server:
        res = await run_sandboxed(code, cfg())
    assert res.exit_code == 0, res.stderr
    assert res.stdout.splitlines() == ["['lo']", "blocked ConnectionRefusedError"]
    assert accepted == 0


@needs_bwrap
async def test_root_is_read_only_and_tmp_is_private_and_bounded():
    name = f"sbx-{uuid.uuid4().hex}"
    targets = ["/usr", "/etc", "/root", "/", "/dev", str(REPO), "/proc/sys/kernel"]
    if not Path.home().is_relative_to("/tmp"):
        targets.append(str(Path.home()))
    code = (
        "import os\n"
        f"for d in {targets!r}:\n"
        "    try:\n"
        f"        open(os.path.join(d, {name!r}), 'w').write('x')\n"
        "        print('WROTE', d)\n"
        "    except OSError as e:\n"
        "        print('denied', d, type(e).__name__)\n"
        f"open('/tmp/{name}', 'w').write('kept')\n"
        f"print('tmp', open('/tmp/{name}').read(), os.path.exists({str(REPO)!r}))\n"
        "try:\n"
        "    with open('/tmp/big', 'wb') as f:\n"
        "        for _ in range(16):\n"
        "            f.write(bytes(1 << 20))\n"
        "    print('WROTE 16 MB')\n"
        "except OSError as e:\n"
        "    print('tmp full', e.errno)\n"
    )
    res = await run_sandboxed(code, cfg(tmp_size_mb=4))
    assert res.exit_code == 0, res.stderr
    assert "WROTE" not in res.stdout
    assert res.stdout.count("denied") == len(targets)
    assert "tmp kept False" in res.stdout  # /tmp works; the host's repo is not even visible
    assert "tmp full" in res.stdout
    assert not any(os.path.exists(os.path.join(d, name)) for d in [*targets, "/tmp"])


@needs_bwrap
@pytest.mark.skipif(os.geteuid() == 0 and sandbox._seccomp_program() is None, reason="no seccomp table for this arch")
async def test_no_new_user_namespaces_but_threads_and_subprocesses_work():
    code = (
        "import ctypes, subprocess, threading\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.unshare(0x10000000), ctypes.get_errno())\n"  # CLONE_NEWUSER
        "t = threading.Thread(target=print, args=('thread',))\n"
        "t.start()\n"
        "t.join()\n"
        "print(subprocess.run(['echo', 'child'], capture_output=True, text=True).stdout, end='')\n"
    )
    res = await run_sandboxed(code, cfg())
    assert res.stdout.splitlines() == ["-1 1", "thread", "child"], res.stderr  # EPERM


@needs_bwrap
async def test_process_limit_holds():
    code = (
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    for _ in range(50):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(2)\n"
        "            os._exit(0)\n"
        "        n += 1\n"
        "except OSError as e:\n"
        "    print('refused', e.errno)\n"
        "print(n, flush=True)\n"
        "os._exit(0)\n"
    )
    res = await run_sandboxed(code, cfg(max_processes=8))
    assert "refused 11" in res.stdout, res.stdout + res.stderr  # EAGAIN: RLIMIT_NPROC binds
    assert int(res.stdout.split()[-1]) < 8


@needs_bwrap
async def test_fork_bomb_is_contained_and_cleaned_up():
    tag = f"forkbomb-{uuid.uuid4().hex}"
    zombies = my_zombies()
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    task = asyncio.create_task(run_sandboxed(tagged(bomb, tag), cfg(wall_time_s=1.5, max_processes=16)))
    most = 0
    while not task.done():
        most = max(most, len(processes_with(tag)))
        await asyncio.sleep(0.05)
    assert 0 < most < 16  # the bootstrap counts as one of the 16
    with pytest.raises(SandboxError, match=r"wall time 1\.5 s"):
        await task
    assert await wait_gone(tag) == []
    assert await zombies_left(zombies) == []


# --------------------------------------------------------------------------- limits


@needs_bwrap
async def test_memory_bomb_is_killed():
    bomb = "chunks = []\nwhile True:\n    chunks.append(bytearray(8 << 20))\n"
    with pytest.raises(SandboxError, match="memory limit 128 MB"):
        await run_sandboxed(bomb, cfg(memory_mb=128))


@needs_bwrap
async def test_infinite_loop_hits_cpu_limit():
    # RLIMIT_CPU fires after 1 s of CPU; on a crowded machine the wall clock may come first
    with pytest.raises(SandboxError, match=r"CPU time 1 s|wall time 6 s"):
        await run_sandboxed("while True:\n    pass\n", cfg(cpu_time_s=1, wall_time_s=6))


@needs_bwrap
async def test_sleeper_hits_wall_time():
    start = time.monotonic()
    with pytest.raises(SandboxError, match="wall time 1 s"):
        await run_sandboxed("import time\ntime.sleep(60)\n", cfg(wall_time_s=1))
    assert time.monotonic() - start < 30  # killed, long before the program would have ended


@needs_bwrap
async def test_huge_output_is_truncated_quickly():
    # Without the cap the program never ends and the wall-time limit would raise instead.
    res = await run_sandboxed("while True:\n    print('x' * 1000)\n", cfg(max_output_bytes=4096))
    assert res.stdout_truncated and len(res.stdout) == 4096 and not res.stderr_truncated
    assert res.notes and "output limit" in res.notes[0]
    res = await run_sandboxed("import sys\nsys.stderr.write('e' * 100_000)\n", cfg(max_output_bytes=1024))
    assert res.stderr_truncated and len(res.stderr) == 1024


async def test_an_overflowing_stream_is_read_to_its_end():
    """What follows the cap is read and dropped. A stream left with over twice its limit buffered pauses its pipe,
    which then never sees EOF; proc.wait() waits for every pipe, so a flooding run under CPU load used to end at
    the wall limit instead of the output limit."""
    stream = asyncio.StreamReader(limit=1024)
    stream.feed_data(b"x" * 3 * sandbox._CHUNK)  # more than one read takes
    stream.feed_eof()
    kills: list[int] = []
    data, over = await sandbox._read_capped(stream, 100, lambda: kills.append(1))
    assert (data, over, kills) == (b"x" * 100, True, [1]) and stream.at_eof()


# --------------------------------------------------------------------------- concurrency and cancellation


@needs_bwrap
async def test_cancellation_kills_the_whole_tree():
    tag = f"cancel-{uuid.uuid4().hex}"
    zombies = my_zombies()
    sleeper = "import os, time\nos.fork()\nos.fork()\ntime.sleep(60)\n"  # 4 processes
    task = asyncio.create_task(run_sandboxed(tagged(sleeper, tag), cfg(wall_time_s=30)))
    deadline = time.monotonic() + 5
    while len(processes_with(tag)) < 4 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert len(processes_with(tag)) == 4
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(task, 0.2)  # as the tool pool does
    assert await wait_gone(tag, within=1.0) == []
    assert await zombies_left(zombies) == []


@needs_bwrap
async def test_concurrent_runs_do_not_share_a_process_budget():
    code = (
        "import os, time\n"
        "start = time.time()\n"
        "pids = [os.fork() or (time.sleep(1), os._exit(0)) for _ in range(5)]\n"
        "for p in pids:\n"
        "    os.waitpid(p, 0)\n"
        "print('ok', start, time.time())\n"
    )
    results = await asyncio.gather(*(run_sandboxed(code, cfg(max_processes=8)) for _ in range(4)))
    assert [r.stdout.split()[0] for r in results] == ["ok"] * 4, [r.stderr for r in results]
    spans = [tuple(map(float, r.stdout.split()[1:])) for r in results]
    assert max(s for s, _ in spans) < min(e for _, e in spans)  # all four held 5 children at the same time


@needs_bwrap
async def test_many_concurrent_runs_all_complete():
    """Runs that start and end interleaved must not disturb each other's pipes and fds."""
    # The flood never ends by itself, so only the output limit's kill (-9) can stop it, however loaded the machine.
    flood = "import sys\nwhile True:\n    sys.stdout.write('x' * 100_000)"
    codes = ["print(1)", flood, "raise SystemExit(3)"] * 8
    results = await asyncio.gather(*(run_sandboxed(c, cfg(max_output_bytes=4096)) for c in codes))
    assert [r.exit_code for r in results[:3]] == [0, -9, 3]
    assert {r.stdout for r in results[0::3]} == {"1\n"} and all(r.stdout_truncated for r in results[1::3])


# --------------------------------------------------------------------------- without bubblewrap


async def test_missing_bwrap_refuses_unless_allowed(monkeypatch):
    monkeypatch.setattr(sandbox, "find_bwrap", lambda: None)
    with pytest.raises(SandboxError, match="bubblewrap") as err:
        await run_sandboxed("print(1)", cfg())
    assert "allow_unsandboxed" in str(err.value)
    res = await run_sandboxed("import sys\nprint(sys.stdin.read() * 2)", cfg(allow_unsandboxed=True), stdin="ab")
    assert res.stdout == "abab\n" and res.exit_code == 0
    assert res.sandboxed is False and "UNSANDBOXED" in res.notes[0]
    with pytest.raises(SandboxError, match="CPU time 1 s"):  # rlimits still apply
        await run_sandboxed("while True:\n    pass\n", cfg(allow_unsandboxed=True, cpu_time_s=1))


# --------------------------------------------------------------------------- the MCP server


@needs_bwrap
async def test_server_in_process():
    server = build_server("python", PythonToolConfig(sandbox=cfg(cpu_time_s=1)))
    async with Client(server) as client:
        (tool,) = await client.list_tools()
        assert tool.name == "run_python"
        props = tool.input_schema["properties"]
        assert props["code"]["description"] and props["stdin"]["description"]
        assert tool.input_schema["required"] == ["code"]
        res = await client.call_tool("run_python", {"code": "print(input()[::-1])", "stdin": "abc"})
        assert res.structured_content["stdout"] == "cba\n"
        assert res.structured_content["exit_code"] == 0 and res.structured_content["sandboxed"] is True
        bad = await client.call_tool("run_python", {"code": ""}, raise_on_error=False)
        assert bad.is_error
    with pytest.raises(SandboxError, match="CPU time"):  # the pool reads the fault kind from its type
        await server.call_tool("run_python", {"code": "while True:\n    pass\n"})


@needs_bwrap
async def test_a_call_that_waits_too_long_for_a_slot_is_the_machines_fault_not_the_models():
    """Through the pool's host: the program holding the one slot runs on, and the call queued behind it
    past queue_timeout_s fails as `unavailable` (an infrastructure fault, never a reward) after its retries."""
    from serve_apps.tool_host import LocalBackend, ToolHost

    conf = PythonToolConfig(
        timeout_s=30, max_retries=1, retry_backoff_s=0.01, sandbox=cfg(max_concurrent=1, queue_timeout_s=0.5)
    )
    pool = ToolHost("python", LocalBackend(build_server("python", conf)), conf)
    slow, quick = await asyncio.gather(
        pool.call_tool("run_python", {"code": "import time\ntime.sleep(2)\nprint('slept')"}),
        pool.call_tool("run_python", {"code": "print(1)"}),
    )
    assert slow.ok and slow.structured["stdout"] == "slept\n"
    assert not quick.ok and quick.error_kind == "unavailable" and quick.infra_fault and quick.attempts == 2
    assert "no free sandbox for 0.5 s" in quick.error
    assert (await pool.call_tool("run_python", {"code": "print(1)"})).ok  # the slot is free again


async def test_health_probe_reports_a_missing_sandbox(monkeypatch):
    from mcp_servers import health_probe

    probe = health_probe("python", PythonToolConfig())
    if sandbox.find_bwrap():
        assert await probe() is None
    monkeypatch.setattr(sandbox, "find_bwrap", lambda: None)
    assert "bubblewrap" in await probe()
