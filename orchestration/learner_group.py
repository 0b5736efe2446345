"""The learner group on Ray: `learner.workers` Learner actors (actors/learner/) in one placement group.

- Placement: one bundle of `learner.worker_resources` (CPUs, GPUs, accelerator type, custom resources) per
  rank, PACKed in one placement group: on one node when they fit, spread over the fewest nodes otherwise.
- Rendezvous for torch.distributed: when every bundle sits on one node, a FileStore in that node's temp
  folder (gloo/NCCL then talk over loopback, and nothing listens on another interface: torch's TCPStore
  would bind all interfaces); across nodes, rank 0's node IP and a free port found there.
- A batch is split across ranks by tokens (grpo.batch.shard); all ranks run each call in parallel, and
  the learners' metrics are already reduced over ranks, so rank 0's are the group's.
- Exports are collectives: every rank runs them; rank 0's result lives in the object store once (the
  actor's return value, or one object per weight chunk through a streaming generator), and the driver
  hands out only references to it.
- Names: every actor of a run is named for the dashboard, `mcprl:<run_name>:<role>-<index>` (`actor_name`;
  roles engine, runner, learner). The actors stay non-detached (they die with the driver), and a name is
  unique within a Ray namespace: a second live run with the same run_name in the same namespace fails to
  start, with an error naming the actor (`start_named`), instead of sharing or replacing the first's.
- Faults: a call whose worker died raises `LearnerDied`, naming the rank, as soon as that worker is gone
  (the other ranks may be stuck in a collective waiting for it: they are not waited for). The group is
  then unusable; `restart()` starts it again from scratch (the driver then loads its last checkpoint:
  jobs/train.py, `learner.max_restarts`).
- Async: every method that reaches the actors is a coroutine (`await group.train_step(batch)`); it issues
  all ranks' calls before awaiting any, and awaits ObjectRefs, so the driver's event loop (rollouts,
  pushes) goes on while the learners train.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import uuid
from typing import Any

from actors.learner import Learner
from cluster.placement import wait_placed
from cluster.ray_env import actor_name, remote_class, start_named, wait_name_free
from configs.schema import Config

log = logging.getLogger(__name__)

_NAME_FREE_TIMEOUT_S = 30.0  # a killed actor's name is freed once the GCS has marked it dead


class LearnerDied(RuntimeError):
    """A learner worker died (killed, out of memory, node lost) during a call; names the rank and the call."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class LearnerGroup:
    """Ray wiring of the learner ranks. `await start()` first and `await shutdown()` at the end."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.actors: list[Any] = []
        self.placement_group: Any = None
        self.info: dict[str, Any] = {}

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> dict[str, Any]:
        """Reserve the bundles, start the actors, join them in one process group, load the model.

        Returns rank 0's `Learner.setup()` info."""
        import ray
        from ray.util.placement_group import placement_group, placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self.actors:
            raise RuntimeError("LearnerGroup.start: already started")
        ln = self.cfg.learner
        n = ln.workers
        res = ln.worker_resources
        pg = placement_group([res.bundle() for _ in range(n)], strategy="PACK", name=f"{self.cfg.run_name}-learners")
        self.placement_group = pg
        try:
            what = f"{n} learner worker(s) of {res.describe()} (learner.workers, learner.worker_resources)"
            await wait_placed([pg], what)
        except BaseException:
            await self.shutdown()
            raise

        def strategy(i: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)

        nodes = set(placement_group_table(pg)["bundles_to_node_id"].values())
        if n == 1:
            addr, port = "127.0.0.1", 0  # no process group at all
        elif len(nodes) == 1:
            addr, port = f"file://{tempfile.gettempdir()}/mcprl-learner-{uuid.uuid4().hex}.store", 0
        else:
            find = ray.remote(num_cpus=0)(_rendezvous_address).options(scheduling_strategy=strategy(0))
            addr, port = await find.remote()
        remote = remote_class(Learner)
        try:
            for i in range(n):  # one at a time: a failed start kills those already started
                options = {**res.actor_options(), "scheduling_strategy": strategy(i)}
                name = actor_name(self.cfg.run_name, "learner", i)
                self.actors.append(start_named(remote, name, options, self.cfg, i, n, addr, port))
            infos = await asyncio.gather(*(a.setup.remote() for a in self.actors))
        except BaseException:  # cancelled too: no actor outlives a start that did not finish
            await self.shutdown()
            raise
        self.info = infos[0]
        i = self.info
        log.info(
            "learner group: %d worker(s) on %d node(s), %s %s: %.1fM parameters, %.2fM trained; sharding %s, "
            "KL reference %s; set up in %.1f s",
            n,
            len(nodes),
            i["device"],
            i["dtype"],
            i["params"] / 1e6,
            i["trainable"] / 1e6,
            i["backend"],
            i["reference"],
            i["setup_s"],
        )
        return self.info

    async def restart(self) -> dict[str, Any]:
        """Kill what is left of the group and start it again, from the model (and `finetune.init_adapter`)
        as at the first start: load a checkpoint next. Returns rank 0's `Learner.setup()` info."""
        names = [actor_name(self.cfg.run_name, "learner", i) for i in range(len(self.actors))]
        await self.shutdown()
        for name in names:  # the new actors take the same names
            await wait_name_free(name, _NAME_FREE_TIMEOUT_S)
        return await self.start()

    async def shutdown(self) -> None:
        """Kill the actors and remove the placement group (safe to call twice)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # already dead
                log.debug("learner actor already gone", exc_info=True)
        self.actors = []
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None

    # ------------------------------------------------------------------ training

    async def train_step(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        """One GRPO iteration over the whole batch, split across the ranks by tokens."""
        return await self._split_call("train_step", samples)

    async def sft_step(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        """One supervised step over the whole batch, split across the ranks by tokens."""
        from grpo.batch import as_sample

        return await self._split_call("sft_step", [as_sample(s, i, supervised=True) for i, s in enumerate(samples)])

    async def reset_reference(self) -> str:
        """The KL reference becomes the policy as it is now (after the warm start); returns its kind."""
        return await self._all("reset_reference")

    async def score(self, samples: list[dict[str, Any]]) -> list[list[float]]:
        """The policy's logprob of every response token of each sample, in the order given (no update)."""
        from grpo.batch import shard

        self._require_started()
        parts = shard(samples, len(self.actors))
        results = await self._get(
            [a.score.remote([samples[i] for i in idx]) for a, idx in zip(self.actors, parts, strict=True)], "score"
        )
        out: list[list[float]] = [[] for _ in samples]
        for idx, rows in zip(parts, results, strict=True):
            for i, row in zip(idx, rows, strict=True):
                out[i] = row
        return out

    async def _split_call(self, method: str, samples: list[Any]) -> dict[str, float]:
        from grpo.batch import shard

        self._require_started()
        if not samples:
            raise ValueError(f"LearnerGroup.{method}: empty batch")
        parts = shard(samples, len(self.actors))
        refs = [getattr(a, method).remote([samples[i] for i in idx]) for a, idx in zip(self.actors, parts, strict=True)]
        return (await self._get(refs, method))[0]  # reduced over ranks inside the learners: rank 0's are everyone's

    # ------------------------------------------------------------------ export and checkpoints

    async def export_adapter_ref(self) -> Any:
        """ObjectRef of rank 0's adapter (one safetensors blob, see actors.adapter_io.pack_adapter), stored once."""
        self._require_started()
        refs = [a.export_adapter.remote() for a in self.actors]
        # The others return None; waiting surfaces their errors (rank 0's: when resolved). Rank 0 answers
        # the ping only after its export: a worker that died exporting is LearnerDied here, not a broken ref.
        await self._get([self.actors[0].__ray_ready__.remote(), *refs[1:]], "export_adapter")
        return refs[0]

    async def export_weights_refs(self, max_chunk_bytes: int = 256 << 20) -> list[Any]:
        """ObjectRefs of the weight chunks (full fine-tune; LoRA: merged with the adapter), each stored once,
        in order."""
        from ray.exceptions import RayActorError

        self._require_started()
        others = [a.export_weights.remote(max_chunk_bytes) for a in self.actors[1:]]
        stream = self.actors[0].iter_weights.options(num_returns="streaming").remote(max_chunk_bytes)
        refs = []
        try:
            async for ref in stream:  # each yielded chunk is its own object
                refs.append(ref)
        except RayActorError as e:
            raise self._died(0, "export_weights", e) from e
        last = refs[-1:]  # a failed generator surfaces here
        await self._get([*last, *others], "export_weights", ranks=[0] * len(last) + list(range(1, len(self.actors))))
        return refs

    async def save_adapter(self, folder: str) -> None:
        await self._all("save_adapter", folder)

    async def save_checkpoint(self, folder: str, extra: dict[str, Any]) -> None:
        await self._all("save_checkpoint", folder, extra)

    async def load_checkpoint(self, folder: str) -> dict[str, Any]:
        return await self._all("load_checkpoint", folder)

    async def _all(self, method: str, *args: Any) -> Any:
        self._require_started()
        return (await self._get([getattr(a, method).remote(*args) for a in self.actors], method))[0]

    async def _get(self, refs: list[Any], method: str, ranks: list[int] | None = None) -> list[Any]:
        """The values of `refs`, refs[i] from rank `ranks[i]` (default: i), raising LearnerDied as soon as one
        worker is found dead: the others may wait for it in a collective forever (they are not waited for)."""
        from ray.exceptions import RayActorError

        futures = [asyncio.ensure_future(r) for r in refs]  # ObjectRefs are awaitable
        rank_of = dict(zip(futures, ranks if ranks is not None else range(len(refs)), strict=True))
        pending = set(futures)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                errors = [f.exception() for f in done]
                for f, e in zip(done, errors, strict=True):
                    if isinstance(e, RayActorError):
                        raise self._died(rank_of[f], method, e) from e
                for e in errors:
                    if e is not None:
                        raise e
        finally:
            for f in pending:
                f.cancel()
        return [f.result() for f in futures]

    def _died(self, rank: int, method: str, error: BaseException) -> LearnerDied:
        name = actor_name(self.cfg.run_name, "learner", rank)
        return LearnerDied(f"learner worker {rank} ({name}) died during {method}: {type(error).__name__}", rank)

    def _require_started(self) -> None:
        if not self.actors:
            raise RuntimeError("LearnerGroup: await start() first")


def _rendezvous_address() -> tuple[str, int]:
    """This node's IP and a port free on it (for rank 0's TCPStore)."""
    import ray

    from cluster.ports import free_port

    return ray.util.get_node_ip_address(), free_port("")
