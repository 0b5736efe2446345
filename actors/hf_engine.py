"""The HF transformers rollout engine: our own batched decoding loop, LoRA versions as PEFT adapters.

Why not `model.generate`: the chosen token's logprob must come from the very forward pass that
sampled it, and requests with different sampling knobs must share one batch.

- Continuous batching: concurrent `generate` calls wait up to `hf_batch_wait_ms` for company and
  run together (at most `hf_max_batch_size`), left-padded, with a KV cache. Requests arriving while a
  batch runs join it between two decode steps (prefilled on their own, then their KV cache stacked onto
  the batch's, left-padded to one width), and a finished request leaves at once: a multi-turn episode's
  next turn need not wait for the slowest request of the batch before it. A batch holds one version;
  while `update_weights` waits, no request joins, so the batch drains.
- Logprobs: `log_softmax` of the raw logits (before temperature, top-p and repetition penalty),
  in float32: what the learner computes for the same tokens.
- Sampling knobs per row: temperature (0 = greedy), top-p, repetition penalty (HF's rule), and a
  per-request `torch.Generator` when a seed is given (same seed and prompt -> same tokens when the
  batch composition is the same).
- Stop strings are looked for in the decoded text of the new tokens; the token that completes one
  is kept, so the stop string stays in the output. EOS ends a request too (and is kept).
- LoRA: adapters live in slots, PEFT adapters `slot<k>` created once and reused (building PEFT's
  modules in every layer costs ~10x copying the weights). Version 0 (and the version after a
  full-weight update) is the base model. A request pins the version that was current when it
  arrived; a batch holds one version, passed to PEFT per forward as `adapter_names` (its slot), so
  loading a new adapter between two decode steps never changes a running request. A new version is
  copied in place into a slot that holds neither the current version nor one a request pins; a new
  slot is made only when every slot is taken (or none has the new adapter's config). Adapters come
  in either form of actors/adapter_io.py (`{"config", "safetensors"}` or `{"config", "state_dict"}`).
- Full weights (`update_weights`): waits for the running batch to finish (so every token of a
  request comes from one version), then copies chunk by chunk into the parameters in place.

The model runs in a worker thread (the event loop stays free); a threading lock makes each decode
step and each adapter change atomic with respect to one another.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import threading
import time
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from actors.engine_api import EngineError, EngineUnavailable, Generation, check_request
from configs.schema import Config, SamplingConfig

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_BASE = "__base__"  # PEFT's name for "no adapter" in a mixed `adapter_names` forward


def slot_name(index: int) -> str:
    """PEFT's adapter name of slot `index` (no dots: PEFT keys put it between two dots)."""
    return f"slot{index}"


@dataclass
class _Slot:
    """One PEFT adapter reused across versions: `version` is what it holds (None: free)."""

    name: str
    config: dict[str, Any]  # the adapter config it was built with (minus inference_mode)
    params: dict[str, torch.Tensor]  # PEFT state-dict key (no adapter name) -> its parameter
    version: int | None = None


@dataclass
class _Request:
    prompt: list[int]
    sampling: SamplingConfig
    version: int
    future: asyncio.Future[Generation]
    arrived: float = field(default_factory=time.monotonic)


@dataclass
class _Row:
    """A request in a running batch: its sampling state and what it generated so far."""

    req: _Request
    gen: torch.Generator | None
    seen: set[int]  # for the repetition penalty
    stop_window: int  # tokens whose text may hold a stop string
    started: float  # when its prefill began
    batch: int  # the most rows it shared a batch with
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    first_token_s: float = 0.0
    finish: str | None = None


@dataclass
class _Running:
    """A batch in flight: its rows, their KV cache and attention mask [n, width] (left padding 0), each row's
    position and sampled token to feed next."""

    rows: list[_Row]
    cache: Any
    mask: torch.Tensor
    positions: torch.Tensor  # [n, 1]
    next_ids: torch.Tensor  # [n]
    adapter: str  # PEFT adapter name of the batch's version

    def pop_finished(self) -> list[_Row]:
        """Drop finished rows from the batch (cache, mask and inputs too) and the left padding no row needs."""
        done = [row for row in self.rows if row.finish is not None]
        if not done:
            return []
        keep = [i for i, row in enumerate(self.rows) if row.finish is None]
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            return done
        import torch

        index = torch.tensor(keep, device=self.mask.device)
        self.mask, self.positions, self.next_ids = self.mask[index], self.positions[index], self.next_ids[index]
        self.cache.batch_select_indices(index)
        cut = int(self.mask.any(0).int().argmax())  # columns of padding in every row
        if cut:
            self.mask = self.mask[:, cut:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, cut:], layer.values[:, :, cut:]
        return done


class HFEngine:
    """`RolloutEngine` on transformers (+PEFT), CPU or CUDA."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self._rollout = cfg.rollout
        self._model: Any = None  # the PeftModel once an adapter is loaded, else the HF model
        self._tokenizer: Any = None
        self._device: torch.device | None = None
        self._eos: set[int] = set()
        self._pad_id = 0
        self._version = 0
        self._pinned: collections.Counter[int] = collections.Counter()  # version -> live requests
        self._slots: list[_Slot] = []
        self._slot_of: dict[int, _Slot] = {}  # version -> the slot holding it (current or pinned)
        self._adapter_lock: asyncio.Lock | None = None  # one load_adapter at a time
        self._pending: list[_Request] = []
        self._work: asyncio.Event | None = None
        self._batch_turn: asyncio.Lock | None = None  # held by a running batch; update_weights waits on it
        self._updates_waiting = 0  # update_weights calls waiting for the running batch: no request joins it
        self._model_lock = threading.Lock()  # one decode step or one adapter change at a time
        self._scheduler: asyncio.Task[None] | None = None
        self._closed = False
        self._stats: collections.Counter[str] = collections.Counter()
        self.load_s = 0.0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        import torch

        from actors.models import load_causal_lm, load_tokenizer
        from actors.precision import for_device

        t0 = time.monotonic()
        self._device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.cfg = for_device(self.cfg, self._device)  # float32 on a CPU without bf16 kernels
        self._tokenizer = await asyncio.to_thread(load_tokenizer, self.cfg.model)
        self._model = await asyncio.to_thread(load_causal_lm, self.cfg.model, self._device)
        self._model.requires_grad_(False)
        eos = self._model.generation_config.eos_token_id
        self._eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self._tokenizer.eos_token_id is not None:
            self._eos.add(self._tokenizer.eos_token_id)
        pad = self._tokenizer.pad_token_id
        self._pad_id = pad if pad is not None else min(self._eos, default=0)
        self._work = asyncio.Event()
        self._batch_turn = asyncio.Lock()
        self._adapter_lock = asyncio.Lock()
        self._scheduler = asyncio.create_task(self._schedule(), name="hf-engine-scheduler")
        self.load_s = time.monotonic() - t0
        log.info("HF engine: %s on %s in %.1f s", self.cfg.model.name, self._device, self.load_s)

    async def shutdown(self) -> None:
        self._closed = True
        if self._scheduler is not None:
            self._scheduler.cancel()
            try:
                await self._scheduler
            except asyncio.CancelledError:
                pass
        for req in self._pending:
            if not req.future.done():
                req.future.set_exception(EngineUnavailable("engine shut down"))
        self._pending.clear()
        self._model = None

    # ------------------------------------------------------------------ requests

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingConfig) -> Generation:
        if self._work is None or self._closed:
            raise EngineUnavailable("engine is not started (or shut down)")
        self._validate(prompt_token_ids, sampling)
        req = _Request(list(prompt_token_ids), sampling, self._version, asyncio.get_running_loop().create_future())
        self._pinned[req.version] += 1
        self._pending.append(req)
        self._work.set()
        try:
            return await req.future
        finally:
            self._pinned[req.version] -= 1
            await self._collect_adapters()

    def _validate(self, prompt: list[int], sampling: SamplingConfig) -> None:
        vocab = self._model.get_input_embeddings().num_embeddings
        check_request(prompt, sampling, self._rollout.max_model_len, vocab)

    async def _schedule(self) -> None:
        assert self._work is not None and self._batch_turn is not None
        while True:
            await self._work.wait()
            if len(self._pending) < self._rollout.hf_max_batch_size and self._rollout.hf_batch_wait_ms > 0:
                await asyncio.sleep(self._rollout.hf_batch_wait_ms / 1000)  # let company arrive
            async with self._batch_turn:
                first = self._admissible(None, self._rollout.hf_max_batch_size)
                if not first:
                    continue
                version = first[0].version
                # The batch pins its version too: callers that go away must not free its slot mid-batch.
                self._pinned[version] += 1
                running: _Running | None = None
                try:
                    running = await asyncio.to_thread(self._prefill, first)
                    while True:
                        self._resolve(running.pop_finished())
                        room = self._rollout.hf_max_batch_size - len(running.rows)
                        joining = self._admissible(version, room) if not self._updates_waiting else []
                        if joining:  # continuous batching: new requests join between two decode steps
                            running = await asyncio.to_thread(self._join, running, joining)
                            self._resolve(running.pop_finished())
                        if not running.rows:
                            break
                        await asyncio.to_thread(self._step, running)
                except Exception as e:  # a failed batch fails its requests, not the engine
                    log.exception("HF engine: a batch failed")
                    rows = running.rows if running is not None else []
                    for r in [*first, *(row.req for row in rows)]:
                        if not r.future.done():
                            r.future.set_exception(EngineUnavailable(f"generation failed: {e!r}"))
                finally:
                    self._pinned[version] -= 1

    def _admissible(self, version: int | None, room: int) -> list[_Request]:
        """Up to `room` queued requests of `version` (None: the oldest request's), oldest first, taken off the
        queue; cancelled callers are dropped. A batch holds one version."""
        assert self._work is not None
        self._pending = [r for r in self._pending if not r.future.done()]
        if version is None and self._pending:
            version = self._pending[0].version
        chosen = [r for r in self._pending if r.version == version][: max(room, 0)]
        taken = {id(r) for r in chosen}
        self._pending = [r for r in self._pending if id(r) not in taken]
        if not self._pending:
            self._work.clear()
        return chosen

    def _resolve(self, rows: list[_Row]) -> None:
        """Finished rows' results to their callers (on the event loop: futures are not thread-safe)."""
        now = time.monotonic()
        for row in rows:
            r = row.req
            self._stats["requests"] += 1
            self._stats["tokens"] += len(row.token_ids)
            if not r.future.done():
                timings = {
                    "queue_s": row.started - r.arrived,
                    "first_token_s": row.first_token_s,
                    "generate_s": now - row.started,
                    "batch": row.batch,
                }
                r.future.set_result(
                    Generation(row.token_ids, row.logprobs, row.finish or "abort", r.version, timings=timings)
                )

    # ------------------------------------------------------------------ the decoding loop

    def _prefill(self, requests: list[_Request]) -> _Running:
        """A batch of new requests: their prompts left-padded through one forward with a fresh KV cache, and
        each row's first token sampled."""
        import torch

        t0 = time.monotonic()
        dev = self._device
        n = len(requests)
        width = max(len(r.prompt) for r in requests)
        ids = torch.full((n, width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        # Explicit positions: with left padding each row's first real token is position 0.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        rows = [
            _Row(
                req=r,
                gen=self._generator(r.sampling.seed),
                seen=set(r.prompt),
                stop_window=max((len(st) for st in r.sampling.stop), default=0) + 2,  # tokens are >= 1 char
                started=t0,
                batch=n,
            )
            for r in requests
        ]
        slot = self._slot_of.get(requests[0].version)  # fixed while the batch pins its version
        running = _Running(rows, None, mask, positions[:, -1:], ids[:, -1], slot.name if slot is not None else _BASE)
        self._forward(running, ids, positions)
        self._stats["batches"] += 1
        return running

    def _step(self, running: _Running) -> None:
        """One decode step of every row: its last sampled token in, its next token sampled."""
        import torch

        running.mask = torch.cat([running.mask, torch.ones_like(running.mask[:, :1])], dim=1)
        running.positions = running.positions + 1
        self._forward(running, running.next_ids[:, None], running.positions)

    def _forward(self, running: _Running, step_input: torch.Tensor, positions: torch.Tensor) -> None:
        """One forward of `step_input` (prompts, or each row's last token) through the batch's KV cache, then
        each unfinished row's next token sampled."""
        import torch

        with self._model_lock, torch.inference_mode():
            out = self._model(
                input_ids=step_input,
                attention_mask=running.mask,
                position_ids=positions,
                past_key_values=running.cache,
                use_cache=True,
                logits_to_keep=1,
                # Per step: a first adapter load wraps the model in PEFT between two steps.
                **({"adapter_names": [running.adapter] * len(running.rows)} if self._is_peft() else {}),
            )
        running.cache = out.past_key_values
        logits = out.logits[:, -1, :].float()
        logprobs = torch.log_softmax(logits, dim=-1)  # before any sampling transform: the learner's view
        next_ids = torch.full((len(running.rows),), self._pad_id, dtype=torch.long)
        now = time.monotonic()
        for i, row in enumerate(running.rows):
            r = row.req
            if row.finish is not None:
                continue
            if r.future.done():  # the caller went away
                row.finish = "abort"
                continue
            tok = self._sample(logits[i], r.sampling, row.seen, row.gen)
            next_ids[i] = tok
            row.token_ids.append(tok)
            row.logprobs.append(float(logprobs[i, tok]))
            row.seen.add(tok)
            if not row.first_token_s:
                row.first_token_s = now - row.started
            if tok in self._eos:
                row.finish = "stop"
            elif r.sampling.stop and self._hit_stop(row.token_ids[-row.stop_window :], r.sampling.stop):
                row.finish = "stop"
            elif len(row.token_ids) >= r.sampling.max_new_tokens:
                row.finish = "length"
        running.next_ids = next_ids.to(running.mask.device)

    def _join(self, running: _Running, requests: list[_Request]) -> _Running:
        """The running batch with `requests` prefilled and added: both KV caches left-padded to one width and
        stacked (padding is masked out, and each row keeps its own positions). A cache this engine cannot
        stack (sliding-window or quantized layers) refuses; the requests then wait for the next batch."""
        import torch
        import torch.nn.functional as F

        joining = self._prefill(requests)
        self._stats["batches"] -= 1  # not a batch of its own
        self._stats["joined"] += len(requests)
        if not running.rows:
            return joining
        a, b = running.mask.shape[1], joining.mask.shape[1]
        width = max(a, b)
        layers = list(zip(running.cache.layers, joining.cache.layers, strict=True))
        if any(type(x).__name__ != "DynamicLayer" or type(y).__name__ != "DynamicLayer" for x, y in layers):
            raise EngineError(f"HF engine: cannot join requests to a {type(layers[0][0]).__name__} cache")
        for x, y in layers:
            x.keys = torch.cat([F.pad(x.keys, (0, 0, width - a, 0)), F.pad(y.keys, (0, 0, width - b, 0))])
            x.values = torch.cat([F.pad(x.values, (0, 0, width - a, 0)), F.pad(y.values, (0, 0, width - b, 0))])
        running.mask = torch.cat([F.pad(running.mask, (width - a, 0)), F.pad(joining.mask, (width - b, 0))])
        running.positions = torch.cat([running.positions, joining.positions])
        running.next_ids = torch.cat([running.next_ids, joining.next_ids])
        running.rows += joining.rows
        for row in running.rows:
            row.batch = max(row.batch, len(running.rows))
        return running

    def _generator(self, seed: int | None) -> torch.Generator | None:
        import torch

        if seed is None:
            return None  # torch's global RNG
        g = torch.Generator(device=self._device)
        g.manual_seed(seed)
        return g

    @staticmethod
    def _sample(logits: torch.Tensor, s: SamplingConfig, seen: set[int], gen: torch.Generator | None) -> int:
        import torch

        if s.repetition_penalty != 1.0 and seen:
            idx = torch.tensor(sorted(seen), device=logits.device)
            picked = logits[idx]
            logits = logits.clone()
            logits[idx] = torch.where(picked > 0, picked / s.repetition_penalty, picked * s.repetition_penalty)
        if s.temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / s.temperature, dim=-1)
        if s.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = (sorted_p.cumsum(0) - sorted_p) < s.top_p  # the nucleus; always keeps the top token
            sorted_p = sorted_p * keep
            choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)
            return int(order[choice])
        return int(torch.multinomial(probs, 1, generator=gen))

    def _hit_stop(self, tail: list[int], stops: list[str]) -> bool:
        text = self._tokenizer.decode(tail, skip_special_tokens=False)
        return any(s and s in text for s in stops)

    def _is_peft(self) -> bool:
        return hasattr(self._model, "peft_config")

    # ------------------------------------------------------------------ LoRA versions

    async def load_adapter(self, version: int, adapter: dict[str, Any]) -> None:
        from actors.adapter_io import adapter_state_dict, json_able

        assert self._adapter_lock is not None
        async with self._adapter_lock:
            if version <= self._version:
                raise EngineError(f"adapter version {version} is not newer than the current version {self._version}")
            try:
                # Plain JSON values: a PEFT to_dict() (sets, enums) and its JSON form are the same config.
                config = {k: v for k, v in json_able(dict(adapter["config"])).items() if k != "inference_mode"}
                tensors = adapter_state_dict(adapter, copy=False)  # views of the blob: copied into a slot below
            except (ValueError, TypeError, KeyError) as e:
                raise EngineError(f"adapter v{version}: {e}") from e
            slot = self._free_slot(config)
            if slot is not None:
                slot.version = version  # reserved: neither current nor pinned, so nothing else picks it
            try:
                slot = await asyncio.to_thread(self._fill_slot, slot, version, config, tensors)
            except BaseException:
                if slot is not None:
                    slot.version = None
                raise
            slot.version = version  # a new slot is taken from here on
            self._slot_of[version] = slot
            self._version = version  # new requests get it from now on
            self._stats["adapters_loaded"] += 1
        await self._collect_adapters()

    def _in_use(self, slot: _Slot) -> bool:
        v = slot.version
        return v is not None and (v == self._version or self._pinned[v] > 0 or v not in self._slot_of)

    def _free_slot(self, config: dict[str, Any]) -> _Slot | None:
        """A slot with this config that no request needs (current, pinned, or being filled); None: grow."""
        return next((s for s in self._slots if s.config == config and not self._in_use(s)), None)

    def _fill_slot(
        self, slot: _Slot | None, version: int, config: dict[str, Any], tensors: dict[str, torch.Tensor]
    ) -> _Slot:
        """Copy `tensors` into `slot` in place, or into a new slot (None). Runs in a worker thread."""
        import torch

        if slot is None:
            slot = self._new_slot(config)
        missing = sorted(slot.params.keys() - tensors.keys())
        unexpected = sorted(tensors.keys() - slot.params.keys())
        if missing or unexpected:
            raise EngineError(
                f"adapter v{version} does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
        bad = [(k, tuple(t.shape)) for k, t in tensors.items() if tuple(t.shape) != tuple(slot.params[k].shape)]
        if bad:
            k, shape = bad[0]
            raise EngineError(
                f"adapter v{version}: {k} has shape {shape}, expected {tuple(slot.params[k].shape)} "
                f"({len(bad)} tensor(s) differ)"
            )
        with self._model_lock, torch.no_grad():
            for k, t in tensors.items():
                slot.params[k].copy_(t)  # in place; converts dtype and device
        return slot

    def _new_slot(self, config: dict[str, Any]) -> _Slot:
        """Build PEFT modules for a new slot (the expensive part, done once per slot)."""
        from peft import PeftConfig, PeftModel

        try:
            peft_config = PeftConfig.from_peft_type(**config)
        except Exception as e:
            raise EngineError(f"adapter config is not a PEFT config: {e}") from e
        peft_config.inference_mode = True
        name = slot_name(len(self._slots))
        with self._model_lock:
            try:
                if not self._is_peft():
                    self._model = PeftModel(self._model, peft_config, adapter_name=name)
                else:
                    self._model.add_adapter(name, peft_config)
            except ValueError as e:  # e.g. target modules the model does not have
                raise EngineError(f"adapter does not fit the model: {e}") from e
            self._model.requires_grad_(False)
            self._model.to(self._device).eval()  # PEFT refuses adapter_names in training mode
            params = {}
            for key, p in self._model.named_parameters():
                parts = key.split(".")
                if name in parts:  # PEFT's state-dict key: the parameter's name without the adapter's
                    params[".".join(x for x in parts if x != name)] = p
        slot = _Slot(name, config, params)
        self._slots.append(slot)
        return slot

    async def _collect_adapters(self) -> None:
        """Release versions that are neither current nor pinned: their slots become free for reuse."""
        stale = [v for v in self._slot_of if v != self._version and self._pinned[v] <= 0]
        for v in stale:
            slot = self._slot_of.pop(v)
            self._pinned.pop(v, None)
            if slot.version == v:
                slot.version = None
        self._stats["adapters_deleted"] += len(stale)

    # ------------------------------------------------------------------ full weights

    async def update_weights(
        self, version: int, chunks: Iterable[dict[str, Any]] | AsyncIterable[dict[str, Any]]
    ) -> None:
        """Copy {name: tensor} chunks into the parameters in place (one chunk in memory at a time).

        Names are the base model's (`model.layers.0.self_attn.q_proj.weight`). Waits for the running
        batch; requests queued meanwhile run on the new weights."""
        assert self._batch_turn is not None
        t0 = time.monotonic()
        self._updates_waiting += 1
        try:
            await self._batch_turn.acquire()
        finally:
            self._updates_waiting -= 1
        try:
            params = self._param_index()
            copied = 0
            if isinstance(chunks, AsyncIterable):
                async for chunk in chunks:
                    copied += await asyncio.to_thread(self._copy_chunk, params, chunk)
            else:
                for chunk in chunks:
                    if inspect.isawaitable(chunk):
                        chunk = await chunk
                    copied += await asyncio.to_thread(self._copy_chunk, params, chunk)
            self._version = version
            # Queued requests were pinned to the old version, but they run on the new weights.
            for r in self._pending:
                self._pinned[r.version] -= 1
                r.version = version
                self._pinned[version] += 1
        finally:
            self._batch_turn.release()
        self._stats["weight_updates"] += 1
        await self._collect_adapters()  # new requests run without an adapter now (as on vLLM)
        log.info("HF engine: weights v%d (%d tensors) in %.2f s", version, copied, time.monotonic() - t0)

    def _param_index(self) -> dict[str, torch.Tensor]:
        base = self._model.get_base_model() if self._is_peft() else self._model
        index: dict[str, torch.Tensor] = {}
        for name, tensor in base.state_dict(keep_vars=True).items():
            index[name] = tensor
            if ".base_layer." in name:  # PEFT-wrapped layers: accept the plain name too
                index.setdefault(name.replace(".base_layer.", "."), tensor)
        return index

    def _copy_chunk(self, params: dict[str, torch.Tensor], chunk: dict[str, Any]) -> int:
        import torch

        unknown = [k for k in chunk if k not in params]
        if unknown:
            raise EngineError(f"update_weights: unknown parameter names {unknown[:5]}")
        with self._model_lock, torch.no_grad():
            for name, value in chunk.items():
                target = params[name]
                if tuple(target.shape) != tuple(value.shape):
                    raise EngineError(
                        f"update_weights: {name} has shape {tuple(value.shape)}, expected {tuple(target.shape)}"
                    )
                target.copy_(value)  # in place: no second copy of the model
        return len(chunk)

    # ------------------------------------------------------------------ introspection

    def version(self) -> int:
        return self._version

    def stats(self) -> dict[str, Any]:
        batches = self._stats["batches"]
        return {
            "backend": "hf",
            "device": str(self._device),
            "version": self._version,
            "adapters_loaded_now": sorted(self._slot_of),
            "adapter_slots": len(self._slots),
            "pending": len(self._pending),
            "mean_batch_size": self._stats["requests"] / batches if batches else 0.0,
            "load_s": self.load_s,
            **dict(self._stats),
        }
