"""`jobs.train` on one GPU with the HF engine, and the figures of its GRPO steps.

    python -m bench.gpu_train [--config configs/gpu-1-hf.yaml] [--shape 1.7b] [--set KEY=VALUE ...]

What cluster/gpu_box.sh runs on a lent GPU machine once the wheelhouse (cluster/wheelhouse.py) is installed.
`--shape` builds random weights in one of bench.gpu's SHAPES with SmolLM2's tokenizer (from the `tiny-random`
build that the wheelhouse carries) and points `model.name` at them; without it the config's model is used.
The run is `python -m jobs.train --config C --run` in a process of its own; then its metrics.jsonl gives,
per GRPO step, the step time, the learner's tokens/s, the rollout's generated tokens/s and the weight push's
latency, and their medians over the steps after the first (which pays for warm-up). On a GPU whose bf16 peak
is known (`PEAK_BF16`), the learner's MFU: model FLOPs per token (4N for LoRA, whose frozen weights need no
weight gradients; 6N for full weights; N the model's parameters; attention's own FLOPs left out) times the
learner's tokens/s, over the peak. The learner counts each episode's tokens whole while it computes a group's
shared prompt once, so this MFU is the throughput's equivalent, not the FLOPs the GPU did.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.gpu import SHAPES, build_shape
from configs.loader import load_config
from jobs.tracking import METRICS_FILE
from jobs.train import run_location

ROOT = Path(__file__).resolve().parents[1]
# Dense bf16 tensor-core peaks from the vendor's data sheets (SXM parts), FLOP/s; matched by device name.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
# metrics.jsonl key → what the summary calls it
FIGURES = {
    "timing/step_s": "step s",
    "train/tokens_per_s": "learner tok/s",
    "rollout/tokens_per_s": "rollout tok/s",
    "sync/latency_s": "push s",
}


def step_rows(metrics: Path) -> list[dict[str, Any]]:
    """The GRPO steps' rows of a run's metrics.jsonl (each step's last row: a redone step replaces its first)."""
    rows: dict[int, dict[str, Any]] = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if "timing/step_s" in row:
            rows[int(row["step"])] = row
    return [rows[s] for s in sorted(rows)]


def summary(rows: list[dict[str, Any]], mfu: Callable[[float], str] | None = None) -> list[str]:
    """A table of `FIGURES` per step and their medians over the steps after the first; `mfu` turns the
    median learner tokens/s into the MFU line."""
    lines = ["step  " + "  ".join(f"{name:>14}" for name in FIGURES.values())]
    for row in rows:
        lines.append(f"{row['step']:>4}  " + "  ".join(f"{float(row.get(k, float('nan'))):>14.3f}" for k in FIGURES))
    later = rows[1:] or rows
    medians = [statistics.median(float(r.get(k, float("nan"))) for r in later) for k in FIGURES]
    span = f"(steps {later[0]['step']}-{later[-1]['step']})"
    lines.append("med   " + "  ".join(f"{m:>14.3f}" for m in medians) + "   " + span)
    lines.append(mfu(medians[1]) if mfu else "MFU: not computed (no GPU with a known peak)")
    return lines


def mfu_line(device: str, params: int, lora: bool) -> Callable[[float], str]:
    """The MFU line for a run on `device` (its name) of a model of `params` parameters."""
    peak = next((v for k, v in PEAK_BF16.items() if k in device), None)
    per_token = (4 if lora else 6) * params

    def line(tokens_per_s: float) -> str:
        if peak is None:
            return f"MFU: not computed ({device}: no known bf16 peak)"
        return (f"MFU {100 * per_token * tokens_per_s / peak:.2f}% on {device}: {per_token / 1e9:.1f} GFLOP per "
                f"token ({4 if lora else 6}N, N = {params / 1e6:.0f}M) x median learner tok/s / {peak / 1e12:.0f} "
                "TFLOP/s bf16 peak")  # fmt: skip

    return line


def _device_mfu(cfg: Any) -> Callable[[float], str] | None:
    """After the run: the GPU's name and the model's parameter count (built on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not torch.cuda.is_available():
        return None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model.name))
    params = sum(p.numel() for p in model.parameters())
    return mfu_line(torch.cuda.get_device_name(0), params, cfg.finetune.mode != "full")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "gpu-1-hf.yaml"), help="default: configs/gpu-1-hf.yaml")
    p.add_argument("--shape", choices=sorted(SHAPES), help="random weights in this shape (built once under --models)")
    p.add_argument("--models", type=Path, default=ROOT / ".cache" / "gpu-models", help="default: .cache/gpu-models")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for jobs.train (repeatable)")  # fmt: skip
    args = p.parse_args(argv)
    overrides = list(args.overrides)
    if args.shape:
        folder = args.models / args.shape
        if not (folder / "config.json").is_file():
            t0 = time.perf_counter()
            build_shape(args.shape, args.models)
            print(f"built random {args.shape} weights in {folder} ({time.perf_counter() - t0:.0f} s)", flush=True)
        overrides.append(f"model.name={folder.resolve()}")
    cfg = load_config(args.config, overrides)  # a bad key stops here, before Ray starts
    cmd = [sys.executable, "-m", "jobs.train", "--config", args.config, "--run"]
    for item in overrides:
        cmd += ["--set", item]
    t0 = time.perf_counter()
    code = subprocess.run(cmd, cwd=ROOT).returncode
    print(f"jobs.train exited {code} after {time.perf_counter() - t0:.0f} s", flush=True)
    metrics = Path(run_location(cfg)) / METRICS_FILE  # train.storage a local folder (a URI: download it first)
    if not metrics.is_file():
        print(f"no {metrics}", file=sys.stderr)
        return code or 1
    rows = step_rows(metrics)
    if not rows:
        print(f"no GRPO step in {metrics}", file=sys.stderr)
        return code or 1
    print("\n".join(summary(rows, _device_mfu(cfg))))
    return code


if __name__ == "__main__":
    sys.exit(main())
