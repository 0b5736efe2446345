"""Shared, expensive fixtures: one embedded Ray per test session, a loopback S3 server per module, rule tasks made
once per session, one vLLM OpenAI server for the tests that ask for it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# No test may reach the real Hugging Face Hub: offline mode for this process, and (inherited through
# os.environ) for every subprocess, Ray worker and Serve replica the tests start. Set before anything
# imports huggingface_hub, which reads it once. Tests of the download path unset it and point
# HF_ENDPOINT at loopback.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from cluster.ports import free_port  # noqa: F401  (the tests import it from here)
from cluster.ray_env import configure_ray_env
from configs.schema import ClusterConfig

configure_ray_env()  # before any test module imports ray: loopback-only listeners


@contextlib.contextmanager
def library_logs(*names: str) -> Iterator[None]:
    """These libraries' loggers at DEBUG, without cluster.console's filters, for the
    block: an earlier test in this pytest process may have quieted them, as every entry point does."""
    from cluster.console import DropBelow

    saved = {name: (logging.getLogger(name).level, logging.getLogger(name).filters[:]) for name in names}
    for name in names:
        logger = logging.getLogger(name)
        logger.filters = [f for f in logger.filters if not isinstance(f, DropBelow)]
        logger.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        for name, (level, filters) in saved.items():
            logging.getLogger(name).filters = filters
            logging.getLogger(name).setLevel(level)


def ignore_sigint() -> None:
    """A subprocess's `preexec_fn`: it starts with SIGINT ignored, as a script's background job does (and as a
    test run started in the background hands down), so its Ctrl-C handling cannot lean on the default."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def ctrl_c_after(
    cmd: list[str], after: str, cwd: Path, env: dict[str, str] | None = None, wait_s: float = 240, settle_s: float = 1.0
) -> tuple[int, str]:
    """Start `cmd` with SIGINT ignored (see `ignore_sigint`), send it SIGINT `settle_s` after a line holding `after`
    appears, and return its exit code and output (stdout and stderr together)."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=ignore_sigint
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + wait_s
    while not any(after in line for line in lines) and proc.poll() is None:
        assert time.monotonic() < deadline, "".join(lines)
        time.sleep(0.1)
    time.sleep(settle_s)
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    return code, "".join(lines)


@pytest.fixture(scope="session")
def ray_cluster():
    """An embedded local Ray for the whole session, stopped at the end."""
    from cluster.ray_env import start_ray, stop_ray

    handle = start_ray(ClusterConfig(num_cpus=2))
    yield handle
    stop_ray(handle)


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    """A real S3 API (moto's server) on loopback, with the AWS_* variables pointing at it (for one module: the
    variables are restored after it)."""
    from tests.s3_server import s3_env

    with s3_env() as env:
        yield env


@pytest.fixture(params=["folder", "s3"])
def storage_root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A `train.storage` root, once a folder and once an s3:// URI: storage code must behave the same on both."""
    if request.param == "folder":
        return str(tmp_path / "store")
    from tests.s3_server import BUCKET

    request.getfixturevalue("s3")
    return f"s3://{BUCKET}/{tmp_path.name}"


@pytest.fixture(scope="session")
def rule_tasks(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., list[dict[str, Any]]]:
    """`rule_tasks("--n", "8", "--seed", "0")`: the rows `python -m jobs.generate_tasks --method rule ...` writes,
    made by the same code (generator, admission, writer) in this process, once per distinct arguments in the
    session: a fresh interpreter per module cost ~15 s. The command itself is tested in test_generate_job.py."""
    made: dict[tuple[str, ...], Path] = {}

    def rows(*args: str) -> list[dict[str, Any]]:
        from tasks.io import read_rows

        if args not in made:
            out = tmp_path_factory.mktemp("rule-tasks") / "rule.jsonl"
            generate_tasks(["--method", "rule", *args, "--out", str(out)])
            made[args] = out
        return read_rows(made[args])

    return rows


class _SharedVLLM:
    """The vLLM server the judge's and the task generator's tests share (one start, ~40 s, instead of one per
    module). Those tests run one after another (pytest_collection_modifyitems); the server stops after the last
    of them (pytest_runtest_teardown), so its ~4 GB are not held beside the rest of the session, and starts again
    if a test asks for it later: under pytest-xdist a worker does not know its next test at the end of a batch."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._url: str | None = None
        self.log: Path | None = None  # the server's log, shown beside a failed test that used it

    def url(self, tmp_path_factory: pytest.TempPathFactory) -> str:
        from tests.vllm_server import vllm_server

        if self._url is None:
            folder = tmp_path_factory.mktemp("vllm")
            self.log = folder / "server.log"
            self._url = self._stack.enter_context(vllm_server(folder))
        return self._url

    def close(self) -> None:
        self._stack.close()
        self._url = None


_VLLM = _SharedVLLM()


@pytest.fixture
def vllm_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The base URL of a real vLLM OpenAI server (tests/vllm_server.py), shared by the tests that ask for it."""
    return _VLLM.url(tmp_path_factory)


@pytest.fixture(scope="session", autouse=True)
def _stop_vllm_at_the_end() -> Iterator[None]:
    yield
    _VLLM.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failed test that used the shared vLLM server shows the end of the server's log: a request that timed
    out in CI is otherwise a mystery (a slow server, a hung one, or one that never got it)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and "vllm_url" in getattr(item, "fixturenames", ()) and _VLLM.log and _VLLM.log.is_file():
        tail = _VLLM.log.read_text(errors="replace")[-6000:]
        report.sections.append(("vLLM server log (last 6,000 characters)", tail))


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if "vllm_url" in getattr(item, "fixturenames", ()) and "vllm_url" not in getattr(nextitem, "fixturenames", ()):
        _VLLM.close()


def generate_tasks(argv: list[str]) -> None:
    """jobs.generate_tasks' steps after its process set-up, on a thread of their own (its event loop must
    not be this one's: pytest-asyncio's session loop may be current here)."""
    from configs.loader import load_config
    from jobs.generate_tasks import build_parser, resolve, run

    args = build_parser().parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    resolve(args, cfg, os.environ)
    with ThreadPoolExecutor(1) as pool:
        code = pool.submit(asyncio.run, run(args, cfg)).result()
    assert code == 0, f"jobs.generate_tasks {' '.join(argv)}: exit {code}"


# The files whose tests use the shared vLLM server (checked at collection).
VLLM_FILES = ("tests/jobs/test_train_judge.py", "tests/envs/test_judge_vllm.py", "tests/tasks/test_llm_vllm.py")

# The files that take minutes (a job's own process, a cluster, a benchmark), longest first, from CI's
# --durations: `make test` hands them out first so that the short files fill the end of both workers instead of
# one worker finishing a long file alone (pytest-xdist's own order, most tests first, put them last). A file
# not named here, or named and since made faster, only runs in another order.
LONGEST_FIRST = (
    "tests/jobs/test_train.py",
    *VLLM_FILES,
    "tests/cluster/test_multinode_job.py",
    "tests/bench/test_chaos.py",
    "tests/jobs/test_evaluate_job.py",
    "tests/cluster/test_wheelhouse_install.py",
    "tests/jobs/test_train_health.py",
    "tests/jobs/test_train_faults.py",
    "tests/cluster/test_autoscaler.py",
    "tests/orchestration/test_learner_group.py",
    "tests/orchestration/test_rollout_group.py",
    "tests/bench/test_suites.py",
    # `make test-bench`'s
    "tests/bench/test_learning.py",
    "tests/bench/test_quality.py",
    "tests/bench/test_scale.py",
    "tests/bench/test_e2e.py",
    "tests/bench/test_train.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Whatever starts the session's Ray is slow: `make test-fast` (-m "not slow") leaves it out. The longest
    files come first (LONGEST_FIRST). The tests of the shared vLLM server run one after another, on one worker
    under `make test` (pytest_xdist_make_scheduler)."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    on_vllm = {item.nodeid.split("::")[0] for item in items if "vllm_url" in getattr(item, "fixturenames", ())}
    if not on_vllm <= set(VLLM_FILES):
        raise pytest.UsageError(f"tests/conftest.py: add {sorted(on_vllm - set(VLLM_FILES))} to VLLM_FILES")
    rank = {file: i for i, file in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: each file keeps its order


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile`, with the files that use the shared vLLM server as one unit: one worker starts it once."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class VLLMFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "vllm server" if scope in VLLM_FILES else scope

    return VLLMFilesTogether(config, log)
