"""The shared command-line setup of every job."""

from __future__ import annotations

import pytest

from cluster.console import VERBOSE_ENV
from jobs.cli import base_parser, setup


def test_verbose_lets_the_engines_log_at_info_and_the_config_can_say_so_too(monkeypatch: pytest.MonkeyPatch) -> None:
    # -v says "verbose" to the processes this one starts (os.environ); the tests after this one start theirs
    # from the same pytest process, and must get the quiet console a user gets.
    monkeypatch.setenv(VERBOSE_ENV, "0")
    parser = base_parser("x")
    assert setup(parser.parse_args([])).logging.engine_log_level == "WARNING"
    assert setup(parser.parse_args(["-v"])).logging.engine_log_level == "INFO"
    quiet = parser.parse_args(["-v", "--set", "logging.engine_log_level=ERROR"])
    assert setup(quiet).logging.engine_log_level == "ERROR"  # an explicit key wins over -v


LEAVE = """
import sys, threading, time, atexit
from transformers import AutoTokenizer  # imports triton, whose nanobind teardown reported leaks at exit
from jobs.cli import run_and_leave
done = []
def work():
    time.sleep(0.3)
    done.append(1)
    print("thread finished", flush=True)
atexit.register(lambda: print("atexit ran"))
def main():
    threading.Thread(target=work).start()
    print("main ran")
    sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else sys.argv[1])
run_and_leave(main)
"""


@pytest.mark.parametrize(("arg", "code"), [("0", 0), ("3", 3), ("no tasks", 1)])
def test_a_job_leaves_with_its_status_after_its_threads_and_atexit_and_without_a_teardown_report(
    arg: str, code: int
) -> None:
    import subprocess
    import sys

    from cluster.local_cluster import ROOT, clean_env

    proc = subprocess.run(
        [sys.executable, "-c", LEAVE, arg], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == code, proc.stderr
    assert proc.stdout.splitlines() == ["main ran", "thread finished", "atexit ran"]
    assert proc.stderr == ("no tasks\n" if code == 1 else "")
