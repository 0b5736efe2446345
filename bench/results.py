"""What every suite writes: the JSON report, a markdown table of its comparisons, and a PNG chart.

A comparison row holds both sides' repeated measurements; the table shows each as median [min, max]
and the ratio of medians, oriented so that > 1 means mcprl (or the new path) is better.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal


def machine() -> dict[str, Any]:
    """Cores, CPU model and vector units, memory, Python: what a figure was measured on."""
    model = platform.processor() or "unknown"
    flags: set[str] = set()
    mem_gib = 0.0
    try:
        first_cpu = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
        for line in first_cpu.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
        mem_gib = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "cpu": model,
        "vector": vector_units(flags),
        "memory_gib": round(mem_gib, 1),
        "python": platform.python_version(),
    }


def vector_units(flags: set[str]) -> str:
    """The widest matrix/vector units among an x86 CPU's flags. Same-named CPUs differ here, and it moves the
    figures: without AVX-512, bf16 matmuls fall back to slow paths (the same run took ~2x as long)."""
    if not flags:
        return "unknown"
    if "amx_bf16" in flags:
        return "AMX, AVX-512 bf16"
    if "avx512_bf16" in flags:
        return "AVX-512 bf16"
    if "avx512f" in flags:
        return "AVX-512, no bf16"
    return "AVX2, no AVX-512" if "avx2" in flags else "no AVX2"


def machine_line(m: dict[str, Any]) -> str:
    cpu = f"{m['cpu']} ({m['vector']})" if m.get("vector") else m["cpu"]
    return f"{m['cores']} cores, {cpu}, {m['memory_gib']} GiB" + (f", {m['gpu']}" if m.get("gpu") else "")


@dataclass
class Spread:
    """Repeated measurements of one figure."""

    values: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def text(self, digits: int = 3) -> str:
        med = f"{self.median:.{digits}g}"
        if len(self.values) < 2:
            return med
        return f"{med} [{min(self.values):.{digits}g}, {max(self.values):.{digits}g}]"

    def as_dict(self) -> dict[str, Any]:
        v = self.values
        return {"median": self.median, "min": min(v), "max": max(v), "n": len(v), "values": v}


def spread(values: list[float] | float) -> Spread:
    return Spread([float(v) for v in values] if isinstance(values, list) else [float(values)])


@dataclass
class Row:
    """One figure, ours beside a baseline (or alone). `better` says which direction wins."""

    figure: str
    unit: str
    ours: Spread
    baseline: Spread | None = None
    baseline_name: str = ""
    better: Literal["lower", "higher"] = "higher"
    goal: str = ""

    @property
    def ratio(self) -> float | None:
        """> 1 means ours is better: baseline/ours for times, ours/baseline for rates. None where a median
        is not positive (a reward may be 0 or negative: a ratio of such figures says nothing)."""
        if self.baseline is None or self.baseline.median <= 0 or self.ours.median <= 0:
            return None
        b, o = self.baseline.median, self.ours.median
        return b / o if self.better == "lower" else o / b

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("ours", "baseline")}
        d.update(
            ours=self.ours.as_dict(), baseline=self.baseline.as_dict() if self.baseline else None, ratio=self.ratio
        )
        return d


@dataclass
class Curve:
    """A sweep for the chart: y (repeated) against x, one line per series."""

    title: str
    x_label: str
    y_label: str
    series: dict[str, list[tuple[float, Spread]]] = field(default_factory=dict)
    log_x: bool = False


@dataclass
class SuiteResult:
    suite: str
    report: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    curves: list[Curve] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the table cannot say: where the work differs


def markdown(result: SuiteResult, when: str, where: str) -> str:
    lines = [
        f"### Suite `{result.suite}`",
        "",
        "| figure | ours | baseline | ratio (>1: ours better) | goal | machine | date |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result.rows:
        base = f"{r.baseline.text()} ({r.baseline_name})" if r.baseline else "–"
        ratio = f"{r.ratio:.2f}×" if r.ratio is not None else "–"
        lines.append(f"| {r.figure} ({r.unit}) | {r.ours.text()} | {base} | {ratio} | {r.goal} | {where} | {when} |")
    if result.notes:
        lines += ["", *[f"- {n}" for n in result.notes]]
    return "\n".join(lines) + "\n"


def chart(result: SuiteResult, path: Path) -> bool:
    """Bars (ours beside the baseline, medians with min-max whiskers) for the rows with a baseline, then
    one panel per curve. False when there is nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Rows without a ratio (a median that is not positive, e.g. a negative reward) have no honest bar:
    # divided by a negative baseline, a worse figure would stand taller. The table still shows them.
    paired = [r for r in result.rows if r.baseline is not None and r.ratio is not None]
    panels = len(result.curves) + (1 if paired else 0)
    if not panels:
        return False
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    axes = list(axes[0])
    if paired:
        ax = axes.pop(0)
        # Each pair normalised to the baseline's median, so figures of different units share one axis.
        for i, r in enumerate(paired):
            for j, (s, label) in enumerate(((r.baseline, r.baseline_name or "baseline"), (r.ours, "mcprl"))):
                scale = r.baseline.median or 1.0
                med = s.median / scale
                err = [[med - min(s.values) / scale], [max(s.values) / scale - med]]
                ax.bar(
                    i + (j - 0.5) * 0.38,
                    med,
                    0.36,
                    yerr=err,
                    color=("#bbb", "#2a6")[j],
                    label=label if i == 0 else None,
                )
        labels = [f"{textwrap.fill(r.figure, 16)}\n({r.better} is better)" for r in paired]
        ax.set_xticks(range(len(paired)), labels, fontsize=7)
        ax.set_ylabel("relative to the baseline's median")
        ax.set_title(f"suite {result.suite}")
        ax.legend(fontsize=7)
    for ax, curve in zip(axes, result.curves, strict=True):
        for name, points in curve.series.items():
            xs = [x for x, _ in points]
            meds = [s.median for _, s in points]
            lo = [m - min(s.values) for m, (_, s) in zip(meds, points, strict=True)]
            hi = [max(s.values) - m for m, (_, s) in zip(meds, points, strict=True)]
            ax.errorbar(xs, meds, yerr=[lo, hi], marker="o", capsize=3, label=name)
        if curve.log_x:
            ax.set_xscale("log")
        ax.set_xlabel(curve.x_label)
        ax.set_ylabel(curve.y_label)
        ax.set_title(curve.title, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(result: SuiteResult, out: Path) -> list[Path]:
    """`out/SUITE.json`, `out/SUITE.md` and (when there is something to draw) `out/SUITE.png`."""
    out.mkdir(parents=True, exist_ok=True)
    m = result.report.setdefault("machine", machine())
    when = datetime.date.today().isoformat()
    doc = {
        "suite": result.suite,
        "date": when,
        "report": result.report,
        "rows": [r.as_dict() for r in result.rows],
        "curves": [
            {
                **{k: getattr(c, k) for k in ("title", "x_label", "y_label", "log_x")},
                "series": {n: [[x, s.as_dict()] for x, s in pts] for n, pts in c.series.items()},
            }
            for c in result.curves
        ],
        "notes": result.notes,
    }
    paths = [out / f"{result.suite}.json", out / f"{result.suite}.md"]
    paths[0].write_text(json.dumps(doc, indent=2, default=str))
    paths[1].write_text(markdown(result, when, machine_line(m)))
    if chart(result, out / f"{result.suite}.png"):
        paths.append(out / f"{result.suite}.png")
    return paths
