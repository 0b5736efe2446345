"""Tracker: the metrics file and its history, resume, W&B offline (never online), the console line.
(Its Ray metrics are read back from Prometheus in tests/cluster/test_metrics.py.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from configs.schema import Config, HttpConfig, LoggingConfig, ToolsConfig
from jobs.tracking import Tracker, wandb_mode, wandb_offline_history


def config(wandb: str = "off", ray_metrics: bool = False, run_name: str = "unit") -> Config:
    return Config(run_name=run_name, logging=LoggingConfig(wandb=wandb, ray_metrics=ray_metrics))


@pytest.fixture
def offline_env(monkeypatch):
    """No key and offline mode: nothing in these tests can reach W&B's servers."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_file_and_history(tmp_path):
    with Tracker(config(), tmp_path) as tr:
        assert tr.wandb_run is None
        with tr.phase("rollout", total=2) as ph:
            ph.update()
            ph.update()
        assert ph.count == 2
        tr.log(0, {"episode_reward": 0.5, "success_rate": 0.25}, prefix="rollout/")
        tr.log(0, {"kl": 0.01, "grad_norm": float("nan"), "steps": 3, "ok": True}, prefix="train/")
        tr.log(1, {"rollout/episode_reward": 0.75})
        # each log call is on disk before it returns
        written = lines(tmp_path / "metrics.jsonl")
        assert len(written) == 3 and written[0]["step"] == 0
        assert written[0]["rollout/episode_reward"] == 0.5
        assert written[0]["timing/rollout_s"] >= 0.0  # the phase's time went with the next log call
        assert "timing/rollout_s" not in written[1]
        hist = tr.history()
    assert [h["step"] for h in hist] == [0, 1]
    assert hist[0]["rollout/success_rate"] == 0.25 and hist[0]["train/kl"] == 0.01
    assert math.isnan(hist[0]["train/grad_norm"]) and hist[0]["train/steps"] == 3 and hist[0]["train/ok"] == 1
    assert hist[1] == {"step": 1, "rollout/episode_reward": 0.75}
    assert tr.history() == hist  # readable after finish too


def test_bad_input_is_refused(tmp_path):
    with Tracker(config(), tmp_path) as tr:
        with pytest.raises(TypeError, match="'rollout/x'"):
            tr.log(0, {"x": "high"}, prefix="rollout/")
        with pytest.raises(ValueError, match="step must be"):
            tr.log(-1, {"x": 1.0})
        with pytest.raises(ValueError, match="reserved"):
            tr.log(0, {"step": 1.0})
        with pytest.raises(ValueError, match="phase name"):
            with tr.phase("roll/out"):
                pass
        with pytest.raises(ValueError, match="row 1"):
            tr.log_table(0, "samples", [{"a": 1}, {"b": 2}])
        with pytest.raises(FileNotFoundError):
            tr.log_artifact(tmp_path / "nope", "adapter", "model")
    with pytest.raises(ValueError, match="start_step"):
        Tracker(config(), tmp_path, start_step=2)


def test_resume_drops_redone_steps(tmp_path):
    with Tracker(config(), tmp_path) as tr:
        for s in range(5):
            tr.log(s, {"x": float(s)})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "x": 5')  # a crash mid-write: the cut line is skipped
    with Tracker(config(), tmp_path, resume=True, start_step=3) as tr:
        assert [h["step"] for h in tr.history()] == [0, 1, 2]
        tr.log(3, {"x": 30.0})
        tr.log(4, {"x": 40.0})
        hist = tr.history()
    assert [(h["step"], h["x"]) for h in hist] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    # resume with no step given keeps everything, and a cut last line does not swallow the next record
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "x"')
    with Tracker(config(), tmp_path, resume=True) as tr:
        tr.log(5, {"x": 50.0})
        assert [h["step"] for h in tr.history()] == [0, 1, 2, 3, 4, 5]
    # a fresh (non-resume) run in the same folder starts empty and keeps the old file aside, twice
    for _ in range(2):
        with Tracker(config(), tmp_path) as tr:
            tr.log(0, {"x": 1.0})
    assert len(list(tmp_path.glob("metrics.*.jsonl"))) == 2
    with Tracker(config(), tmp_path, resume=True) as tr:
        assert [h["step"] for h in tr.history()] == [0]


def test_summary_line():
    line = Tracker.summary_line(
        7,
        {
            "rollout/episode_reward": 0.4123,
            "rollout/episode_reward_std": 0.1,
            "rollout/success_rate": 0.25,
            "rollout/groups_kept": 0.75,
            "train/kl": 0.00123,
            "train/policy_loss": -0.0123,
            "train/grad_norm": 0.84,
            "train/tokens_per_s": 310.2,
            "rollout/tokens_per_s": 240.0,
            "timing/step_s": 12.34,
            "eval/validation/success_rate": 0.5,
            "eval/transfer/success_rate": 0.125,  # not the headline: left out of the line
        },
    )
    for piece in ("step 7", "reward 0.4123 ±0.1", "success 25.0% | kept 75.0%", "kl 0.00123", "loss -0.0123"):
        assert piece in line, (piece, line)
    assert "grad 0.84 | eval 50.0% | tok/s" in line and "12.5%" not in line
    assert "tok/s 310 train, 240 rollout" in line and line.endswith("12.3s")
    assert Tracker.summary_line(1, {"train/kl": 2e-6}) == "step 1 | kl 2.00e-06"


def test_wandb_mode_choice():
    assert wandb_mode("off", {"WANDB_API_KEY": "k"}) is None
    assert wandb_mode("auto", {}) == "offline"
    assert wandb_mode("auto", {"WANDB_API_KEY": "k"}) == "online"
    assert wandb_mode("auto", {"WANDB_API_KEY": "k", "WANDB_MODE": "offline"}) == "offline"
    assert wandb_mode("auto", {"WANDB_MODE": "disabled"}) is None
    assert wandb_mode("offline", {"WANDB_API_KEY": "k"}) == "offline"


def test_wandb_offline_run(tmp_path, offline_env):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    cfg = config(wandb="auto", run_name="wb-unit")
    cfg.tools = ToolsConfig(http=HttpConfig(bearer_token_env="MY_TOKEN"))
    run_dir = tmp_path / "run"
    with Tracker(cfg, run_dir) as tr:
        assert tr.wandb_run is not None and tr.wandb_run.offline
        assert tr.wandb_run.config["tools"]["http"]["bearer_token_env"] == "***"  # the redacted config
        tr.log(0, {"episode_reward": 0.5, "tool_success_rate": 0.9}, prefix="rollout/")
        tr.log(0, {"kl": 0.01}, prefix="train/")
        tr.log(1, {"rollout/episode_reward": 0.7})
        tr.log_table(1, "samples", [{"task_id": "t1", "reward": 1.0, "conversation": "user: hi"}])
        tr.log_artifact(adapter, "adapter wb-unit", "model")
        run_id = tr.wandb_run.id
    assert (run_dir / "wandb_id").read_text().strip() == run_id
    assert len(list(run_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))) == 1
    rows = wandb_offline_history(run_dir)
    by_step = {r["_step"]: r for r in rows}
    assert by_step[0]["rollout/episode_reward"] == 0.5 and by_step[0]["train/kl"] == 0.01
    assert by_step[0]["rollout/tool_success_rate"] == 0.9
    assert by_step[1]["rollout/episode_reward"] == 0.7 and by_step[1]["samples/_type"] == "table-file"
    assert list(run_dir.glob("wandb/offline-run-*/files/media/table/samples_1_*.table.json"))
    assert json.loads((run_dir / "tables" / "samples.jsonl").read_text())["task_id"] == "t1"

    # resume: the same W&B run id, and the redone step appears in the new offline folder
    with Tracker(cfg, run_dir, resume=True, start_step=1) as tr:
        assert tr.wandb_run.id == run_id
        tr.log(1, {"rollout/episode_reward": 0.8})
    assert [h["step"] for h in lines(run_dir / "metrics.jsonl")] == [0, 0, 1]
    assert wandb_offline_history(run_dir)[-1]["rollout/episode_reward"] == 0.8
