"""How the suites' tests run a suite: as its user does, `python -m bench --suite <suite> --quick` in a fresh
process from the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cluster.local_cluster import ROOT, clean_env


def run_suite(out: Path, suite: str, *args: str, timeout: int) -> subprocess.CompletedProcess[str]:
    """`python -m bench --suite <suite> --quick --out <out> <args>`, asserted to exit 0. Its environment is a
    user's (`clean_env`: not this session's Ray; the model hub offline unless the caller's says otherwise)."""
    env = clean_env({"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")})
    cmd = [sys.executable, "-m", "bench", "--suite", suite, "--quick", "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
