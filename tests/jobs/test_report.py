"""write_report: summary.md with the evaluation table, PNG plots (and a note for a missing metric), the adapter."""

from __future__ import annotations

from pathlib import Path

from configs.schema import Config, LoggingConfig
from jobs.report import write_report
from jobs.tracking import Tracker

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

EVALS = {
    "base": {"success_rate": 0.0, "mean_reward": -0.1, "turns": 4.0, "episodes": 16, "tool_error_rates": {}},
    "after warm start": {
        "success_rate": 0.25,
        "mean_reward": 0.3,
        "turns": 3.5,
        "episodes": 16,
        "tool_error_rates": {"polygon.get_quote": 0.5, "slack.post": 0.125},
    },
    "after GRPO": {"success_rate": 0.5, "mean_reward": 0.8, "turns": 2.25, "episodes": 16},
}


def history_without_kl(tmp_path: Path) -> list[dict]:
    """Three steps logged through a real Tracker, as the driver logs them, but no train/kl."""
    with Tracker(Config(logging=LoggingConfig(wandb="off", ray_metrics=False)), tmp_path) as tr:
        for s in range(3):
            tr.log(s, {"episode_reward": 0.1 * s, "success_rate": 0.2 * s, "tokens_per_s": 240.0}, prefix="rollout/")
            tr.log(s, {"policy_loss": -0.01 * s, "grad_norm": 0.5, "tokens_per_s": 300.0 + s}, prefix="train/")
            tr.log(s, {"timing/step_s": 60.0})
            if s == 2:
                tr.log(s, {"eval/success_rate": 0.5, "eval/mean_reward": 0.8})
        return tr.history()


def test_report_folder(tmp_path):
    run_dir = tmp_path / "run"
    history = history_without_kl(run_dir)
    adapter = tmp_path / "final_adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    health = ["step 1: every group had equal rewards (no signal)", {"check": "grad_norm", "cause": "zero gradient"}]

    out = write_report(run_dir, history, EVALS, adapter=adapter, extra={"health": health, "seed": 7})

    assert out == run_dir / "report"
    md = (out / "summary.md").read_text()
    assert "3 training steps were logged (steps 0–2), in 3m 00s of wall time" in md
    assert "0.0% base, 25.0% after warm start, 50.0% after GRPO" in md
    # one row per stage, in order, with the figures
    rows = [line for line in md.splitlines() if line.startswith("| base") or line.startswith("| after")]
    assert rows == [
        "| base | 16 | 0.0% | -0.1 | 4 | – |",
        "| after warm start | 16 | 25.0% | 0.3 | 3.5 | polygon.get_quote 50.0%, slack.post 12.5% |",
        "| after GRPO | 16 | 50.0% | 0.8 | 2.25 | – |",
    ]
    # last-step figures, health findings, notes
    assert "Step 2." in md and "| train/policy_loss | -0.02 |" in md and "| rollout/success_rate | 40.0% |" in md
    assert (
        "- step 1: every group had equal rewards (no signal)" in md and "check: grad_norm; cause: zero gradient" in md
    )
    assert "- seed: 7" in md
    # plots: present ones are PNGs; KL is missing and says so
    for stem in ("reward", "success_rate", "tokens_per_s"):
        png = out / f"{stem}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC, stem
        assert f"]({stem}.png)" in md
    assert not (out / "kl.png").exists()
    assert "Not plotted: KL to the reference (no `train/kl` in the history)" in md
    # the adapter copied whole
    assert (out / "adapter" / "adapter_config.json").read_text() == '{"r": 8}'
    assert (out / "adapter" / "adapter_model.safetensors").stat().st_size == 64


def test_report_with_nothing(tmp_path):
    out = write_report(tmp_path, [], {})
    md = (out / "summary.md").read_text()
    assert "No training step was logged; the wall time is unknown." in md
    assert "No evaluation was run." in md and "No findings were reported." in md
    assert not list(out.glob("*.png"))
    for title in ("Reward", "Success rate", "KL to the reference", "Throughput"):
        assert title in md.split("Not plotted:")[1]
