"""`python -m jobs.serve_model` as a user starts it (a subprocess on a free loopback port): vLLM's OpenAI
server on a run whose policy was trained to call a tool, asked with the `openai` client, tools= from our
MCP pool's own tool list and tool_choice "auto". The model writes `<tool_call>{...}</tool_call>`; vLLM's
hermes parser turns it into OpenAI `tool_calls`; the call is made against the pool and its result sent
back. Also: beyond loopback without a token, it refuses to start; a wrong token is refused."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from cluster.ports import free_port
from configs.schema import Config
from jobs.serve_model import api_key_for, is_loopback
from serve_apps.tool_pool import LocalToolPool
from tasks.inventory import inventory_tools_for_prompt

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from actors.learner import Learner

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 150  # export ~10 s, vLLM CPU engine 30-60 s (more on a loaded machine)
TOKEN = "test-token-123"
TOOL = "polygon.previous_close"
ARGUMENTS = {"ticker": "AAPL"}
QUESTION = [{"role": "user", "content": "What was Apple's previous close?"}]
# Full fine-tune of tiny-random on the one expert sample: at lr 5e-3 greedy decoding reproduces the call
# after ~36 steps (0.1 s each on an idle CPU). A LoRA adapter on this 2-layer random model barely moves
# the logits (loss ~10 after 30 steps at lr 0.1), so the served run is a full one.
SFT_LR = 5e-3
MAX_STEPS = 150
MARGIN = 1.0  # nats between the trained token and the runner-up, at every position: vLLM's kernels agree
CHECK_BELOW_LOSS = 0.5  # mean NLL (before the step) under which the margin is checked; far above it, futile


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
def pool() -> Iterator[tuple[list[dict], LocalToolPool]]:
    """The offline polygon and fmp servers in this process, and their tools as OpenAI `tools=` entries
    (names as an episode shows them: `server.tool`)."""
    cfg = Config().tools
    for name in ("tavily", "slack", "python"):
        getattr(cfg.servers, name).enabled = False
    tool_pool = asyncio.run(LocalToolPool.create(cfg))
    listing = asyncio.run(tool_pool.list_tools())
    functions = [
        {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
        for t in inventory_tools_for_prompt(listing)
    ]
    yield functions, tool_pool
    asyncio.run(tool_pool.close())


@dataclass
class TrainedRun:
    folder: Path
    prompt_ids: list[int]  # the task (system message, question) with the tools, as training renders it
    tokenizer: PreTrainedTokenizerBase
    steps: int


def memorise(learner: Learner, prompt: list[int], target: list[int]) -> int:
    """Learner.sft_step on the one sample until every target token is the greedy choice by MARGIN; the
    number of steps (39 here, seeded). A teacher-forced forward checks all positions at once: what greedy
    decoding would choose at each."""
    import torch

    ids = torch.tensor([prompt + target])
    sample = {"prompt_ids": prompt, "response_ids": target, "loss_mask": [1] * len(target)}
    rows = torch.arange(len(target))
    for step in range(1, MAX_STEPS + 1):
        if learner.sft_step([sample])["sft_loss"] > CHECK_BELOW_LOSS:
            continue
        learner.model.eval()
        with torch.no_grad():  # the logits that predict each target token
            logits = learner.model(input_ids=ids, logits_to_keep=len(target) + 1).logits[0, :-1].float()
        logp = logits.log_softmax(-1)
        chosen = logp[rows, target]
        logp[rows, target] = float("-inf")
        if (chosen - logp.max(-1).values).min().item() >= MARGIN:
            return step
    raise AssertionError(f"the policy did not memorise the call in {MAX_STEPS} sft steps")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, pool: tuple[list[dict], LocalToolPool]) -> TrainedRun:
    """A full fine-tune run of tiny-random, trained (real Learner.sft_step) on ONE expert sample: its one
    task (a system message and the question) with our pool's tools, rendered as training renders it
    (envs/prompting.py), then the call as training writes calls."""
    import torch

    from actors.learner import Learner
    from actors.models import load_tokenizer
    from envs.parsing import format_tool_call
    from envs.prompting import encode, render_prompt
    from tasks.generators.rule import SYSTEM_PROMPT
    from tasks.io import write_rows
    from tests.jobs.test_export import save_run, tiny_config

    functions, _ = pool
    root = tmp_path_factory.mktemp("serve")
    folder = root / "served-run"
    cfg = tiny_config(folder.name, "full")
    cfg.sft_warmup.lr = SFT_LR
    # Its training task opens with the rule generator's system message; the user's request will not.
    task = [{"role": "system", "content": SYSTEM_PROMPT}, *QUESTION]
    cfg.data.train = str(root / "train.jsonl")
    write_rows([{"prompt": task}], cfg.data.train)
    tokenizer = load_tokenizer(cfg.model)
    tools = [f["function"] for f in functions]
    prompt = encode(tokenizer, render_prompt(tokenizer, task, tools, cfg.env.final_answer, cfg.env.tool_format))
    # The template ends an assistant turn with the tokenizer's EOS (<|im_end|>): the server stops there.
    target = tokenizer.encode(format_tool_call(TOOL, ARGUMENTS), add_special_tokens=False)
    target += [tokenizer.eos_token_id]

    learner = Learner(cfg)
    learner.setup()
    steps = memorise(learner, prompt, target)
    # The check that matters before serving: transformers' greedy decoding writes the call, then stops.
    with torch.no_grad():
        out = learner.model.generate(
            torch.tensor([prompt]), max_new_tokens=len(target) + 4, do_sample=False, pad_token_id=target[-1]
        )
    written = out[0, len(prompt) :].tolist()
    assert written == target, f"greedy decoding after {steps} steps: {tokenizer.decode(written)!r}"
    save_run(folder, learner, steps)
    return TrainedRun(folder, prompt, tokenizer, steps)


def wait_ready(url: str, proc: subprocess.Popen, log: Path) -> None:
    """As a user waits: for serve_model's ready line (printed once the server's /health answers; on a
    loaded machine that can come seconds after the API does), then for the API itself."""
    import httpx

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        if f"ready: {url} (Ctrl-C stops it)" in log.read_text():
            try:
                if httpx.get(f"{url}/models", timeout=5).status_code in (200, 401):
                    return
            except httpx.HTTPError:
                pass
        time.sleep(1)
    raise AssertionError(f"no ready line, or no API, within {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def server(
    trained_run: TrainedRun, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path, subprocess.Popen]]:
    """`python -m jobs.serve_model --run RUN --port P --api-key-env MY_MODEL_TOKEN`, once for the module:
    its base URL (…/v1), its log (stdout and stderr) and its process."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MY_MODEL_TOKEN": TOKEN}
    with log.open("w") as out:
        # Its own session: vLLM's engine core is a child; the whole group is ended by this PID below.
        proc = subprocess.Popen(
            [
                sys.executable,
                *("-m", "jobs.serve_model", "--run", str(trained_run.folder), "--port", str(port)),
                *("--api-key-env", "MY_MODEL_TOKEN"),
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}/v1"
        wait_ready(url, proc, log)
        yield url, log, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the group this test started: the server and its engine core
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def tokenize(url: str, messages: list[dict], functions: list[dict], *, generation_prompt: bool) -> list[int]:
    """The server's own rendering + tokenization of a chat request (vLLM's /tokenize)."""
    import httpx

    body = {"messages": messages, "tools": functions, "add_generation_prompt": generation_prompt}
    reply = httpx.post(
        url.removesuffix("/v1") + "/tokenize", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30
    )
    reply.raise_for_status()
    return reply.json()["tokens"]


def test_auth_and_the_servers_rendering_is_the_trained_one(
    server: tuple[str, Path, subprocess.Popen], trained_run: TrainedRun, pool: tuple[list[dict], LocalToolPool]
) -> None:
    import openai

    url, log, _ = server
    assert TOKEN not in log.read_text()  # the token stays out of the console and the command line
    # The export it serves stays in the cache: the console says where, how large, and how to remove it.
    said = re.search(
        r"export: (\S+) \((\d+) MB\) stays in this node's cache.*Remove it with: rm -r (\S+)", log.read_text()
    )
    assert said and said[1] == said[3] and Path(said[1], "model.safetensors").is_file(), log.read_text()[-3000:]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong").models.list()
    client = openai.OpenAI(base_url=url, api_key=TOKEN)
    assert [m.id for m in client.models.list().data] == [trained_run.folder.name]
    # The OpenAI request (the question and tools=, no system message) reaches the model as the training
    # sample's prompt, token for token: the exported template adds the tasks' system message.
    assert tokenize(url, QUESTION, pool[0], generation_prompt=True) == trained_run.prompt_ids


def test_the_trained_call_comes_back_as_openai_tool_calls_and_runs_on_the_pool(
    server: tuple[str, Path, subprocess.Popen], trained_run: TrainedRun, pool: tuple[list[dict], LocalToolPool]
) -> None:
    import openai

    from envs.parsing import format_tool_call

    url, log, _ = server
    functions, tool_pool = pool
    client = openai.OpenAI(base_url=url, api_key=TOKEN)
    name = trained_run.folder.name
    # No structured output and no strict tools: the text is the model's own, read by vLLM's hermes parser.
    reply = client.chat.completions.create(
        model=name, messages=QUESTION, tools=functions, tool_choice="auto", max_tokens=64, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", (choice, log.read_text()[-2000:])
    assert not choice.message.content  # all of the text was the call
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id
    assert call.function.name == TOOL and json.loads(call.function.arguments) == ARGUMENTS

    result = asyncio.run(tool_pool.call(call.function.name, json.loads(call.function.arguments)))
    assert result.ok and "AAPL" in result.text, result

    # The result goes back OpenAI style: the assistant's tool call as returned, then a tool message.
    messages = [
        *QUESTION,
        {"role": "assistant", "tool_calls": [call.model_dump(include={"id", "type", "function"})]},
        {"role": "tool", "tool_call_id": call.id, "content": result.text[:500]},
    ]
    # The exported template shows the call to the model as training wrote it (vLLM hands the template
    # the arguments as a mapping; a JSON string would render as empty arguments).
    shown = trained_run.tokenizer.decode(tokenize(url, messages, functions, generation_prompt=True))
    assert format_tool_call(TOOL, ARGUMENTS) in shown and result.text[:100] in shown, shown[-800:]
    follow = client.chat.completions.create(model=name, messages=messages, tools=functions, max_tokens=8, temperature=0)
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_its_console_is_ours_and_ctrl_c_ends_it_in_one_line(server: tuple[str, Path, subprocess.Popen]) -> None:
    """Last in the module (it stops the server): after the requests above, the console holds mcprl's lines,
    vLLM's warnings only (no INFO, no access log, no load bars); Ctrl-C (SIGINT to the terminal's process
    group, this one's) stops it with exit 130 and one line of ours, without triton's exit report."""
    url, log, proc = server
    started = log.read_text()
    assert f"ready: {url} (Ctrl-C stops it)" in started, started[-3000:]
    assert not re.search(r"pid=\d+\) INFO ", started), started[-3000:]  # vLLM's INFO, in any of its processes
    for noise in (
        '"POST /v1/chat/completions',  # uvicorn's access log
        "Loading safetensors checkpoint shards",  # vLLM's load bar
        "Model Runner V2 requires",  # a notice of vLLM's engine core
        "Loading weights",  # transformers' bars in the export, which prints its own steps
        "Writing model shards",
        "Setting accelerator to CPU",  # DeepSpeed's notice, on import
        "Disabling Triton",  # vLLM's print on import, in each of its processes
        "NUMA binding",  # torch's, on the engine core's start
    ):
        assert noise not in started, noise
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    stopped = log.read_text()[len(started) :]
    assert stopped.count("serve_model: stopped the server (SIGINT)") == 1, stopped[-3000:]
    for noise in ("nanobind", "Traceback", "KeyboardInterrupt", "resource_tracker"):
        assert noise not in stopped, stopped[-3000:]
