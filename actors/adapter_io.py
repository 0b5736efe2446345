"""The LoRA adapter's wire format and its PEFT folder.

An adapter travels (learner → object store → engines) in one of two forms, both dicts:
- {"config": PEFT config as plain JSON values, "safetensors": the bytes of adapter_model.safetensors}:
  what the learner exports (`pack_adapter`). One blob rather than a dict of tensors: Ray pickles each
  tensor on its own, which for a 240-tensor adapter costs more than the whole transfer.
- {"config": ..., "state_dict": {PEFT key: tensor}}: what `read_adapter` gives for a folder.
`adapter_state_dict` and `adapter_safetensors` read either; `write_adapter` writes either as a PEFT folder
(adapter_config.json + adapter_model.safetensors), which vLLM, PEFT and `read_adapter` load.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def json_able(value: Any) -> Any:
    """PEFT config dicts hold enums and sets: plain JSON values instead."""
    import enum

    if isinstance(value, dict):
        return {str(k): json_able(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_able(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted(json_able(v) for v in value)
    if isinstance(value, enum.Enum):
        return value.value
    return value


def pack_adapter(config: dict[str, Any], state_dict: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The adapter wire format: {"config": `config` as plain JSON values, "safetensors": the bytes of
    `state_dict` as a PEFT adapter_model.safetensors file (CPU, contiguous, metadata format=pt)}."""
    from safetensors.torch import save

    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    return {"config": json_able(dict(config)), "safetensors": save(tensors, metadata={"format": "pt"})}


def _adapter_form(adapter: Any) -> str:
    """'safetensors' or 'state_dict': which of the two adapter forms `adapter` is; ValueError otherwise."""
    forms = [k for k in ("safetensors", "state_dict") if isinstance(adapter, dict) and k in adapter]
    if not isinstance(adapter, dict) or "config" not in adapter or len(forms) != 1:
        keys = sorted(adapter) if isinstance(adapter, dict) else type(adapter).__name__
        raise ValueError(
            f"adapter: expected a dict with 'config' and one of 'safetensors' (bytes) or 'state_dict' "
            f"({{PEFT key: tensor}}), got {keys}"
        )
    payload = adapter[forms[0]]
    if forms[0] == "safetensors" and not isinstance(payload, bytes | bytearray | memoryview):
        raise ValueError(f"adapter: 'safetensors' must be bytes, got {type(payload).__name__}")
    if forms[0] == "state_dict" and not isinstance(payload, dict):
        raise ValueError(f"adapter: 'state_dict' must be a dict of tensors, got {type(payload).__name__}")
    return forms[0]


def adapter_state_dict(adapter: dict[str, Any], copy: bool = True) -> dict[str, torch.Tensor]:
    """{PEFT key: CPU tensor} of an adapter in either form ({"config", "safetensors"} or {"config",
    "state_dict"}); ValueError naming what is wrong for anything else (or a blob that does not parse).

    `copy=False`: the blob's tensors are read-only views of its bytes (no copy; never write to them),
    for a caller that copies them somewhere at once (the HF engine's adapter slots)."""
    if _adapter_form(adapter) == "state_dict":
        return adapter["state_dict"]
    blob = adapter_safetensors(adapter)
    if not copy:
        views = _safetensors_views(blob)
        if views is not None:
            return views
    from safetensors.torch import load

    try:
        return load(bytes(blob))
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"adapter: 'safetensors' is not a safetensors file: {e}") from e


def _safetensors_views(blob: bytes | bytearray | memoryview) -> dict[str, torch.Tensor] | None:
    """Zero-copy tensors over a safetensors blob (header: {name: {dtype, shape, data_offsets}} after an
    8-byte length; data after the header); None when a dtype is not a plain one (then: copy with safetensors)."""
    import warnings

    import torch

    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
    size = int.from_bytes(bytes(blob[:8]), "little")
    header = json.loads(bytes(blob[8 : 8 + size]))
    start = 8 + size
    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": these views are only read
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = dtypes.get(info.get("dtype"))
            if dtype is None:
                return None
            lo, hi = info["data_offsets"]
            numel = math.prod(info["shape"])
            if hi - lo != numel * dtype.itemsize or start + hi > len(blob):
                raise ValueError(f"adapter: 'safetensors' entry {name!r} does not fit its offsets {lo}..{hi}")
            flat = torch.frombuffer(blob, dtype=dtype, count=numel, offset=start + lo) if numel else torch.empty(0)
            out[name] = flat.view(info["shape"])
    return out


def adapter_safetensors(adapter: dict[str, Any]) -> bytes | bytearray | memoryview:
    """The adapter_model.safetensors bytes of an adapter in either form (the blob as is: no copy; its
    header is checked, so a blob that is not a safetensors file is a ValueError here, not in a reader)."""
    if _adapter_form(adapter) == "state_dict":
        return pack_adapter(adapter["config"], adapter["state_dict"])["safetensors"]
    blob = adapter["safetensors"]
    # The format: 8 bytes little-endian header length, then a JSON object header, then the data.
    size = int.from_bytes(bytes(blob[:8]), "little") if len(blob) >= 8 else -1
    try:
        header = json.loads(bytes(blob[8 : 8 + size])) if 0 < size <= len(blob) - 8 else None
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise ValueError(f"adapter: 'safetensors' is not a safetensors file ({len(blob)} bytes, no valid header)")
    return blob


def write_adapter(folder: Path, adapter: dict[str, Any]) -> None:
    """`adapter` (either form) as a PEFT folder: adapter_config.json + adapter_model.safetensors (a
    {"config", "safetensors"} adapter's blob written as it is). Each file is written to a temporary name
    and renamed, so a reader never sees half a file; ValueError for an adapter that is not one."""
    blob = adapter_safetensors(adapter)  # checked before anything is written
    config = json.dumps(json_able(dict(adapter["config"])), indent=1) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".tmp", delete=False) as f:
        f.write(blob)
        tmp_weights = Path(f.name)
    tmp_weights.rename(folder / WEIGHTS_FILE)
    config_tmp = folder / f"{CONFIG_FILE}.tmp"
    config_tmp.write_text(config)
    config_tmp.rename(folder / CONFIG_FILE)


def read_adapter(folder: str | Path) -> dict[str, Any]:
    """A PEFT adapter folder (a path or a storage URI, downloaded once) as the engines take it:
    {"config": ..., "state_dict": ...}. FileNotFoundError when it is not one."""
    from safetensors.torch import load_file

    from cluster import storage

    local = storage.fetch(str(folder))
    if not local.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder")
    config_file, weights = local / CONFIG_FILE, local / WEIGHTS_FILE
    if not config_file.is_file() or not weights.is_file():
        raise FileNotFoundError(f"{local}: not a PEFT adapter folder ({CONFIG_FILE}, {WEIGHTS_FILE})")
    return {"config": json.loads(config_file.read_text()), "state_dict": load_file(str(weights))}
