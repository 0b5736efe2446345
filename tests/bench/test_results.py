"""bench/results.py: which rows the chart draws (the table keeps them all)."""

from __future__ import annotations

from pathlib import Path

from bench.results import Row, SuiteResult, chart, machine, machine_line, markdown, spread, vector_units


def test_a_row_without_a_ratio_is_not_drawn(tmp_path: Path) -> None:
    # A reward of −0.4 against −0.2: divided by the baseline, the worse side would draw a bar twice as tall.
    reward = Row("reward", "mean", spread([-0.4, -0.4]), spread([-0.2, -0.2]), "TRL", "higher")
    assert reward.ratio is None
    assert not chart(SuiteResult("x", {}, [reward]), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
    assert "-0.4" in markdown(SuiteResult("x", {}, [reward]), "2026-11-26", "here")

    step = Row("wall time per step", "s", spread([24.0, 23.0]), spread([30.0, 31.0]), "TRL", "lower")
    assert step.ratio is not None and step.ratio > 1
    assert chart(SuiteResult("x", {}, [reward, step]), tmp_path / "x.png")
    assert (tmp_path / "x.png").stat().st_size > 0


def test_the_machine_line_names_the_vector_units_that_move_the_figures() -> None:
    assert vector_units({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}) == "AMX, AVX-512 bf16"
    assert vector_units({"avx2", "avx512f", "avx512_bf16"}) == "AVX-512 bf16"
    assert vector_units({"avx2", "avx512f"}) == "AVX-512, no bf16"
    assert vector_units({"sse2", "avx2"}) == "AVX2, no AVX-512"
    assert vector_units(set()) == "unknown"
    m = machine()
    assert m["vector"] and f"({m['vector']})" in machine_line(m)
    old = {k: v for k, v in m.items() if k != "vector"}  # a report written before the field existed
    assert machine_line(old).startswith(f"{m['cores']} cores, {m['cpu']}, ")
