"""The LLM judge as a Ray Serve application, and `judge_client`, which picks it or the in-process judge.

One deployment (application `judge`, no HTTP route: it is reached by handle only) wraps one
`envs.judge.Judge`. Requests are batched (`@serve.batch`, `max_batch_size` / `batch_wait_s` from the
config) and each request of a batch is scored concurrently through the judge's client (itself bounded
by `openai.concurrency`). A token bucket (`RateLimiter`, `rate_limit_per_s`) spaces the requests sent
to the endpoint. The API key and the values to redact travel as constructor arguments (pickled), not
in a runtime_env, which the dashboard shows.

    handle = deploy_judge(cfg.reward)
    r = await handle.score(conversation, latest_action, ground_truth)      # same dict as Judge.score
    g = await handle.rank_group(trajectories, ground_truth)                 # same dict as Judge.rank_group
    undeploy_judge(handle)

A replica that dies mid-call is an infrastructure fault: the call returns a result flagged
`infra_fault`, never an exception a reward could turn into a penalty.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from typing import Any

from cluster.retry import REPLICA_RETRY_WAIT_S, RetryPolicy, retry_async
from configs.loader import SECRET_ENV_VARS
from configs.schema import HttpConfig, JudgeConfig, RewardConfig
from envs.judge import Judge, JudgeLike, check_rubric, infra_fault_result
from serve_apps.tool_host import RateLimiter
from tasks.openai_client import OPENAI_BASE_URL, MissingAPIKey, is_local_url

log = logging.getLogger(__name__)

APP_NAME = "judge"
MAX_CONCURRENT_BATCHES = 4  # batches in flight at once; the client's concurrency bounds the requests
BATCHED_CALLS = ("score", "rank_group")  # the JudgeLike calls the deployment relays to its Judge


def _deployment_class() -> Any:
    """The Serve deployment, defined lazily so importing this module does not import Ray Serve."""
    from ray import serve

    class JudgeDeployment:
        def __init__(self, cfg: JudgeConfig, secrets: dict[str, str]) -> None:
            from cluster.ray_env import replica_on_loopback

            replica_on_loopback()
            os.environ.update(secrets)  # this replica's own process: the client reads its key, redaction the rest
            limiter = RateLimiter(cfg.rate_limit_per_s) if cfg.rate_limit_per_s else None
            self.judge = Judge(cfg, limiter=limiter)
            self.batch_sizes: list[int] = []
            self._batched.set_max_batch_size(cfg.max_batch_size)
            self._batched.set_batch_wait_timeout_s(cfg.batch_wait_s)

        async def call(self, method: str, args: tuple[Any, ...]) -> dict[str, Any]:
            """One `JudgeLike` call that `JudgeHandle` relays (`score` or `rank_group`), batched with the
            others in flight: the interface is written once, in the protocol, not again here."""
            if method not in BATCHED_CALLS:
                raise ValueError(f"judge deployment: no call {method!r}; it relays {BATCHED_CALLS}")
            return await self._batched((method, args))

        @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.02, max_concurrent_batches=MAX_CONCURRENT_BATCHES)
        async def _batched(self, items: list[tuple[str, tuple[Any, ...]]]) -> list[dict[str, Any]]:
            self.batch_sizes.append(len(items))
            return await asyncio.gather(*(getattr(self.judge, method)(*args) for method, args in items))

        async def stats(self) -> dict[str, Any]:
            """The judge's counters and token usage, and the size of every batch so far."""
            return {**(await self.judge.stats()), "batch_sizes": list(self.batch_sizes)}

        async def __del__(self) -> None:
            await self.judge.aclose()

    return JudgeDeployment


def judge_secrets(cfg: JudgeConfig) -> dict[str, str]:
    """What the replica needs from the driver's environment: the API key, and the values to redact."""
    names = {cfg.openai.api_key_env, *SECRET_ENV_VARS, *cfg.secret_env_vars}
    return {k: os.environ[k] for k in names if os.environ.get(k)}


class JudgeHandle(JudgeLike):
    """The Serve judge as a `JudgeLike`: same calls and results as the in-process `Judge`; a replica that
    dies becomes an infra_fault result."""

    def __init__(self, handle: Any, app_name: str = APP_NAME, retries: int = 2) -> None:
        self.handle = handle
        self.app_name = app_name
        self.retries = retries

    async def _call(self, method: str, *args: Any) -> dict[str, Any] | None:
        """The replica's answer; None when replicas keep dying (retried first: Serve routes elsewhere)."""
        from ray.exceptions import RayActorError

        policy = RetryPolicy(self.retries, REPLICA_RETRY_WAIT_S)

        def died(attempt: int, _wait: float, e: BaseException) -> None:
            log.warning("judge replica died (%s), attempt %d/%d", type(e).__name__, attempt, policy.attempts)

        async def once(_: int) -> dict[str, Any] | None:
            return await self.handle.call.remote(method, args)

        try:
            return await retry_async(once, policy, retry_exc=lambda e: isinstance(e, RayActorError), on_retry=died)
        except RayActorError as e:
            died(policy.attempts, 0.0, e)
            return None

    async def score(
        self,
        conversation: list[dict[str, Any]],
        latest_action: str,
        ground_truth: dict[str, Any],
        rubric: dict[str, float] | None = None,
    ) -> dict[str, Any]:
        if rubric is not None:
            check_rubric(rubric)  # here: a bad rubric in a batch would fail its batch-mates too
        result = await self._call("score", conversation, latest_action, ground_truth, rubric)
        return result if result is not None else infra_fault_result("unavailable: the judge replica died")

    async def rank_group(
        self, trajectories: list[list[dict[str, Any]]], ground_truth: dict[str, Any]
    ) -> dict[str, Any]:
        result = await self._call("rank_group", trajectories, ground_truth)
        if result is None:
            return {"scores": None, "infra_fault": True, "judge_error": "unavailable: the judge replica died"}
        return result

    async def stats(self) -> dict[str, Any]:
        return await self.handle.stats.remote()


def deploy_judge(cfg: RewardConfig, *, http: HttpConfig | None = None, app_name: str | None = None) -> JudgeHandle:
    """Deploy the judge as its own Serve application (handle only, no HTTP route); Ray must be up.

    `http`: where Serve's proxy listens if this call is the one that starts Serve (default: the tool
    pool's defaults, loopback); a running Serve keeps its own.
    """
    from ray import serve

    from serve_apps.tool_pool import start_serve

    jc = cfg.judge
    app_name = app_name or jc.app_name
    key_env, url = jc.openai.api_key_env, jc.openai.base_url or OPENAI_BASE_URL
    if not os.environ.get(key_env, "").strip() and not is_local_url(url):
        # Checked here: in the replica it would be a crash loop with the message buried in its log.
        raise MissingAPIKey(f"{key_env} is not set, and the judge's endpoint {url} needs an API key")
    start_serve(http or HttpConfig(), "Ray Serve (the judge; no HTTP route) listens")
    deployment = serve.deployment(_deployment_class()).options(
        name="Judge",
        num_replicas=1,  # the rate limit is per replica: one replica keeps it the service's limit
        ray_actor_options=jc.replica_resources.actor_options(),
        # Room for every batch in flight: Serve warns when a batch could never fill.
        max_ongoing_requests=max(64, jc.max_batch_size * MAX_CONCURRENT_BATCHES),
        logging_config={"enable_access_log": False, "log_level": "WARNING"},
        graceful_shutdown_wait_loop_s=0.1,  # as the tool pool's: undeploying waits no 2 s loop
    )
    handle = serve.run(deployment.bind(jc, judge_secrets(jc)), name=app_name, route_prefix=None)
    return JudgeHandle(handle, app_name)


def undeploy_judge(judge: JudgeHandle, timeout_s: float = 60.0) -> None:
    """Delete the judge's application (leaves Serve and other applications alone)."""
    from ray import serve

    if judge.app_name not in serve.status().applications:
        return
    serve.delete(judge.app_name, _blocking=False)
    deadline = time.monotonic() + timeout_s
    while judge.app_name in serve.status().applications and time.monotonic() < deadline:
        time.sleep(0.2)


def judge_client(cfg: RewardConfig, *, http: HttpConfig | None = None) -> JudgeLike:
    """The judge `cfg.judge.source` names (see JudgeConfig): the Serve deployment (deployed when missing;
    joins the cluster at $RAY_ADDRESS when Ray is not up in this process) or the in-process `Judge`."""
    jc = cfg.judge
    # Ray cannot be up in this process unless it was imported: no need to import it to ask.
    ray = sys.modules.get("ray")
    ray_up = ray is not None and ray.is_initialized()
    if jc.source == "serve" or (jc.source == "auto" and ray_up):
        import ray as ray_mod
        from ray import serve
        from ray.serve.exceptions import RayServeException

        if not ray_mod.is_initialized():
            ray_mod.init(address=os.environ.get("RAY_ADDRESS") or "auto", logging_level="ERROR")
        try:
            return JudgeHandle(serve.get_app_handle(jc.app_name), jc.app_name)
        except RayServeException:  # Serve not running, or no judge app yet
            return deploy_judge(cfg, http=http, app_name=jc.app_name)
    limiter = RateLimiter(jc.rate_limit_per_s) if jc.rate_limit_per_s else None
    return Judge(jc, limiter=limiter)
