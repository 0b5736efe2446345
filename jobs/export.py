"""Get a trained model out of a run: a Hugging Face folder that transformers, PEFT and vLLM load unchanged.

    python -m jobs.export --run RUN [--merge] [--out FOLDER] [--checkpoint step_N] [--force]

RUN is a run folder (`runs/ci-tiny`, `s3://bucket/runs/x`) or a run name under `--storage` (default
`train.storage`'s default, `runs`). What is written, from the run's config.json (jobs/train.py writes it):
- a LoRA run: its adapter as a PEFT folder (adapter_config.json + adapter_model.safetensors), with the
  tokenizer and chat template beside it. The base is found as adapter_config.json's
  `base_model_name_or_path` says: an HF id stays an HF id; any other base (a built-in such as tiny-random
  or smollm2-135m-instruct, which the Hub does not have, a local or stored folder) is copied into `base/`
  and named by its absolute path (by `base` when --out is a URI). mcprl_export.json says the same.
- `--merge` (LoRA only): base + adapter merged into plain weights, a model folder.
- a QLoRA run (`finetune.mode: qlora`): the adapter trained over the base quantized to NF4, so the policy is
  that adapter over the 4-bit base. `--merge` merges it into the dequantized 4-bit base (as the learner's
  merged push does); the adapter folder's mcprl_export.json says how to load the base in 4 bit.
- a full fine-tune: its trained weights (the checkpoint's `state/`: a torch.distributed.checkpoint of
  the float32 master weights, or with `learner.backend: deepspeed` a ZeRO checkpoint, consolidated from
  its partitions) as a model folder. A PPO run's value head is left out: it is not part of the policy.
Weights are saved in `model.dtype`. The adapter is `final_adapter/` unless `--checkpoint step_N` names
a checkpoint (its `adapter/`); a full run's weights come from the newest checkpoint, or the named one.
The chat template is the model's own, taught to render `tools=` as training showed them
(envs/chat_template.py), so an OpenAI server's tool definitions reach the model in its trained form; a
request with tools and no system message gets the one the run's training tasks (`data.train`, read where
the config names it) opened with. mcprl_export.json holds it as `system_prompt` (null: the tasks were not
found, and a client must send its system message itself).

The folder is written aside and renamed into place (uploaded, for a URI): a failed export leaves nothing.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster import storage

if TYPE_CHECKING:
    from configs.schema import Config

log = logging.getLogger("mcprl.export")

EXPORT_INFO = "mcprl_export.json"
BASE_DIR = "base"


class ExportError(ValueError):
    """An export that cannot be made; the message names the run, checkpoint or option at fault."""


@dataclass
class RunSource:
    """What an export reads: the run's location, its config, and where the trained weights are."""

    run: str
    cfg: Config
    weights: str  # a PEFT adapter folder (LoRA) or a checkpoint's DCP `state/` folder (full)
    origin: str  # what `weights` is, for messages and mcprl_export.json: final_adapter | checkpoints/step_N


def find_run(run: str, storage_root: str = "runs") -> str:
    """The run's location: RUN itself when it holds config.json, else <storage_root>/RUN."""
    candidates = [storage.resolve(run)]
    if not storage.is_uri(run) and "/" not in run.strip("/"):
        candidates.append(storage.join(storage.resolve(storage_root), run))
    for where in candidates:
        if storage.exists(storage.join(where, "config.json")):
            return where
    tried = " or ".join(repr(c) for c in dict.fromkeys(candidates))
    raise ExportError(f"no such run: {run!r} (no config.json at {tried}; a run folder is <train.storage>/<run_name>)")


def load_source(run: str, checkpoint: str = "", storage_root: str = "runs") -> RunSource:
    """The run's config and its trained weights (see the module doc for which)."""
    from configs.schema import Config

    location = find_run(run, storage_root)
    try:
        cfg = Config.model_validate(json.loads(storage.read_text(storage.join(location, "config.json"))))
    except ValueError as e:
        raise ExportError(f"run {location!r}: config.json is not a valid mcprl config: {e}") from e
    lora = cfg.finetune.trains_adapter  # lora and qlora
    if checkpoint:
        name = checkpoint.rstrip("/").rsplit("/", 1)[-1]
        ckpt = storage.join(location, "checkpoints", name)
        if not storage.exists(storage.join(ckpt, "meta.json")):
            have = [n for n in storage.list_names(storage.join(location, "checkpoints")) if n.startswith("step_")]
            raise ExportError(
                f"run {location!r} has no complete checkpoint {name!r} (checkpoints: {', '.join(have) or 'none'})"
            )
        weights = storage.join(ckpt, "adapter" if lora else "state")
        if not storage.exists(weights):
            raise ExportError(f"checkpoint {ckpt!r} holds no {'adapter/' if lora else 'state/'}")
        return RunSource(location, cfg, weights, f"checkpoints/{name}")
    if lora:
        final = storage.join(location, "final_adapter")
        if storage.exists(storage.join(final, "adapter_config.json")):
            return RunSource(location, cfg, final, "final_adapter")
    from jobs.train import latest_checkpoint

    ckpt = latest_checkpoint(location)
    if ckpt is None:
        what = "no final_adapter/ and no checkpoint" if lora else "no checkpoint"
        raise ExportError(f"run {location!r} has {what} to export (did it train? it may still be running)")
    name = storage.name(ckpt)
    weights = storage.join(ckpt, "adapter" if lora else "state")
    if not storage.exists(weights):
        raise ExportError(f"checkpoint {ckpt!r} holds no {'adapter/' if lora else 'state/'}")
    if lora:
        log.warning("run %s has no final_adapter/: exporting the adapter of its newest checkpoint, %s", location, name)
    return RunSource(location, cfg, weights, f"checkpoints/{name}")


def default_out(src: RunSource, merge: bool) -> str:
    """<run>/export (a LoRA adapter or a full run's model) or <run>/export-merged."""
    return storage.join(src.run, "export-merged" if merge else "export")


def export(
    run: str,
    out: str = "",
    *,
    merge: bool = False,
    checkpoint: str = "",
    force: bool = False,
    storage_root: str = "runs",
    progress: Any = print,
) -> str:
    """Write the export (see the module doc) and return where it is. `progress(line)` hears each phase."""
    src = load_source(run, checkpoint, storage_root)
    lora = src.cfg.finetune.trains_adapter  # lora and qlora
    if merge and not lora:
        raise ExportError(
            f"--merge: run {src.run!r} is a full fine-tune (finetune.mode full): its weights are already a "
            f"plain model; export it without --merge"
        )
    out = storage.resolve(out) if out else default_out(src, merge)
    if storage.exists(out):
        if not force:
            raise ExportError(f"--out {out!r} already exists: choose another folder, or add --force to replace it")
    kind = "merged" if merge else "lora_adapter" if lora else "full"
    progress(f"export: {kind} from {src.run} ({src.origin}) to {out}")
    remote = storage.is_uri(out)
    parent = Path(tempfile.gettempdir()) if remote else Path(out).parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{storage.name(out)}.tmp-", dir=parent))
    try:
        info = _write(src, tmp, kind, final=out, progress=progress)
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=1) + "\n")
        _readable(tmp)
        if remote:
            progress(f"export: uploading to {out}")
            if storage.exists(out):
                storage.delete(out)
            storage.upload(tmp, out)
        else:
            final = Path(out)
            if final.exists():  # --force: the old one goes only once the new one is complete
                storage.delete(str(final))
            tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(f"export: done: {out}")
    return out


def _readable(folder: Path) -> None:
    """Every folder 0755 and file 0644: mkdtemp's 0700 and the 0600 of files written through a temporary file
    (safetensors' model.safetensors) would keep a shared export from its readers."""
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _write(src: RunSource, folder: Path, kind: str, final: str, progress: Any) -> dict[str, Any]:
    """The export's files into `folder`; returns mcprl_export.json's content."""
    import torch

    from actors.models import load_tokenizer, no_load_bar, resolve_model
    from envs.chat_template import served_chat_template, training_system_prompt
    from tasks.io import TaskFileError, read_rows

    cfg = src.cfg
    info: dict[str, Any] = {
        "kind": kind,
        "run": src.run,
        "source": src.origin,
        "model": cfg.model.name,
        "dtype": cfg.model.dtype,
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    progress(f"export: base model {cfg.model.name!r}")
    base_folder = resolve_model(cfg.model.name, cfg.model.cache_dir)
    tokenizer = load_tokenizer(cfg.model)
    try:
        info["system_prompt"] = training_system_prompt(read_rows(cfg.data.train)) if cfg.data.train else None
    except TaskFileError as e:
        info["system_prompt"] = None
        progress(f"export: no training tasks ({e}): a request with tools= must send its own system message")
    tokenizer.chat_template = served_chat_template(tokenizer, cfg.env, info["system_prompt"])
    dtype = getattr(torch, cfg.model.dtype)

    if kind == "lora_adapter":
        from actors.adapter_io import CONFIG_FILE, read_adapter, write_adapter

        progress(f"export: adapter from {src.origin}")
        adapter = read_adapter(src.weights)
        if _is_hf_id(cfg.model.name, base_folder):
            base_ref = cfg.model.name
            info["base"] = f"the Hugging Face model {base_ref!r} (downloaded by transformers/vLLM as usual)"
        else:
            progress(f"export: copying the base model into {BASE_DIR}/ (not on the Hub: the export carries it)")
            _copy_model(base_folder, folder / BASE_DIR)
            tokenizer.save_pretrained(folder / BASE_DIR)
            base_ref = BASE_DIR if storage.is_uri(final) else str(Path(final).absolute() / BASE_DIR)
            info["base"] = (
                f"{BASE_DIR}/ in this folder ({cfg.model.name!r} as the run trained on it); adapter_config.json "
                f"names it by {'relative' if storage.is_uri(final) else 'absolute'} path: if you move the folder, "
                f"load {BASE_DIR}/ with AutoModelForCausalLM, then PeftModel.from_pretrained(model, this folder)"
            )
        config = dict(adapter["config"])
        config["base_model_name_or_path"] = base_ref
        config["inference_mode"] = True
        write_adapter(folder, {"config": config, "state_dict": adapter["state_dict"]})
        info["base_model_name_or_path"] = base_ref
        info["adapter_config"] = CONFIG_FILE
        if cfg.finetune.mode == "qlora":
            info["quantization"] = QLORA_BASE_NOTE
            progress(f"export: note: {QLORA_BASE_NOTE}")
        tokenizer.save_pretrained(folder)
        return info

    from transformers import AutoModelForCausalLM

    # its own progress lines say what it does: transformers' load and save bars off (unless -v)
    with no_load_bar():
        progress("export: loading the base weights")
        model = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32, local_files_only=True)
        if kind == "merged" and cfg.finetune.mode == "qlora":
            progress("export: the base as the QLoRA run trained over it: quantized to NF4, dequantized")
            _load_nf4_base(model, cfg)
        if kind == "merged":
            from peft import PeftModel

            from actors.adapter_io import read_adapter, write_adapter

            progress(f"export: merging the adapter from {src.origin}")
            with tempfile.TemporaryDirectory(prefix="mcprl-adapter-") as tmp:
                # read_adapter fetches a stored adapter; PEFT wants a plain folder
                write_adapter(Path(tmp), read_adapter(src.weights))
                model = PeftModel.from_pretrained(model, tmp).merge_and_unload()
        else:
            progress(f"export: loading the trained weights from {src.origin}/state")
            _load_full_state(model, src.weights)
        model.to(dtype)
        for key in ("_name_or_path", "_model_name_or_path"):  # where it was loaded here: meaningless elsewhere
            if hasattr(model.config, key):
                delattr(model.config, key)
        progress(f"export: saving the model ({cfg.model.dtype}, safetensors)")
        model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return info


QLORA_BASE_NOTE = (
    "trained over the base quantized to 4 bit: load it with BitsAndBytesConfig(load_in_4bit=True, "
    "bnb_4bit_quant_type='nf4', bnb_4bit_use_double_quant=True) for the trained policy (over the full-precision "
    "base the adapter drifts from it), or export with --merge"
)


def _load_nf4_base(model: Any, cfg: Any) -> None:
    """Replace `model`'s weights by the NF4 round trip the QLoRA learner trained over (actors/qlora.py)."""
    from actors.qlora import dequantized, load_4bit_causal_lm

    quantized = load_4bit_causal_lm(cfg.model, cfg.learner.dtype)
    dense = {name: t.float() for name, t in dequantized(quantized, quantized.named_parameters())}
    unexpected = model.load_state_dict(dense, strict=False).unexpected_keys
    if unexpected:
        raise ExportError(f"the 4-bit base of {cfg.model.name!r} has weights the model lacks: {unexpected[:5]}")


def _load_full_state(model: Any, state: str) -> None:
    """A full run's trained weights from a checkpoint's `state/`, any world size, without a process group: a
    DCP checkpoint (FSDP2 or one rank, saved by actors/sharding/ as {"model": ..., "optim": ...}) or a
    DeepSpeed ZeRO checkpoint (its partitions consolidated)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from actors.sharding import DEEPSPEED_TAG

    local = storage.fetch(state)
    if (Path(local) / DEEPSPEED_TAG).is_dir():
        return _load_deepspeed_state(model, Path(local))
    template = {"model": get_model_state_dict(model)}  # the keys and shapes the learner saved
    with warnings.catch_warnings():  # "assuming ... a single process": exactly the intent
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        try:
            dcp.load(template, checkpoint_id=str(local))
        except Exception as e:  # DCP names tensors, not the cause
            raise ExportError(
                f"{state!r}: the checkpoint's weights do not fit model {type(model).__name__}: {e}"
            ) from e
    set_model_state_dict(model, template["model"])


def _load_deepspeed_state(model: Any, state: Path) -> None:
    """The float32 weights of a ZeRO-2/3 checkpoint, gathered from every rank's partition files."""
    from actors.sharding import DEEPSPEED_TAG

    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as e:
        raise ExportError(f"{state} is a DeepSpeed checkpoint: reading it needs deepspeed (extra `deepspeed`)") from e
    weights = get_fp32_state_dict_from_zero_checkpoint(str(state), tag=DEEPSPEED_TAG)
    weights = {k: v for k, v in weights.items() if not k.startswith("value_head.")}  # PPO's, not the policy's
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight") and model.config.tie_word_embeddings}
    if set(missing) - tied or unexpected:
        raise ExportError(
            f"{state}: the DeepSpeed checkpoint does not fit model {type(model).__name__}: missing "
            f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )


def _is_hf_id(name: str, folder: Path) -> bool:
    """The base is a Hub model (its id is enough to load it elsewhere), not a built-in or a folder."""
    from actors.models import BUILTIN_MODELS

    if name in BUILTIN_MODELS or storage.is_uri(name) or Path(name).expanduser().is_dir():
        return False
    return "huggingface" in str(folder) or "/models--" in str(folder)


def _copy_model(src: Path, dest: Path) -> None:
    """A model folder's files that loading needs (not our build marker)."""
    dest.mkdir(parents=True)
    for file in sorted(src.iterdir()):
        if file.is_file() and file.name != "mcprl_build.json" and not file.name.endswith(".lock"):
            shutil.copy2(file, dest / file.name)


def main(argv: list[str] | None = None) -> None:
    import argparse

    from actors.models import ModelNotFoundError
    from cluster.console import quiet_third_party
    from jobs.cli import usage_error

    p = argparse.ArgumentParser(prog="python -m jobs.export", description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="a run folder (runs/ci-tiny, s3://...) or a run name under --storage")
    p.add_argument("--storage", default="runs", help="where run names are looked up (train.storage; default runs)")
    p.add_argument("--merge", action="store_true", help="LoRA: write base + adapter merged, as plain weights")
    p.add_argument("--out", default="", help="the folder (or URI) to write; default <run>/export[-merged]")
    p.add_argument("--checkpoint", default="", help="step_N: export this checkpoint instead of the final weights")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    args = p.parse_args(argv)
    quiet_third_party()  # MCPRL_VERBOSE=1 leaves the libraries' output as it is
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        export(
            args.run,
            args.out,
            merge=args.merge,
            checkpoint=args.checkpoint,
            force=args.force,
            storage_root=args.storage,
            progress=lambda line: print(line, flush=True),
        )
    except (ExportError, storage.StorageError) as e:
        usage_error(str(e))
    except ModelNotFoundError as e:  # the run's base model is not on this machine
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except FileNotFoundError as e:  # a run folder with a broken adapter
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
