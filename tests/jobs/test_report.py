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


def _per_task(solved: set[int], infra: set[int] = frozenset()) -> list[dict]:
    """Tasks 1-4 of template pe_now (medium), 5-7 close_simple (simple), 8 without a template."""
    out = []
    for i in range(1, 9):
        template, kind = ("pe_now", "medium") if i <= 4 else ("close_simple", "simple") if i <= 7 else (None, None)
        out.append(
            {
                "task_id": f"t{i}",
                "template": template,
                "complexity": kind,
                "success": i in solved,
                "infra_fault": i in infra,
            }
        )
    return out


def test_report_compares_stages_on_the_same_tasks(tmp_path):
    evals = {
        "base": {"success_rate": 1 / 8, "episodes": 8, "per_task": _per_task({5})},
        "after warm start": {"success_rate": 3 / 8, "episodes": 8, "per_task": _per_task({1, 5, 6})},
        "after GRPO": {"success_rate": 5 / 7, "episodes": 8, "per_task": _per_task({1, 2, 5, 6, 8}, infra={3})},
    }
    md = (write_report(tmp_path, [], evals) / "summary.md").read_text()
    assert "### Stages compared on the same tasks" in md and "exact paired bootstrap over tasks" in md
    rows = [line for line in md.splitlines() if " − " in line and line.startswith("| after")]
    # base → warm start: 8 tasks, 2 gained (t1, t6), none lost: gain 2/8; G ~ Bin(8, 1/4) has
    # P(G=0) = 0.100 ≥ 0.025 → lower 0; P(G ≤ 4) = 0.973 < 0.975 ≤ P(G ≤ 5) → upper 5/8; p = 2 · 1/4.
    # warm start → GRPO: t3 (an infra fault) leaves the pairs: 7 tasks, gained t2 and t8.
    # base → GRPO: 7 tasks, 4 gained, p = 2 · 1/16.
    assert rows[0] == "| after warm start − base | 8 | 12.5% → 37.5% | +25.0 | [+0.0, +62.5] | 2 | 0 | 0.5 |"
    assert rows[1].startswith("| after GRPO − after warm start | 7 | 42.9% → 71.4% | +28.6 | [")
    assert rows[1].endswith("| 2 | 0 | 0.5 |")
    assert rows[2].startswith("| after GRPO − base | 7 | 14.3% → 71.4% | +57.1 | [")
    assert rows[2].endswith("| 4 | 0 | 0.12 |")
    assert "| template | complexity | tasks | base | after warm start | after GRPO |" in md
    assert "| close_simple | simple | 3 | 1/3 (33%) | 2/3 (67%) | 2/3 (67%) |" in md
    assert "| pe_now | medium | 4 | 0/4 (0%) | 1/4 (25%) | 2/3 (67%) |" in md  # t3: an infra fault, not scored
    assert "| (none) | – | 1 | 0/1 (0%) | 0/1 (0%) | 1/1 (100%) |" in md
    # the table's rows come in complexity order, after the paired gains
    assert md.index("| close_simple") < md.index("| pe_now") < md.index("| (none)")
    assert md.index("| after GRPO − base") < md.index("| close_simple")


def test_report_without_per_task_has_no_comparison(tmp_path):
    md = (write_report(tmp_path, [], EVALS) / "summary.md").read_text()
    assert "Stages compared" not in md
