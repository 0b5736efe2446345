"""Where a training run's figures go: a metrics file, W&B, Ray metrics, and the console.

`Tracker(cfg, run_dir)` is the one sink the driver talks to:

- `run_dir/metrics.jsonl`: one JSON line `{"step": s, key: value, ...}` per `log` call (every key the run logs is
  listed, with its meaning, in jobs/metric_names.py), flushed and
  fsynced before `log` returns, so a crash loses nothing already logged. This file is the run's
  record: `history()` reads it back and the end-of-run report (jobs/report.py) is drawn from it.
- W&B (`cfg.logging.wandb`): `auto` is online when WANDB_API_KEY is set and offline otherwise (a
  WANDB_MODE of offline/disabled set by the user wins); `online`/`offline` as named; `off` never
  imports wandb. The run lives in `run_dir/wandb/`, named `cfg.run_name`, with the config (secrets
  masked by `configs.loader.redact`). Its id is kept in `run_dir/wandb_id`, so `resume=True`
  continues the same W&B run. An online start that fails falls back to offline (with a warning):
  a tracking service must not stop training.
- Ray metrics (`cfg.logging.ray_metrics`, and only when Ray is up): the step figures that
  `cluster.metrics.STEP_FIGURES` defines (`rollout/episode_reward` → gauge
  `mcprl_rollout_episode_reward`), tagged `run=<run_name>`, set to the latest value: the Ray
  dashboard's Metrics view and cluster/grafana/mcprl.json plot them. NaN/inf are not exported.
- Console: `phase(name, total)` shows a tqdm bar on stderr when it is a terminal and records the
  phase's wall time; `summary_line(step, metrics)` is the one line per step; `write(line)` prints
  it without breaking open bars.

Resume: `Tracker(cfg, run_dir, resume=True, start_step=n)` drops the lines with step >= n from
metrics.jsonl (those steps will be played again), so history has each step once. W&B keeps its
own history: its server ignores a redone step at or below the last step it received (it warns), so
there the first attempt's figures stay for those steps; metrics.jsonl and the report have the redone ones.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import struct
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cluster.console import verbose
from cluster.metrics import record_step
from configs.loader import redact
from configs.schema import Config

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_id"
TABLES_DIR = "tables"


# --------------------------------------------------------------------------- helpers


def wandb_mode(setting: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """The wandb mode for `cfg.logging.wandb` ('online', 'offline'), or None for no W&B at all."""
    if setting == "off":
        return None
    if setting in ("online", "offline"):
        return setting
    if setting != "auto":
        raise ValueError(f"logging.wandb: expected auto, online, offline or off, got {setting!r}")
    user = environ.get("WANDB_MODE", "").strip().lower()
    if user in ("offline", "dryrun"):
        return "offline"
    if user == "disabled":
        return None
    return "online" if environ.get("WANDB_API_KEY") else "offline"


def merge_by_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records merged per step (several `log` calls make one step), sorted by step; on a repeated
    key the later record wins."""
    merged: dict[int, dict[str, Any]] = {}
    for i, rec in enumerate(records):
        if "step" not in rec:
            raise ValueError(f"history record {i} has no 'step': {sorted(rec)[:8]}")
        merged.setdefault(int(rec["step"]), {}).update(rec)
    return [merged[s] for s in sorted(merged)]


def _number(key: str, value: Any) -> int | float:
    """A metric value as a JSON number: bools and ints stay ints, anything with __float__ (numpy,
    0-d tensors) becomes a float; NaN/inf are kept (a NaN gradient norm must show)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"metric {key!r}: expected a number, got {type(value).__name__} {value!r:.80}") from None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file; a line cut short by a crash (the last one) is skipped with a warning."""
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                log.warning("%s: last line is incomplete (a crash while writing?); skipped", path)
                continue
            raise ValueError(f"{path}:{i + 1}: not a JSON line: {e}") from None
    return records


def wandb_offline_history(run_dir: Path) -> list[dict[str, Any]]:
    """The history rows of every offline W&B run under `run_dir/wandb/`, oldest run first, read from
    the runs' `.wandb` files (values JSON-decoded, `_step` as the step; a
    logged object such as a table appears as flat keys `name/_type`, `name/path`, ...).

    The format (wandb 0.31): a 7-byte header `:W&B` + 0xBEE1 + version, then LevelDB-log records
    (4-byte CRC, 2-byte length, 1-byte type: 1 full, 2 first, 3 middle, 4 last) in 32 KiB blocks,
    each a `wandb_internal_pb2.Record`.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    rows: list[dict[str, Any]] = []
    for path in sorted(Path(run_dir, "wandb").glob("offline-run-*/run-*.wandb")):
        data = path.read_bytes()
        if data[:4] != b":W&B":
            raise ValueError(f"{path}: not a W&B run file")
        pos, block, buf = 7, 32768, b""
        while pos + 7 <= len(data):
            left = block - pos % block
            if left < 7:  # block trailer: padding
                pos += left
                continue
            _crc, size, kind = struct.unpack("<IHB", data[pos : pos + 7])
            pos += 7
            if kind == 0 and size == 0:
                break
            buf += data[pos : pos + size]
            pos += size
            if kind in (1, 4):
                record = pb.Record()
                record.ParseFromString(buf)
                buf = b""
                if record.WhichOneof("record_type") == "history":
                    row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
                    rows.append(row)
    return rows


# --------------------------------------------------------------------------- console


class Phase:
    """What `Tracker.phase` yields: `update(n)` moves the bar; `elapsed_s` so far."""

    def __init__(self, name: str, bar: Any) -> None:
        self.name = name
        self.bar = bar
        self.count = 0
        self.start = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.count += n
        if self.bar is not None:
            self.bar.update(n)

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start


def _fmt(value: float, pct: bool = False) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if pct:
        return f"{100 * value:.1f}%"
    magnitude = abs(value)
    if magnitude and (magnitude < 1e-3 or magnitude >= 1e5):
        return f"{value:.2e}"
    return f"{value:.4g}"


# (label, key, shown as percent); tokens/s and time are formatted on their own below.
_SUMMARY = (
    ("reward", "rollout/episode_reward", False),
    ("success", "rollout/success_rate", True),  # final answer right
    ("kept", "rollout/groups_kept", True),  # GRPO groups the outcome filter kept
    ("tool ok", "rollout/tool_success_rate", True),
    ("kl", "train/kl", False),
    ("loss", "train/policy_loss", False),
    ("grad", "train/grad_norm", False),
    ("eval", "eval/validation/success_rate", True),  # the headline held-out set, on steps it was evaluated
)


# --------------------------------------------------------------------------- the tracker


class Tracker:
    """The run's metrics sink (see the module docstring). Use as a context manager or call `finish()`."""

    def __init__(self, cfg: Config, run_dir: Path, *, resume: bool = False, start_step: int | None = None) -> None:
        if start_step is not None and (not resume or isinstance(start_step, bool) or start_step < 0):
            raise ValueError(f"Tracker: start_step={start_step!r} needs resume=True and an int >= 0")
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.run_name = cfg.run_name
        self._pending: dict[str, float] = {}  # phase timings waiting for the next `log`
        self._depth = 0  # open phases (bar positions)
        self._finished = False
        self._failed_sinks: set[str] = set()
        self._start_file(resume, start_step)
        self._file = self.path.open("a", encoding="utf-8")
        self.wandb_run: Any = None
        mode = wandb_mode(cfg.logging.wandb)
        if mode is not None:
            self.wandb_run = self._start_wandb(mode, resume)

    # ------------------------------------------------------------------ setup

    def _start_file(self, resume: bool, start_step: int | None) -> None:
        if not resume:
            if self.path.exists() and self.path.stat().st_size:  # a new run in a used folder: keep the old figures
                stamp, n = time.strftime("%Y%m%d-%H%M%S"), 0
                while (old := self.path.with_name(f"metrics.{stamp}{f'-{n}' if n else ''}.jsonl")).exists():
                    n += 1
                self.path.rename(old)
                log.warning("%s existed and this is not a resume: moved it to %s", self.path, old.name)
            return
        # Rewritten even with nothing to drop: a line cut short by a crash must not get the next record glued on.
        records = _read_jsonl(self.path)
        kept = records if start_step is None else [r for r in records if int(r["step"]) < start_step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        os.replace(tmp, self.path)  # atomic: a crash now leaves the old or the new file, never half
        if len(kept) < len(records):
            log.info(
                "resume at step %s: dropped %d metric records of later steps", start_step, len(records) - len(kept)
            )

    def _start_wandb(self, mode: str, resume: bool) -> Any:
        import wandb

        id_file = self.run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else ""
        if not run_id:
            run_id = secrets.token_hex(6)  # W&B run ids: lowercase letters and digits
            id_file.write_text(run_id + "\n")
        kwargs = {
            "dir": str(self.run_dir),
            "project": self.cfg.logging.wandb_project,
            "name": self.run_name,
            "config": redact(self.cfg.model_dump(mode="json")),
            "id": run_id,
            "resume": "allow" if resume else None,
        }
        if not verbose():  # W&B's banner and tips (an advert among them) off; its warnings and errors stay
            wandb.setup(settings=wandb.Settings(show_info=False))
        try:
            run = wandb.init(mode=mode, **kwargs)
        except Exception as e:
            if mode != "online":
                raise
            log.warning("W&B online start failed (%s: %s); logging offline to %s", type(e).__name__, e, self.run_dir)
            mode, run = "offline", wandb.init(mode="offline", **kwargs)
        # What W&B's banner said that matters: where the run is.
        where = run.url if mode == "online" else f"offline; upload it with `wandb sync {Path(run.dir).parent}`"
        log.info("W&B: %s", where)
        return run

    # ------------------------------------------------------------------ logging

    def log(self, step: int, metrics: Mapping[str, Any], *, prefix: str = "") -> None:
        """Record `metrics` (keys prefixed with `prefix`, e.g. "rollout/") at `step`, with any phase
        timings recorded since the last call: metrics.jsonl (flushed, fsynced), W&B, Ray gauges."""
        if self._finished:
            raise RuntimeError("Tracker.log after finish()")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"Tracker.log: step must be an int >= 0, got {step!r}")
        record: dict[str, int | float] = {}
        for key, value in metrics.items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"Tracker.log: metric keys must be non-empty strings, got {key!r}")
            full = prefix + key
            if full == "step":
                raise ValueError("Tracker.log: 'step' is reserved for the step number")
            record[full] = _number(full, value)
        record = self._pending | record  # a timing the caller logs itself wins over the phase's
        self._pending = {}
        if not record:
            return
        self._file.write(json.dumps({"step": step, **record}) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        # The figures are on disk: a failing dashboard sink is reported, never allowed to stop training.
        if self.wandb_run is not None:
            self._guarded("W&B", lambda: self.wandb_run.log(record, step=step))
        self._guarded("Ray metrics", lambda: self._set_gauges(record))

    def _guarded(self, sink: str, send: Any) -> None:
        try:
            send()
        except Exception as e:
            if sink not in self._failed_sinks:  # once per sink, not once per step
                log.warning(
                    "%s logging failed (%s: %s); metrics.jsonl still has every figure", sink, type(e).__name__, e
                )
            self._failed_sinks.add(sink)

    def _set_gauges(self, record: Mapping[str, float]) -> None:
        if self.cfg.logging.ray_metrics:
            record_step(self.run_name, record)

    def log_table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        """Rows (same keys, e.g. from `actors.rollout_metrics.sample_rows`) as a W&B table `name`,
        and appended to run_dir/tables/<name>.jsonl with their step (kept when W&B is off)."""
        if not rows:
            return
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ValueError(f"log_table: table name {name!r} may use only letters, digits, _ . -")
        columns = list(rows[0])
        for i, row in enumerate(rows):
            if list(row) != columns:
                raise ValueError(f"log_table {name!r}: row {i} has keys {list(row)}, row 0 has {columns}")
        folder = self.run_dir / TABLES_DIR
        folder.mkdir(exist_ok=True)
        with (folder / f"{name}.jsonl").open("a", encoding="utf-8") as f:
            f.writelines(json.dumps({"step": step, **row}, default=str) + "\n" for row in rows)
        if self.wandb_run is not None:
            import wandb

            table = wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in rows])
            self.wandb_run.log({name: table}, step=step)

    def log_artifact(self, path: Path, name: str, type: str) -> None:
        """A folder or file (the adapter) as a W&B artifact `name` of `type`; nothing without W&B."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"log_artifact {name!r}: {path} does not exist")
        if self.wandb_run is None:
            log.debug("W&B off: artifact %s (%s) not uploaded", name, path)
            return
        import wandb

        artifact = wandb.Artifact(re.sub(r"[^A-Za-z0-9_.-]", "-", name), type=type)
        if path.is_dir():
            artifact.add_dir(str(path))
        else:
            artifact.add_file(str(path))
        self.wandb_run.log_artifact(artifact)

    def history(self) -> list[dict[str, Any]]:
        """Everything in metrics.jsonl (kept lines only after a resume), one dict per step, merged
        over that step's `log` calls, sorted by step."""
        if not self._file.closed:
            self._file.flush()
        return merge_by_step(_read_jsonl(self.path))

    # ------------------------------------------------------------------ console

    @contextmanager
    def phase(self, name: str, total: int | None = None, *, record: bool = True) -> Iterator[Phase]:
        """A progress bar for one phase (rollout, reward, train, sync, or the whole iteration) on
        stderr when it is a terminal; on exit its wall time is added to `timing/<name>_s`, logged
        with the next `log` call (`record=False` for an outer bar whose time is not a step figure)."""
        if not re.fullmatch(r"[A-Za-z0-9_]+", name):
            raise ValueError(f"phase name {name!r}: use letters, digits and _ (it becomes timing/{name}_s)")
        bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=total, desc=name, position=self._depth, leave=self._depth == 0, file=sys.stderr)
        ph = Phase(name, bar)
        self._depth += 1
        try:
            yield ph
        finally:
            self._depth -= 1
            if bar is not None:
                bar.close()
            if record:
                key = f"timing/{name}_s"
                self._pending[key] = self._pending.get(key, 0.0) + ph.elapsed_s

    @staticmethod
    def summary_line(step: int, metrics: Mapping[str, Any]) -> str:
        """One line for the console, from a step's merged metrics (full keys); absent figures are left out:

        `step 3 | reward 0.412 ±0.1 | success 25.0% | kept 75.0% | tool ok 90.0% | kl 0.0012 | loss -0.0123 |
        grad 0.84 | eval 50.0% | tok/s 310 train, 240 rollout | 12.3s`
        """
        parts = [f"step {step}"]
        for label, key, pct in _SUMMARY:
            if key not in metrics:
                continue
            text = f"{label} {_fmt(metrics[key], pct)}"
            if key == "rollout/episode_reward" and "rollout/episode_reward_std" in metrics:
                text += f" ±{_fmt(metrics['rollout/episode_reward_std'])}"
            parts.append(text)
        speeds = [
            f"{metrics[k]:.0f} {who}"
            for who, k in (("train", "train/tokens_per_s"), ("rollout", "rollout/tokens_per_s"))
            if k in metrics
        ]
        if speeds:
            parts.append("tok/s " + ", ".join(speeds))
        if "timing/step_s" in metrics:
            parts.append(f"{metrics['timing/step_s']:.1f}s")
        return " | ".join(parts)

    def write(self, line: str) -> None:
        """Print a line to stderr without breaking open progress bars."""
        from tqdm import tqdm

        tqdm.write(line, file=sys.stderr)

    # ------------------------------------------------------------------ end

    def finish(self, exit_code: int = 0) -> None:
        """Close the metrics file and the W&B run, waiting until W&B has written it (idempotent)."""
        if self._finished:
            return
        self._finished = True
        self._file.close()
        if self.wandb_run is not None:
            import wandb

            self.wandb_run.finish(exit_code=exit_code)
            # finish() can return before wandb's service has written the run file (measured: 2 of 8
            # offline runs held only the 7-byte header right after it); teardown waits for the
            # service, so the run folder is complete when we return (its atexit hook is not
            # reliable under multiprocessing, says its docstring).
            wandb.teardown(exit_code=exit_code)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.finish(exit_code=0 if exc_type is None else 1)


__all__ = ["Phase", "Tracker", "merge_by_step", "wandb_mode", "wandb_offline_history"]
