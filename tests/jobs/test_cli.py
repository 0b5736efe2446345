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
