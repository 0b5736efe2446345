"""MCPToolEnv from configuration alone, in a fresh process, driven as SkyRL's generator drives it.

tests/envs/skyrl_harness.py is the trainer: it builds envs with `skyrl_gym.make` from an env_config read
from YAML and runs init / step / close from a thread pool. It runs once per tool source:
- local: the in-process pool of the servers the config names (inline tools section);
- serve: the pool deployed on this session's Ray Serve, joined through RAY_ADDRESS;
- http: the same pool's MCP endpoints over streamable HTTP, with a bearer token read from a variable.
Each expert episode must earn the outcome reward, see tool results as observations and end done.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from configs.loader import load_config
from tasks.io import read_rows, write_rows
from tests.conftest import free_port

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

ROOT = Path(__file__).resolve().parents[2]
SERVERS = ["polygon", "fmp"]
OFF = {"tavily": {"enabled": False}, "slack": {"enabled": False}, "python": {"enabled": False}}
TOKEN_ENV = "MCPRL_HARNESS_TOKEN"


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("harness") / "rows.jsonl"
    cmd = [sys.executable, "-m", "jobs.generate_tasks", "--method", "rule", "--n", "12", "--seed", "3"]
    cmd += ["--domains", ",".join(SERVERS), "--complexities", "simple,medium", "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=300)
    rows = read_rows(out)[:4]  # four episodes at once through the thread pool
    write_rows(rows, out)
    return out


@pytest.fixture(scope="module")
def serve_pool(ray_cluster):
    """polygon + fmp on this session's Serve; HTTP clients must send the bearer token."""
    from serve_apps.tool_pool import deploy_pool, undeploy_pool

    os.environ[TOKEN_ENV] = "harness-secret-token"
    cfg = load_config(
        None,
        [f"tools.http.port={free_port()}", f"tools.http.bearer_token_env={TOKEN_ENV}"]
        + [f"tools.servers.{name}.enabled=false" for name in OFF],
    )
    pool = deploy_pool(cfg.tools)
    yield pool
    undeploy_pool(pool)
    os.environ.pop(TOKEN_ENV, None)


def harness(tmp_path: Path, env_config: dict, rows: Path, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    config = tmp_path / "env_config.yaml"
    config.write_text(yaml.safe_dump(env_config))
    cmd = [sys.executable, "-m", "tests.envs.skyrl_harness", str(config), str(rows)]
    env = {**os.environ, **(extra_env or {})}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


def run_harness(tmp_path: Path, env_config: dict, rows: Path, extra_env: dict | None = None) -> list[dict]:
    proc = harness(tmp_path, env_config, rows, extra_env)
    assert proc.returncode == 0, f"harness failed\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])["episodes"]


def check_episodes(episodes: list[dict], rows: Path) -> None:
    want = {r["reward_spec"]["ground_truth"]["task_id"]: r for r in read_rows(rows)}
    assert sorted(e["task_id"] for e in episodes) == sorted(want)
    for ep in episodes:
        row = want[ep["task_id"]]
        plan = row["reward_spec"]["ground_truth"]["tool_sequence"]
        servers = {s["server"] for s in plan}
        assert ep["tools_shown"] and {t.split(".")[0] for t in ep["tools_shown"]} == servers
        assert "<tool_call>" in ep["system"]  # the tool block: SkyRL renders the messages without `tools=`
        steps = ep["steps"]
        assert steps[-1]["done"] and not any(s["done"] for s in steps[:-1])
        assert not any(s["infra_fault"] for s in steps), steps
        for step, call in zip(steps, plan, strict=False):  # every call's result came back as an observation
            if not step["done"]:
                assert step["observations"][0].startswith(f"{call['server']}.{call['tool']} returned:"), step
        m = ep["metrics"]
        assert m["tool_calls"] == len(plan) == m["tool_ok"]
        assert m["task_complete"] == 1.0 and m["reward/outcome"] > 0
        assert sum(s["reward"] for s in steps) == pytest.approx(m["reward_total"]) and m["reward_total"] > 1.0


def test_local_source_from_an_inline_tools_section(tmp_path, rows_file):
    # With a stdio server too: the pool built from config is closed at the process's exit
    # (envs.tool_client.close_built), so no session task is left for the interpreter to destroy.
    notes = {"name": "notes", "command": [sys.executable, str(ROOT / "tests" / "serve_apps" / "stdio_server.py")]}
    env_config = {"env": {"tools": {"source": "local", "config": {"servers": OFF, "external": [notes]}}}}
    proc = harness(tmp_path, env_config, rows_file)
    assert proc.returncode == 0, proc.stderr[-6000:]
    check_episodes(json.loads(proc.stdout.strip().splitlines()[-1])["episodes"], rows_file)
    for noise in ("Task was destroyed but it is pending!", "RuntimeError: no running event loop"):
        assert noise not in proc.stderr, proc.stderr[-3000:]


def test_local_source_from_a_config_file_is_the_default(tmp_path, rows_file):
    # No `env.tools` at all: the in-process pool, here of an mcprl config file's servers.
    env_config = {"env": {"tools": {"config": str(ROOT / "configs" / "ci-tiny.yaml")}}}
    check_episodes(run_harness(tmp_path, env_config, rows_file), rows_file)


def test_serve_source_joins_the_cluster(tmp_path, rows_file, serve_pool, ray_cluster):
    env_config = {"env": {"tools": {"source": "serve", "servers": SERVERS}}}
    episodes = run_harness(tmp_path, env_config, rows_file, {"RAY_ADDRESS": ray_cluster.address})
    check_episodes(episodes, rows_file)


def test_http_source_with_a_bearer_token(tmp_path, rows_file, serve_pool):
    env_config = {
        "env": {
            "tools": {"source": "http", "url": serve_pool.base_url, "servers": SERVERS, "bearer_token_env": TOKEN_ENV}
        }
    }
    check_episodes(run_harness(tmp_path, env_config, rows_file), rows_file)


def test_http_source_with_a_wrong_token_fails_naming_the_server(tmp_path, rows_file, serve_pool):
    env_config = {"env": {"tools": {"source": "http", "url": serve_pool.base_url, "servers": ["polygon"]}}}
    env_config["env"]["tools"]["bearer_token_env"] = TOKEN_ENV
    proc = harness(tmp_path, env_config, rows_file, {TOKEN_ENV: "wrong-token"})
    assert proc.returncode != 0
    assert "ToolPoolError: server 'polygon' could not be opened" in proc.stderr
