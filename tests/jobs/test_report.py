"""write_report: summary.md per eval set (validation first), paired comparisons of milestone stages only,
PNG plots (eval lines from every stage, periodic ones included; a note for a missing metric), the adapter."""

from __future__ import annotations

from pathlib import Path

import pytest

from configs.schema import Config, LoggingConfig
from jobs.report import PLOTS, console_lines, plot_metric, write_report
from jobs.tracking import Tracker

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

VALIDATION_DESC = "held-out instances (tickers, phrasings) of the training templates"
TRANSFER_DESC = "templates never trained on"

EVALS = {
    "validation": {
        "base": {
            "success_rate": 0.0,
            "calls_right_rate": 0.125,
            "mean_reward": -0.1,
            "turns": 4.0,
            "episodes": 16,
            "step": 0,
            "tool_error_rates": {},
        },
        "after warm start": {
            "success_rate": 0.25,
            "calls_right_rate": 0.5,
            "mean_reward": 0.3,
            "turns": 3.5,
            "episodes": 16,
            "step": 0,
            "tool_error_rates": {"polygon.get_quote": 0.5, "slack.post": 0.125},
        },
        "after GRPO": {"success_rate": 0.5, "mean_reward": 0.8, "turns": 2.25, "episodes": 16, "step": 2},
    }
}


def history_without_kl(tmp_path: Path, rollout_success: bool = True) -> list[dict]:
    """Three steps logged through a real Tracker, as the driver logs them, but no train/kl."""
    with Tracker(Config(logging=LoggingConfig(wandb="off", ray_metrics=False)), tmp_path) as tr:
        for s in range(3):
            rollout = {
                "episode_reward": 0.1 * s,
                "calls_right_rate": 0.3 * s,
                "groups_kept": 0.5,
                "tokens_per_s": 240.0,
            }
            if rollout_success:
                rollout["success_rate"] = 0.2 * s
            tr.log(s, rollout, prefix="rollout/")
            tr.log(s, {"policy_loss": -0.01 * s, "grad_norm": 0.5, "tokens_per_s": 300.0 + s}, prefix="train/")
            tr.log(s, {"timing/step_s": 60.0})
            if s == 2:
                tr.log(s, {"success_rate": 0.5, "mean_reward": 0.8}, prefix="eval/validation/")
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
    assert (
        "Held-out success (final answer right): validation 0.0% base, 25.0% after warm start, 50.0% after GRPO." in md
    )
    assert "### validation\n" in md  # no description given: the set's name
    # one row per stage, in order, with the figures: success (answer right), then calls right
    rows = [line for line in md.splitlines() if line.startswith("| base") or line.startswith("| after")]
    assert rows == [
        "| base | 0 | 16 | 0.0% | 12.5% | -0.1 | 4 | – |",
        "| after warm start | 0 | 16 | 25.0% | 50.0% | 0.3 | 3.5 | polygon.get_quote 50.0%, slack.post 12.5% |",
        "| after GRPO | 2 | 16 | 50.0% | – | 0.8 | 2.25 | – |",
    ]
    # last-step figures (groups kept as percent), health findings, notes
    assert "Step 2." in md and "| train/policy_loss | -0.02 |" in md and "| rollout/success_rate | 40.0% |" in md
    assert "| rollout/calls_right_rate | 60.0% |" in md and "| rollout/groups_kept | 50.0% |" in md
    assert "| eval/validation/success_rate | 50.0% |" in md
    assert md.index("| rollout/calls_right_rate") < md.index("| train/policy_loss")  # key figures first
    assert (
        "- step 1: every group had equal rewards (no signal)" in md and "check: grad_norm; cause: zero gradient" in md
    )
    assert "- seed: 7" in md
    # plots: present ones are PNGs; KL is missing and says so
    for stem in ("reward", "success_rate", "groups_kept", "tokens_per_s"):
        png = out / f"{stem}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC, stem
        assert f"]({stem}.png)" in md
    assert not (out / "kl.png").exists()
    assert "Not plotted: KL to the reference (no `train/kl` in the history)" in md
    assert "Incomplete" not in md
    # the adapter copied whole
    assert (out / "adapter" / "adapter_config.json").read_text() == '{"r": 8}'
    assert (out / "adapter" / "adapter_model.safetensors").stat().st_size == 64


def test_report_with_nothing(tmp_path):
    out = write_report(tmp_path, [], {})
    md = (out / "summary.md").read_text()
    assert "No training step was logged; the wall time is unknown." in md and "Held-out success" not in md
    assert "No evaluation was run." in md and "No findings were reported." in md
    assert not list(out.glob("*.png"))
    not_plotted = md.split("Not plotted:")[1]
    for spec in PLOTS.values():
        assert spec.title in not_plotted
    assert "no evaluation with `step` and `success_rate`" in not_plotted


def test_old_flat_evals_are_refused(tmp_path):
    with pytest.raises(TypeError, match=r"evals\['base'\] must map stage"):
        write_report(tmp_path, [], {"base": {"success_rate": 0.5}})


def test_one_stage_without_per_task(tmp_path):
    evals = {"validation": {"base": {"success_rate": 0.375, "step": 0}}, "transfer": {}}
    md = (write_report(tmp_path, [], evals) / "summary.md").read_text()
    assert "validation 37.5% base." in md and "| base | 0 | – | 37.5% | – |" in md
    assert "compared on the same tasks" not in md and "### transfer" not in md
    assert (tmp_path / "report" / "success_rate.png").read_bytes()[:8] == PNG_MAGIC  # one eval point is drawn
    assert console_lines(evals) == []


def test_success_plot_without_rollout_success_says_so(tmp_path):
    history = history_without_kl(tmp_path / "run", rollout_success=False)
    out = write_report(tmp_path / "run", history, EVALS)
    md = (out / "summary.md").read_text()
    assert (out / "success_rate.png").read_bytes()[:8] == PNG_MAGIC  # still drawn: eval lines, calls right
    assert (
        "Incomplete: Success (final answer right): training rollouts vs held-out evaluations has no training "
        "rollouts (answer right) line (no `rollout/success_rate` in the history)." in md
    )


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
                "calls_right": True,
                "infra_fault": i in infra,
            }
        )
    return out


def validation_with_periodic() -> dict[str, dict]:
    """Milestones base, after warm start, after GRPO, with periodic evaluations at steps 5 and 10 between."""
    return {
        "base": {"success_rate": 1 / 8, "episodes": 8, "step": 0, "per_task": _per_task({5})},
        "after warm start": {"success_rate": 3 / 8, "episodes": 8, "step": 0, "per_task": _per_task({1, 5, 6})},
        # periodic: all solved, so pairing with it would change every gain below
        "step 5": {"success_rate": 1.0, "step": 5, "periodic": True, "per_task": _per_task(set(range(1, 9)))},
        "step 10": {"success_rate": 0.0, "step": 10, "periodic": True, "per_task": _per_task(set())},
        "after GRPO": {
            "success_rate": 5 / 7,
            "episodes": 8,
            "step": 12,
            "description": VALIDATION_DESC,
            "per_task": _per_task({1, 2, 5, 6, 8}, infra={3}),
        },
    }


def test_report_compares_milestones_on_the_same_tasks(tmp_path):
    evals = {"validation": validation_with_periodic()}
    md = (write_report(tmp_path, [], evals) / "summary.md").read_text()
    assert f"### validation: {VALIDATION_DESC}" in md
    assert "#### validation: milestone stages compared on the same tasks" in md
    assert "exact paired bootstrap over tasks" in md
    # the headline sentence has the milestones only; the eval table has every stage, periodic ones marked
    assert "validation 12.5% base, 37.5% after warm start, 71.4% after GRPO." in md
    assert "| step 5 (periodic) | 5 | – | 100.0% |" in md and "| step 10 (periodic) | 10 | – | 0.0% |" in md
    rows = [line for line in md.splitlines() if " − " in line and line.startswith("| ")]
    # base → warm start: 8 tasks, 2 gained (t1, t6), none lost: gain 2/8; G ~ Bin(8, 1/4) has
    # P(G=0) = 0.100 ≥ 0.025 → lower 0; P(G ≤ 4) = 0.973 < 0.975 ≤ P(G ≤ 5) → upper 5/8; p = 2 · 1/4.
    # warm start → GRPO: t3 (an infra fault) leaves the pairs: 7 tasks, gained t2 and t8.
    # base → GRPO: 7 tasks, 4 gained, p = 2 · 1/16. No row involves a periodic stage.
    assert len(rows) == 3 and not any("step 5" in r or "step 10" in r for r in rows)
    assert rows[0] == "| after warm start − base | 8 | 12.5% → 37.5% | +25.0 | [+0.0, +62.5] | 2 | 0 | 0.5 |"
    assert rows[1].startswith("| after GRPO − after warm start | 7 | 42.9% → 71.4% | +28.6 | [")
    assert rows[1].endswith("| 2 | 0 | 0.5 |")
    assert rows[2].startswith("| after GRPO − base | 7 | 14.3% → 71.4% | +57.1 | [")
    assert rows[2].endswith("| 4 | 0 | 0.12 |")
    assert "| template | complexity | tasks | base | after warm start | after GRPO |" in md  # milestones only
    assert "| close_simple | simple | 3 | 1/3 (33%) | 2/3 (67%) | 2/3 (67%) |" in md
    assert "| pe_now | medium | 4 | 0/4 (0%) | 1/4 (25%) | 2/3 (67%) |" in md  # t3: an infra fault, not scored
    assert "| (none) | – | 1 | 0/1 (0%) | 0/1 (0%) | 1/1 (100%) |" in md
    # the table's rows come in complexity order, after the paired gains
    assert md.index("| close_simple") < md.index("| pe_now") < md.index("| (none)")
    assert md.index("| after GRPO − base") < md.index("| close_simple")


def test_success_plot_has_every_stage_and_the_rollouts(tmp_path):
    evals = {"transfer": {"base": {"success_rate": 0.0, "step": 0}}, "validation": validation_with_periodic()}
    rows = [{"step": s, "rollout/success_rate": 0.1 * s, "rollout/calls_right_rate": 0.5} for s in range(1, 13)]
    path = tmp_path / "success.png"
    drawn = plot_metric(path, rows, PLOTS["success_rate"], evals)
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert drawn["training rollouts (answer right)"] == list(range(1, 13))
    assert drawn["training rollouts (tool calls right)"] == list(range(1, 13))
    # base shares step 0 with warm start: marked apart; the line runs through warm start, periodic stages, GRPO
    assert drawn["held-out validation: base"] == [0.0]
    assert drawn["held-out validation"] == [0.0, 5.0, 10.0, 12.0]
    assert drawn["held-out transfer: base"] == drawn["held-out transfer"] == [0.0]  # a lone base: marked, and the line
    assert list(drawn).index("held-out validation") < list(drawn).index("held-out transfer")
    assert plot_metric(tmp_path / "none.png", [], PLOTS["success_rate"], {}) == {}
    assert not (tmp_path / "none.png").exists()


def two_sets() -> dict[str, dict]:
    """Transfer given first: the report still shows validation first."""
    transfer = {
        "base": {"success_rate": 0.25, "step": 0, "description": TRANSFER_DESC, "per_task": _per_task({1, 5})},
        "after GRPO": {"success_rate": 0.125, "step": 12, "per_task": _per_task({5})},
    }
    return {"transfer": transfer, "validation": validation_with_periodic()}


def test_two_sets_in_summary_validation_first(tmp_path):
    md = (write_report(tmp_path, [], two_sets()) / "summary.md").read_text()
    assert (
        "Held-out success (final answer right): validation 12.5% base, 37.5% after warm start, 71.4% after GRPO; "
        "transfer 25.0% base, 12.5% after GRPO." in md
    )
    v, t = md.index(f"### validation: {VALIDATION_DESC}"), md.index(f"### transfer: {TRANSFER_DESC}")
    assert v < md.index("| after GRPO − base | 7 | 14.3% → 71.4%") < t
    # transfer: 8 tasks, t1 lost, none gained: −12.5 points, p = 1; its own template table
    assert md.index("| after GRPO − base | 8 | 25.0% → 12.5% | -12.5 | [") > t
    assert "| template | complexity | tasks | base | after GRPO |" in md[t:]
    assert "| pe_now | medium | 4 | 1/4 (25%) | 0/4 (0%) |" in md[t:]


def test_console_lines_show_both_sets(tmp_path):
    lines = console_lines(two_sets())
    assert lines[0] == f"== validation: {VALIDATION_DESC}"
    t = lines.index(f"== transfer: {TRANSFER_DESC}")
    assert "  after warm start − base: +25.0 points, 95% CI [+0.0, +62.5]; 2 task(s) gained, 0 lost of 8" in "\n".join(
        lines[:t]
    )
    gains = [line for line in lines if line.startswith("  ")]
    assert len(gains) == 4 and not any("step 5" in g for g in gains)  # 3 validation, 1 transfer
    assert (
        gains[3].startswith("  after GRPO − base: -12.5 points, 95% CI [")
        and "0 task(s) gained, 1 lost of 8" in gains[3]
    )
    assert lines.index(gains[3]) > t
    assert "| close_simple | simple | 3 | 1/3 (33%) | 1/3 (33%) |" in lines[t:]
