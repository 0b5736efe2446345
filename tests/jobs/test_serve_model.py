"""`python -m jobs.serve_model` as a user starts it (a subprocess on a free loopback port): vLLM's OpenAI
server on a trained LoRA run's merged export, asked with the `openai` client and tools= from our MCP
pool's own tool list; the tool call it returns is made against the pool. Also: beyond loopback without
a token, it refuses to start."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.local_cluster import free_port
from configs.schema import Config
from jobs.serve_model import api_key_for, is_loopback
from serve_apps.tool_pool import LocalToolPool
from tasks.inventory import inventory_tools_for_prompt

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 150  # export ~10 s, vLLM CPU engine 30-60 s (more on a loaded machine)
TOOL = "polygon.previous_close"


def test_refuses_to_bind_beyond_loopback_without_a_token() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")
    with pytest.raises(ValueError, match=r"--host 0\.0\.0\.0 is beyond loopback.*--api-key-env"):
        api_key_for("0.0.0.0", "", {})
    with pytest.raises(ValueError, match="MY_TOKEN is not set or empty"):
        api_key_for("0.0.0.0", "MY_TOKEN", {"MY_TOKEN": ""})
    assert api_key_for("0.0.0.0", "MY_TOKEN", {"MY_TOKEN": "s3cret"}) == "s3cret"
    assert api_key_for("127.0.0.1", "", {}) == ""
    # As the user meets it: exit 2 before anything is exported or started.
    env = {k: v for k, v in os.environ.items() if k != "MCPRL_MODEL_TOKEN"}
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.serve_model", "--run", "any", "--host", "0.0.0.0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 2 and "beyond loopback" in proc.stderr and "serving" not in proc.stdout


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.jobs.test_export import make_run

    run = tmp_path_factory.mktemp("serve") / "served-run"
    make_run(run, "lora")
    return run


def pool_tools() -> tuple[list[dict], LocalToolPool]:
    """The offline polygon and fmp servers in this process, and their tools as an episode shows them."""
    cfg = Config().tools
    for name in ("tavily", "slack", "python"):
        getattr(cfg.servers, name).enabled = False
    pool = asyncio.run(LocalToolPool.create(cfg))
    listing = asyncio.run(pool.list_tools())
    return inventory_tools_for_prompt(listing), pool


def wait_ready(url: str, proc: subprocess.Popen, log: Path) -> None:
    import httpx

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/models", timeout=2).status_code in (200, 401):
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"the server did not answer within {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def test_serves_the_policy_and_its_tool_call_runs_on_the_pool(lora_run: Path, tmp_path: Path) -> None:
    import openai

    port = free_port()
    log = tmp_path / "server.log"
    token = "test-token-123"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MY_MODEL_TOKEN": token}
    with log.open("w") as out:
        # Its own session: vLLM's engine core is a child; the whole group is ended by this PID below.
        proc = subprocess.Popen(
            [
                sys.executable,
                *("-m", "jobs.serve_model", "--run", str(lora_run), "--port", str(port)),
                "--api-key-env",
                "MY_MODEL_TOKEN",
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    tools, pool = pool_tools()
    try:
        url = f"http://127.0.0.1:{port}/v1"
        wait_ready(url, proc, log)
        assert token not in log.read_text()  # the token stays out of the console and the command line

        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong").models.list()
        client = openai.OpenAI(base_url=url, api_key=token)
        assert [m.id for m in client.models.list().data] == [lora_run.name]

        functions = [
            {
                "type": "function",
                "function": {**{k: t[k] for k in ("name", "description", "parameters")}, "strict": True},
            }
            for t in tools
        ]
        # The tiny random model would never choose a tool by itself, and under a named tool_choice vLLM's
        # guided JSON lets it pad the arguments with whitespace until max_tokens. So its output is
        # constrained by a regex (guided decoding) to a call written as our models write them (Hermes,
        # envs/parsing.py): the form is deterministic, the ticker's letters are still the model's. With
        # tool_choice auto, vLLM 0.32 replaces such a regex by its own tool grammar (whitespace again), so
        # tool_choice none: the text comes back as content, and our parser reads the call out of it.
        call_regex = (
            r'<tool_call>\{"name": "polygon\.previous_close", "arguments": \{"ticker": "[A-Z]{1,5}"\}\}</tool_call>'
        )
        reply = client.chat.completions.create(
            model=lora_run.name,
            messages=[{"role": "user", "content": "What was Apple's previous close?"}],
            tools=functions,
            tool_choice="none",
            max_tokens=64,
            temperature=0,
            extra_body={"structured_outputs": {"regex": call_regex}},
        )
        from envs.parsing import ToolIndex, parse_turn

        text = reply.choices[0].message.content or ""
        turn = parse_turn(text, ToolIndex({"polygon": {"previous_close": {}}}))
        assert [c.name for c in turn.calls] == [TOOL] and not turn.errors, text
        arguments = turn.calls[0].arguments
        assert set(arguments) == {"ticker"}

        result = asyncio.run(pool.call(TOOL, arguments))
        # The call reached the server: a real result, or the server's own verdict on the arguments.
        assert result.ok or result.error_kind == "invalid_arguments", result
        assert result.text

        # The result goes back as an assistant tool call and a tool message, OpenAI style; the exported
        # template shows both to the model as training did.
        follow = client.chat.completions.create(
            model=lora_run.name,
            messages=[
                {"role": "user", "content": "What was Apple's previous close?"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": TOOL, "arguments": json.dumps(arguments)}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": result.text[:500]},
            ],
            tools=functions,
            max_tokens=8,
            temperature=0,
        )
        assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    finally:
        asyncio.run(pool.close())
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the group this test started: the server and its engine core
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
