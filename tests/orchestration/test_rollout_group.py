"""RolloutGroup on real local Ray: 2 HF engine actors (tiny-random) + 1 runner actor, the real env over
the Serve tool pool (offline polygon server), given to the group while its engines start. Well-formed
trajectories, the sampling override, a LoRA push through the object store, an engine actor killed mid-run
(restarted at the current version), a runner actor killed mid-run (replaced, its tasks re-run), and the engine
restart budget; the engines' policy versions on the node's metrics endpoint; a failed tool deployment stops
the engines started beside it.

Tests share one group and run in file order; the last ones kill actors.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest

from actors.engine_api import EngineError, EngineUnavailable
from actors.models import load_tokenizer
from actors.trajectory import Trajectory
from configs.loader import load_config
from configs.schema import Config, SamplingConfig
from orchestration.cpu_pinning import core_slice, cpu_list
from orchestration.rollout_actors import RemoteEngine
from orchestration.rollout_group import RolloutGroup, RolloutGroupError
from tests.actors.test_engine_conformance import make_adapter
from tests.conftest import free_port

pytestmark = pytest.mark.slow  # Ray, vLLM or a job's own process: `make test` runs it, `make test-fast` skips it

TICKERS = ("NVDA", "AAPL", "MSFT", "AMZN")
GREEDY = SamplingConfig(temperature=0, max_new_tokens=12, stop=["</tool_call>", "</answer>"])


def row(i: int, max_turns: int = 2) -> dict[str, Any]:
    """A SkyRL task row: one polygon call expected. tiny-random never makes it; turns run to max_turns."""
    ticker = TICKERS[i % len(TICKERS)]
    return {
        "data_source": "mcprl/test",
        "prompt": [{"role": "user", "content": f"What was {ticker}'s previous close? (task {i})"}],
        "reward_spec": {
            "method": "rule",
            "ground_truth": {
                "task_id": f"rg-{i}",
                "complexity": "simple",
                "max_turns": max_turns,
                "success": {"must_call_tool": "polygon.previous_close"},
                "tool_sequence": [
                    {"step": 1, "server": "polygon", "tool": "previous_close", "params": {"ticker": ticker}}
                ],
                "limits": {"max_servers": 1, "max_tools": 1},
            },
        },
    }


def group_config() -> Config:
    return Config.model_validate(
        {
            "run_name": "rollout-group-test",  # its own `run` tag on the metrics endpoint
            "model": {"name": "tiny-random"},
            "finetune": {"mode": "lora", "lora": {"r": 8}},
            "rollout": {
                "backend": "hf",
                "engines": 2,
                "runners": 1,
                "engine_resources": {"num_cpus": 0.5},  # 2 engines + the pool's replicas fit the session's 2 CPUs
                "runner_resources": {"num_cpus": 0.1},
                "max_model_len": 2048,
                "max_total_tokens": 2048,
                "max_episode_restarts": 2,
                "sampling": {"temperature": 1.0, "max_new_tokens": 16},
            },
        }
    )


@pytest.fixture(scope="module")
def pool(ray_cluster):
    from serve_apps.tool_pool import deploy_pool, undeploy_pool

    off = [f"tools.servers.{n}.enabled=false" for n in ("fmp", "tavily", "slack", "python")]
    pool = deploy_pool(load_config(None, [f"tools.http.port={free_port()}", *off]).tools)
    yield pool
    undeploy_pool(pool)


@pytest.fixture(scope="module")
async def group(pool) -> AsyncIterator[RolloutGroup]:
    async def tools() -> tuple[Any, None]:  # as jobs.train gives them: deployed while the engines start
        await asyncio.sleep(0.5)
        return pool, None

    group = RolloutGroup(group_config(), None, start_timeout_s=240)
    await group.start(tools())
    try:
        yield group
    finally:
        await group.shutdown()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(Config().model)


def segments(trajs: list[Trajectory]) -> list[list[list[int]]]:
    return [t.generated_segments() for t in trajs]


def check_well_formed(t: Trajectory, tokenizer: Any, cfg: Config) -> None:
    t.check(max_total_tokens=cfg.rollout.max_total_tokens)
    assert not t.infra_fault and t.finish_reason in ("max_turns", "done"), t.finish_reason
    # The prompt is the chat template of the env's first messages (tools in the system prompt).
    first = next(i for i, m in enumerate(t.messages) if m["role"] == "assistant")
    expected = tokenizer.apply_chat_template(t.messages[:first], add_generation_prompt=True, tokenize=False)
    assert t.prompt_ids == tokenizer.encode(expected, add_special_tokens=False)
    # Masks: 1 exactly on each turn's generated ids; the runner's end-of-turn and observation ids are 0.
    gens = t.generated_segments()
    assert len(gens) == t.turns and all(gens)
    assert t.num_generated == sum(map(len, gens))
    assert all(lp < 0 for lp, m in zip(t.rollout_logprobs, t.loss_mask, strict=True) if m)
    assert t.loss_mask[: len(gens[0])] == [1] * len(gens[0])  # the response starts with turn 1's own ids
    assert len(t.versions) == t.turns


# --------------------------------------------------------------------------- helpers without Ray


def test_core_slices_are_disjoint_and_cover():
    assert [core_slice([0, 1], k, 2) for k in range(2)] == [[0], [1]]
    assert [core_slice(range(8), k, 3) for k in range(3)] == [[0, 1], [2, 3, 4], [5, 6, 7]]
    assert [core_slice([0, 1], k, 3) for k in range(3)] == [[0], [1], [0]]  # more engines than cores
    assert (cpu_list([2, 3, 4]), cpu_list([5]), cpu_list([0, 2])) == ("2-4", "5", "0,2")
    with pytest.raises(ValueError, match="out of range"):
        core_slice([0, 1], 2, 2)


# --------------------------------------------------------------------------- the group


async def test_episodes_are_well_formed(group: RolloutGroup, tokenizer) -> None:
    rows = [row(i) for i in range(4)]
    trajs = await group.run(rows, group_size=2)

    assert [(t.task_id, t.group_id, t.sample_index) for t in trajs] == [
        (f"rg-{g}", g, s) for g in range(4) for s in range(2)
    ]
    for t in trajs:
        check_well_formed(t, tokenizer, group.cfg)
        assert t.turns == 2 and t.versions == [0, 0] and t.restarts == 0
        assert t.tool_stats["tool_calls"] == 0  # tiny-random makes no valid call; the env still answers
    assert {t.engine for t in trajs} == {0, 1}  # least-loaded routing over both engine actors
    stats = await group.stats()
    assert stats["done"] == stats["episodes"] == 8 and stats["running"] == 0 and stats["failed"] == 0
    assert stats["generated_tokens"] == sum(t.num_generated for t in trajs)
    assert [e["placement"]["torch_threads"] for e in stats["engines"]] == [1, 1]  # 2 cores split over 2 engines
    assert await group.versions() == [0, 0]

    # An EngineError raised in the actor comes back as EngineError (the request's fault, no restart).
    with pytest.raises(EngineError, match="empty prompt"):
        await RemoteEngine(group.engines[0], 0).generate([], GREEDY)


async def test_actors_carry_the_run_name(group: RolloutGroup, pool) -> None:
    import ray

    run = group.cfg.run_name
    for role, handles in (("engine", group.engines), ("runner", group.runners)):
        for i, handle in enumerate(handles):  # what the dashboard shows, and a handle to the same actor
            assert ray.get_actor(f"mcprl:{run}:{role}-{i}")._actor_id == handle._actor_id
    # A second group under the same run_name in this namespace does not start, and the first runs on.
    second = RolloutGroup(group_config(), pool, start_timeout_s=60)
    with pytest.raises(RuntimeError, match=rf"'mcprl:{run}:engine-0' is taken in namespace .*run_name"):
        await second.start()
    assert second.engines == [] and second.runners == []
    assert await group.versions() == [0, 0]


async def test_a_failed_tool_deployment_stops_the_engines_it_started_beside() -> None:
    cfg = group_config()
    cfg.run_name = "rollout-group-tools-fail"
    cfg.rollout.engines, cfg.rollout.engine_resources.num_cpus = 1, 0.1  # beside the shared group

    async def tools() -> tuple[Any, None]:
        await asyncio.sleep(1)
        raise RuntimeError("tools.servers.polygon: the deployment failed")

    failed = RolloutGroup(cfg, None, start_timeout_s=120)
    with pytest.raises(RuntimeError, match="the deployment failed"):
        await failed.start(tools())
    assert failed.engines == [] and failed.runners == [] and failed.groups == []  # stopped, placement freed


async def test_sampling_override_greedy_is_repeatable(group: RolloutGroup) -> None:
    rows = [row(i) for i in range(2)]
    first = await group.run(rows, 1, sampling=GREEDY)
    second = await group.run(rows, 1, sampling=GREEDY)
    assert segments(first) == segments(second)
    assert all(len(seg) <= GREEDY.max_new_tokens for t in first for seg in t.generated_segments())
    # Same task, one sample on each engine: greedy on both engines gives the same tokens.
    pair = await group.run(rows[:1], 2, sampling=GREEDY)
    assert {t.engine for t in pair} == {0, 1}
    assert pair[0].generated_segments() == pair[1].generated_segments()
    # Without the override the config's sampling (temperature 1, 16 new tokens) applies again.
    sampled = await group.run(rows, 1)
    assert segments(sampled) != segments(first)


async def test_push_adapter_through_the_object_store(group: RolloutGroup) -> None:
    import ray

    rows = [row(i) for i in range(2)]
    before = await group.run(rows, 1, sampling=GREEDY)
    ref = ray.put(make_adapter(seed=0))
    report = await group.push_adapter(1, ref)

    assert await group.versions() == [1, 1]
    assert report["engines"] == [0, 1] and len(report["per_engine_s"]) == 2
    assert report["latency_s"] == max(report["per_engine_s"]) > 0
    # each engine's own load time: part of what the driver waited for that engine
    assert len(report["load_s"]) == 2
    assert all(0 < load <= wall for load, wall in zip(report["load_s"], report["per_engine_s"], strict=True))
    after = await group.run(rows, 1, sampling=GREEDY)
    assert all(t.versions == [1] * t.turns for t in after)
    assert [s[0] for s in segments(after)] != [s[0] for s in segments(before)]  # greedy output changed
    # A version that is not newer is refused by every engine, and the error names them.
    with pytest.raises(RolloutGroupError, match=r"engine 0: .*not newer.*engine 1: "):
        await group.push_adapter(1, ref)
    with pytest.raises(TypeError, match="ObjectRef"):
        await group.push_adapter(2, make_adapter(seed=1))


async def test_engines_export_their_policy_version(group: RolloutGroup) -> None:
    """Each engine actor sets its version gauge after a load: the node's Prometheus endpoint shows v1 on both."""
    from tests.prometheus import find, wait_for

    assert await group.versions() == [1, 1]  # pushed by the test above
    run = group.cfg.run_name

    def versions(samples: list) -> dict[str, float] | None:
        found = {s.labels["engine"]: s.value for s in find(samples, "ray_mcprl_engine_policy_version", run=run)}
        return found if found.get("0") == found.get("1") == 1 else None

    assert await asyncio.to_thread(wait_for, versions, "engine policy versions v1") == {"0": 1, "1": 1}


async def test_engine_killed_mid_run_every_episode_comes_back_once(group: RolloutGroup, tokenizer) -> None:
    import ray

    rows = [row(i, max_turns=6) for i in range(4)]
    victim = group.engines[0]
    run = asyncio.create_task(group.run(rows, group_size=2))
    # Kill engine 0 once it has served a batch: its episodes have turns left to play.
    for _ in range(1500):
        if (await victim.stats.remote()).get("requests", 0) >= 1:
            break
        await asyncio.sleep(0.02)
    else:
        pytest.fail("engine 0 served nothing")
    assert not run.done()
    ray.kill(victim, no_restart=True)
    trajs = await run

    counts = Counter((t.task_id, t.sample_index) for t in trajs)
    assert counts == Counter({(f"rg-{g}", s): 1 for g in range(4) for s in range(2)})  # none lost, none twice
    assert [(t.group_id, t.sample_index) for t in trajs] == [(g, s) for g in range(4) for s in range(2)]
    restarted = [t for t in trajs if t.restarts]
    assert restarted, "engine 0's episodes must have been restarted"
    for t in trajs:
        check_well_formed(t, tokenizer, group.cfg)
        assert t.turns == 6 and t.versions == [1] * 6
    assert all(t.engine == 1 for t in restarted)
    stats = await group.stats()
    assert stats["restarts"] == sum(t.restarts for t in trajs) and stats["failed"] == 0

    # The dead actor surfaces as EngineUnavailable (not EngineError): the runner restarts, not fails.
    with pytest.raises(EngineUnavailable) as info:
        await RemoteEngine(victim, 0).generate([1, 2, 3], GREEDY)
    assert not isinstance(info.value, EngineError)

    # The run noticed the death: engine 0 is a new actor under the same name, at the version pushed
    # before the kill (v1, not the base model's 0), and the runner routes to it again.
    assert group.engine_restarts == 1 and group.dead == set()
    assert group.engines[0]._actor_id != victim._actor_id
    assert ray.get_actor(f"mcprl:{group.cfg.run_name}:engine-0")._actor_id == group.engines[0]._actor_id
    assert await group.versions() == [1, 1]
    stats = await group.stats()
    assert stats["dead_engines"] == [] and stats["runners"][0]["dead_engines"] == []
    assert stats["engines"][0]["placement"]["torch_threads"] == 1  # its own core slice again
    # Pushes reach it, and the next run uses both engines again.
    report = await group.push_adapter(2, ray.put(make_adapter(seed=1)))
    assert report["engines"] == [0, 1] and report["dead_engines"] == [] and report["restarted_engines"] == []
    assert await group.versions() == [2, 2]
    again = await group.run([row(i) for i in range(4)], group_size=2)
    assert {t.engine for t in again} == {0, 1}
    assert all(t.versions == [2] * t.turns and not t.restarts and not t.infra_fault for t in again)


async def test_runner_killed_mid_run_is_replaced_and_its_tasks_rerun(group: RolloutGroup, tokenizer) -> None:
    import ray

    rows = [row(i, max_turns=4) for i in range(3)]
    victim = group.runners[0]

    async def served() -> int:
        return sum(s.get("requests", 0) for s in await asyncio.gather(*(e.stats.remote() for e in group.engines)))

    before = await served()
    run = asyncio.create_task(group.run(rows, group_size=2))
    # Kill the runner once its episodes are under way (an engine served one of its requests).
    for _ in range(1500):
        if await served() > before:
            break
        await asyncio.sleep(0.02)
    else:
        pytest.fail("the runner sent nothing")
    assert not run.done()
    ray.kill(victim, no_restart=True)
    trajs = await run

    assert [(t.task_id, t.group_id, t.sample_index) for t in trajs] == [
        (f"rg-{g}", g, s) for g in range(3) for s in range(2)
    ]  # every episode exactly once, in order
    for t in trajs:
        check_well_formed(t, tokenizer, group.cfg)
        assert t.turns == 4 and t.versions == [2] * 4
    assert group.runner_restarts == 1 and group.runners[0]._actor_id != victim._actor_id
    assert ray.get_actor(f"mcprl:{group.cfg.run_name}:runner-0")._actor_id == group.runners[0]._actor_id
    stats = await group.stats()  # the replacement's stats: this run's episodes, on both engines
    assert stats["done"] == stats["episodes"] == 6 and stats["failed"] == 0
    assert {t.engine for t in trajs} == {0, 1}


async def test_engine_restarts_are_bounded(group: RolloutGroup) -> None:
    import ray

    group.cfg.rollout.max_engine_restarts = group.engine_restarts  # budget spent (the driver's copy decides)
    ray.kill(group.engines[1], no_restart=True)
    assert await group.versions() == [2, -1]
    trajs = await group.run([row(i) for i in range(2)], group_size=1)
    assert [t.engine for t in trajs] == [0, 0] and not any(t.infra_fault for t in trajs)
    assert group.dead == {1} and await group.versions() == [2, -1]
    report = await group.push_adapter(3, ray.put(make_adapter(seed=2)))
    assert report["engines"] == [0] and report["dead_engines"] == [1] and report["restarted_engines"] == []


async def test_a_push_whose_every_engine_died_under_it_restarts_them_and_pushes_again(group: RolloutGroup) -> None:
    """Engines killed just before a push, unknown to the group yet: every load fails with the actor's death, so
    the group restarts them (within rollout.max_engine_restarts) and loads the push there, rather than fail
    with no live engine left (the chaos suite met this as a run's first push after an engine was killed)."""
    import ray

    group.cfg.rollout.max_engine_restarts = group.engine_restarts + 3  # room again, after the test above
    await group.push_adapter(4, ray.put(make_adapter(seed=3)))  # the dead engine 1 comes back first
    assert group.dead == set() and await group.versions() == [4, 4]
    spent = group.engine_restarts
    for handle in group.engines:
        ray.kill(handle, no_restart=True)
    report = await group.push_adapter(5, ray.put(make_adapter(seed=4)))
    assert report["engines"] == [0, 1] and report["dead_engines"] == [] and await group.versions() == [5, 5]
    assert group.engine_restarts == spent + 2
    trajs = await group.run([row(i) for i in range(2)], group_size=1)
    assert all(t.versions and set(t.versions) == {5} and not t.infra_fault for t in trajs)
