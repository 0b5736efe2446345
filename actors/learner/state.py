"""The learner's state I/O: the trained weights for the engines (the LoRA adapter, or whole weights in
chunks) and checkpoints (a mixin of `Learner`, actors/learner/__init__.py).

Checkpoints are folders: `state/` (torch.distributed.checkpoint: trained parameters + optimizer, any world
size), `rng-<rank>.pt`, `trainer.pt` (scheduler, counters), `meta.json` (mode, counters, the caller's
`extra`), and for LoRA `adapter/` (PEFT format). On a path they are written to a temporary folder and
renamed; at a storage URI (cluster/storage.py) every rank uploads its files, and meta.json goes last.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actors.adapter_io import pack_adapter, write_adapter
from actors.engine_api import merged_push_is_partial
from actors.learner.model import ADAPTER, is_trained_adapter, is_value_head

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_CKPT_FORMAT = 1


class CheckpointError(ValueError):
    """A folder that is not a (compatible) learner checkpoint."""


class StateIO:
    """Weight export and checkpoints; uses the attributes `Learner.__init__` sets and the other mixins."""

    def export_adapter(self) -> dict[str, Any] | None:
        """The trained LoRA adapter, whole, in the wire format: {"config": PEFT config dict (JSON-able),
        "safetensors": bytes of adapter_model.safetensors} (see actors/adapter_io.py).

        One blob rather than a dict of tensors: Ray pickles each tensor on its own (torch.save), which for
        a 240-tensor adapter costs more than the whole transfer. A collective: every rank must call it;
        rank 0 returns the adapter, the others None."""
        from peft import get_peft_model_state_dict

        self._require_setup()
        if not self.lora:
            raise ValueError("export_adapter: finetune.mode is 'full'; use export_weights")
        gathered = dict(self.backend.named_full_tensors(self.model, is_trained_adapter))
        if self.rank != 0:
            return None
        if self._export_keys is None or self._export_keys.keys() != gathered.keys():
            # PEFT's key mapping (~10 ms for 240 tensors) is the same every time: learn it once. It returns
            # the given tensors themselves, so identity maps each parameter to its PEFT key.
            state = get_peft_model_state_dict(self.model, state_dict=gathered, adapter_name=ADAPTER)
            by_id = {id(t): k for k, t in state.items()}
            keys = {name: by_id.get(id(t)) for name, t in gathered.items()}
            self._export_keys = keys if None not in keys.values() and len(keys) == len(state) else None
        else:
            state = {self._export_keys[name]: t for name, t in gathered.items()}
        return pack_adapter(self.model.peft_config[ADAPTER].to_dict(), state)

    def iter_weights(self, max_chunk_bytes: int = 256 << 20) -> Iterator[dict[str, torch.Tensor]]:
        """The model's weights under the base model's names, on CPU in `model.dtype`, in chunks of whole
        layers (a chunk exceeds `max_chunk_bytes` only when one layer does). Full mode: the trained weights.
        LoRA: the merged weights, W + scaling * B @ A for every LoRA-wrapped linear (computed in float32 on
        the side: the trained parameters stay as they are), with the other weights of their blocks as they are
        (`_adapted_blocks`: with the default q, k, v, o targets, a fifth of SmolLM2-135M's bytes); the adapters
        themselves are not sent. A collective: every rank must drain it; only rank 0 yields chunks."""
        import torch

        self._require_setup()
        if max_chunk_bytes < 1:
            raise ValueError(f"export_weights: max_chunk_bytes must be >= 1, got {max_chunk_bytes}")
        dtype = getattr(torch, self.cfg.model.dtype)
        # LoRA merges in float32 first; full weights are cast on the learner's device
        named = (
            self._named_merged()
            if self.lora
            else self.backend.named_full_tensors(self.model, lambda n: not is_value_head(n), dtype=dtype)
        )
        chunk: dict[str, torch.Tensor] = {}
        size = 0
        group: dict[str, torch.Tensor] = {}
        group_key = None
        for name, full in named:
            if full is None:
                continue
            key = _layer_of(name)
            if key != group_key and group:
                group_bytes = sum(t.numel() * t.element_size() for t in group.values())
                if chunk and size + group_bytes > max_chunk_bytes:
                    yield chunk
                    chunk, size = {}, 0
                chunk.update(group)
                size += group_bytes
                group = {}
            group_key = key
            group[name] = full.to(dtype)
        if group:
            group_bytes = sum(t.numel() * t.element_size() for t in group.values())
            if chunk and size + group_bytes > max_chunk_bytes:
                yield chunk
                chunk = {}
            chunk.update(group)
        if chunk:
            yield chunk

    def _named_merged(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """LoRA: (base model name, tensor) of the model with the trained adapter merged in; (name, None)
        on ranks other than 0. PEFT names map to the base's by dropping `base_model.model.` and
        `.base_layer`; a wrapped linear's weight is yielded once its lora_A and lora_B have arrived."""

        blocks = self._adapted_blocks()

        def keep(name: str) -> bool:  # the reference adapter, dropouts and a value head are not the policy
            if blocks and not name.startswith(blocks):
                return False
            return ("lora_" not in name or is_trained_adapter(name)) and not is_value_head(name)

        parts: dict[str, dict[str, torch.Tensor | None]] = {}  # wrapped module -> {"W", "A", "B"}
        named = self.backend.named_full_tensors(self.model, keep)
        if self.qlora:  # the 4-bit base weights, dequantized: the engines get the policy the learner trains
            from actors.qlora import dequantized

            named = dequantized(self.model, named)
        for name, full in named:
            if ".base_layer.weight" in name or "lora_" in name:
                module = name.split(".base_layer.")[0] if ".base_layer." in name else name.split(".lora_")[0]
                role = "W" if ".base_layer." in name else name.split(".lora_")[1][0]  # lora_A... -> "A"
                got = parts.setdefault(module, {})
                got[role] = full
                if len(got) < 3:
                    continue
                del parts[module]
                merged = None
                if self.rank == 0:
                    lora = self.model.get_submodule(module)
                    delta = got["B"].float() @ got["A"].float()
                    if getattr(lora, "fan_in_fan_out", False):
                        delta = delta.T
                    merged = got["W"].float() + lora.scaling[ADAPTER] * delta
                yield _base_name(f"{module}.weight"), merged
            else:
                yield _base_name(name), full
        if parts:
            raise RuntimeError(f"export_weights: LoRA modules without all of base, lora_A, lora_B: {sorted(parts)[:3]}")

    def _adapted_blocks(self) -> tuple[str, ...]:
        """LoRA: the name prefixes of the blocks (an attention or MLP module) that hold a LoRA-wrapped linear,
        the only weights a merge can change; the engines keep every other weight as they loaded it from the
        model's files. Whole blocks, not just the wrapped linears: an engine that packs q, k and v (or gate
        and up) into one matrix reloads it only from all its parts. QLoRA: () (everything): its engines must
        get the learner's dequantized 4-bit base, not the base they loaded."""
        if not merged_push_is_partial(self.cfg):
            return ()
        wrapped = (name for name, module in self.model.named_modules() if hasattr(module, "lora_A"))
        return tuple(sorted({name.rsplit(".", 1)[0] + "." for name in wrapped}))

    def export_weights(self, max_chunk_bytes: int = 256 << 20) -> list[dict[str, torch.Tensor]] | None:
        """`iter_weights` as a list on rank 0 (None elsewhere). A collective."""
        chunks = list(self.iter_weights(max_chunk_bytes))
        return chunks if self.rank == 0 else None

    def save_adapter(self, folder: str) -> None:
        """The adapter in PEFT format (adapter_config.json + adapter_model.safetensors) at `folder`, a
        path or a storage URI; rank 0 writes."""
        from cluster import storage

        adapter = self.export_adapter()
        if adapter is not None:
            with storage.staged(folder) as local:
                write_adapter(local, adapter)

    def save_checkpoint(self, folder: str, extra: dict[str, Any]) -> None:
        """Everything `load_checkpoint` needs to continue bit for bit, at `folder` (a path or a storage
        URI). Complete or absent: a path gets a tmp folder renamed into place; a URI gets every rank's
        files uploaded from a node-local folder, then meta.json, which `latest_checkpoint` looks for."""
        import torch

        from cluster import storage

        self._require_setup()
        try:
            extra_json = json.dumps(extra)
        except TypeError as e:
            raise ValueError(f"save_checkpoint: extra must be JSON-serialisable: {e}") from e
        remote = storage.is_uri(folder)
        if remote:
            final = None
            tmp = Path(tempfile.gettempdir()) / f"mcprl-ckpt-{os.getpid()}-{self.rank}-{self.step}"
        else:
            final = Path(folder).absolute()
            tmp = final.parent / f".{final.name}.tmp-{self.step}"
        if self.rank == 0 or remote:  # remote: every rank has its own node-local folder
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that died
            tmp.mkdir(parents=True)
        self._barrier()
        self.backend.save(str(tmp / "state"), self.model, self.optimizer, self._state_keep)
        if self.ref_kind in ("model", "offloaded_model") and self.cfg.learner.reference != "fixed":
            self.backend.save(str(tmp / "reference"), self.reference, None, lambda k: True)
        torch.save(_rng_state(), tmp / f"rng-{self.rank}.pt")
        adapter = self.export_adapter() if self.lora else None
        if self.rank == 0:
            if adapter is not None:
                write_adapter(tmp / "adapter", adapter)
            torch.save({"scheduler": self.scheduler.state_dict()}, tmp / "trainer.pt")
            meta = {
                "format": _CKPT_FORMAT,
                "mode": self.cfg.finetune.mode,
                "model": self.cfg.model.name,
                "world_size": self.world_size,
                "step": self.step,
                "iteration": self.iteration,
                "reference": self.ref_kind,
                "extra": json.loads(extra_json),
            }
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        self._barrier()
        if remote:
            try:
                storage.upload(tmp, folder, skip=("meta.json",))
                self._barrier()  # every rank's shards are up before meta.json says the checkpoint is whole
                if self.rank == 0:
                    storage.upload(tmp / "meta.json", storage.join(folder, "meta.json"))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            self._barrier()
            return
        if self.rank == 0:
            old = None
            if final.exists():  # rename cannot replace a folder: move the old one aside first
                old = final.rename(final.parent / f".{final.name}.old-{self.step}")
            tmp.rename(final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        self._barrier()

    def load_checkpoint(self, folder: str) -> dict[str, Any]:
        """Restore model, optimizer, schedule, counters and RNG from `save_checkpoint` (a path or a
        storage URI); returns its `extra`."""
        from cluster import storage

        self._require_setup()
        if storage.is_uri(folder):  # each rank reads its own node-local copy
            with tempfile.TemporaryDirectory(prefix="mcprl-ckpt-") as tmp:
                if not storage.exists(storage.join(folder, "meta.json")):
                    raise CheckpointError(f"checkpoint {folder!r} has no meta.json: absent or incomplete")
                return self._load_checkpoint(storage.download(folder, Path(tmp) / "ckpt"), label=folder)
        return self._load_checkpoint(Path(folder), label=folder)

    def _load_checkpoint(self, path: Path, label: str) -> dict[str, Any]:
        import torch

        meta_file = path / "meta.json"
        if not path.is_dir():
            raise CheckpointError(f"checkpoint {label!r} does not exist (or is not a folder)")
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint {label!r} has no readable meta.json: not a learner checkpoint") from e
        if meta.get("format") != _CKPT_FORMAT:
            raise CheckpointError(f"checkpoint {label!r}: format {meta.get('format')!r}, expected {_CKPT_FORMAT}")
        if meta.get("mode") != self.cfg.finetune.mode:
            raise CheckpointError(
                f"checkpoint {label!r} holds a {meta.get('mode')!r} model, but finetune.mode is "
                f"{self.cfg.finetune.mode!r}"
            )
        for needed in ("state", "trainer.pt"):
            if not (path / needed).exists():
                raise CheckpointError(f"checkpoint {label!r} is incomplete: {needed} is missing")
        try:
            self.backend.load(str(path / "state"), self.model, self.optimizer, self._state_keep)
            if (path / "reference").exists() and self.ref_kind in ("model", "offloaded_model"):
                self.backend.load(str(path / "reference"), self.reference, None, lambda k: True)
        except Exception as e:  # DCP's errors name tensors, not the cause
            raise CheckpointError(f"checkpoint {label!r} does not fit this model/config: {e}") from e
        trainer = torch.load(path / "trainer.pt", weights_only=False)
        self.scheduler.load_state_dict(trainer["scheduler"])
        self.step = int(meta["step"])
        self.iteration = int(meta["iteration"])
        rng = path / f"rng-{self.rank}.pt"
        if rng.exists():
            _set_rng_state(torch.load(rng, weights_only=False))
        else:
            log.warning("checkpoint %s: no RNG state for rank %d (world size %s)", label, self.rank, meta["world_size"])
        return meta["extra"]

    def _state_keep(self, key: str) -> bool:
        """Checkpointed model entries: LoRA → the adapters (and PPO's value head) only (the base is the
        model's own files)."""
        return "lora_" in key or is_value_head(key) if self.lora else True


def _base_name(name: str) -> str:
    """PEFT's parameter name -> the base model's: `base_model.model.model.layers.0.q_proj.base_layer.weight`
    -> `model.layers.0.q_proj.weight`."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def _layer_of(name: str) -> str:
    """`model.layers.3.mlp.up_proj.weight` → `model.layers.3`; names outside a layer are their own group."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return ".".join(parts[: i + 2])
    return name


def _rng_state() -> dict[str, Any]:
    import torch

    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
