"""The judge as a Ray Serve deployment on the session's embedded Ray, pointing at the OpenAI stand-in:
handle calls, batching (seen by the deployment and by the stand-in), the rate limit (counted), secrets."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from configs.schema import HttpConfig, RewardConfig
from envs.judge import Judge
from envs.judge_serve import JudgeHandle, deploy_judge, judge_client, undeploy_judge
from tests.conftest import free_port
from tests.envs.judge_fixtures import ACTION, GROUND_TRUTH, judge_config, task_messages
from tests.tasks.openai_standin import OpenAIStandin

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

SCORES = {"tool_choice": 1.0, "arguments": 1.0, "progress": 0.5, "safety": 0}
KEY = "sk-test-judge-key-0123456789"
BOUND_S = 120  # a bound on waiting for the cluster, never an assertion on time


@pytest.fixture(scope="module")
def standin() -> OpenAIStandin:
    with OpenAIStandin(responder=lambda body: SCORES) as server:
        yield server


def reward_config(standin: OpenAIStandin, cache: Path, **fields) -> RewardConfig:
    return RewardConfig(backend="llm_judge", judge=judge_config(standin.base_url, cache, **fields))


async def until(predicate, what: str) -> None:
    for _ in range(BOUND_S * 10):
        if await predicate():
            return
        await asyncio.sleep(0.1)
    pytest.fail(f"gave up waiting for {what}")


async def test_batched_concurrent_scoring_through_the_handle(ray_cluster, standin, tmp_path, monkeypatch):
    from ray import serve

    monkeypatch.setenv("MCPRL_TEST_JUDGE_KEY", KEY)  # set after Ray started: must travel with the deployment
    standin.reset()
    cfg = reward_config(standin, tmp_path / "cache", max_batch_size=4, batch_wait_s=0.5, openai_concurrency=8)
    judge = judge_client(cfg, http=HttpConfig(port=free_port()))
    assert isinstance(judge, JudgeHandle)
    try:
        standin.hold()  # requests pile up in the stand-in: how many arrive together shows the concurrency
        calls = [asyncio.ensure_future(judge.score(task_messages(), f"{ACTION} #{i}", GROUND_TRUTH)) for i in range(8)]
        reached = await asyncio.to_thread(standin.wait_in_flight, 2, BOUND_S)
        standin.release()
        results = await asyncio.gather(*calls)
        assert reached, "the stand-in never held two judge requests at once"
        for r in results:
            assert r["infra_fault"] is False and r["components"] == SCORES
            assert r["total_reward"] == pytest.approx(0.35 + 0.25 + 0.3 * 0.5)

        stats = await judge.stats()
        sizes = stats["batch_sizes"]
        assert sum(sizes) == 8 and max(sizes) > 1 and max(sizes) <= 4, sizes
        assert stats["scored"] == 8 and stats["usage"]["requests"] == 8
        assert standin.max_in_flight >= 2

        # One group ranked through the same handle.
        standin.reset()
        standin.script({"scores": [{"id": "t1", "score": 0.25}, {"id": "t0", "score": 0.75}]})
        group = await judge.rank_group([task_messages(), task_messages()], GROUND_TRUTH)
        assert group == {"scores": [0.75, 0.25], "infra_fault": False, "judge_error": None}

        # The key reached the replica as a constructor argument: it is used, and Serve does not show it.
        assert standin.requests[-1].headers["authorization"] == f"Bearer {KEY}"
        assert KEY not in repr(serve.status().applications[judge.app_name])
        assert isinstance(judge_client(cfg), JudgeHandle)  # the running app is reused, not deployed again
    finally:
        standin.release()
        undeploy_judge(judge)
    assert judge.app_name not in serve.status().applications


async def test_rate_limit_holds_back_requests(ray_cluster, standin, tmp_path):
    """At 0.001 requests/s the bucket holds one token: one request goes out, the others wait (counted).

    Batches of one: a batch answers all its requests together, so a held request would hold its batch."""
    from ray import serve

    standin.reset()
    cfg = reward_config(standin, tmp_path / "cache", rate_limit_per_s=0.001, max_batch_size=1)
    judge = deploy_judge(cfg, http=HttpConfig(port=free_port()), app_name="judge-rate-test")
    calls = [asyncio.ensure_future(judge.score(task_messages(), f"{ACTION} #{i}", GROUND_TRUTH)) for i in range(3)]
    try:
        done, _ = await asyncio.wait(calls, timeout=BOUND_S, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1 and next(iter(done)).result()["infra_fault"] is False

        async def two_waiting() -> bool:
            return (await judge.stats())["limiter_waiting"] == 2

        await until(two_waiting, "two requests waiting on the rate limit")
        assert len(standin.requests) == 1  # the limiter, not the endpoint, holds the other two
        assert sum(c.done() for c in calls) == 1
    finally:
        for c in calls:
            c.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        undeploy_judge(judge)
    assert "judge-rate-test" not in serve.status().applications


def test_a_local_judge_runs_in_process(standin, tmp_path):
    cfg = reward_config(standin, tmp_path / "cache", source="local", rate_limit_per_s=5.0)
    judge = judge_client(cfg)
    assert isinstance(judge, Judge) and judge.limiter is not None and judge.limiter.rate == 5.0


def test_deploy_refuses_a_remote_endpoint_without_a_key(standin, tmp_path, monkeypatch):
    from tasks.openai_client import MissingAPIKey

    monkeypatch.delenv("MCPRL_TEST_JUDGE_KEY", raising=False)
    cfg = reward_config(standin, tmp_path / "cache", openai_base_url="https://judge.example.invalid/v1")
    with pytest.raises(MissingAPIKey, match="MCPRL_TEST_JUDGE_KEY is not set"):
        deploy_judge(cfg)  # before anything is deployed: nothing reaches the network
