"""What a tune leaves in autotuning.results_dir: results.csv and results.txt (one row per
candidate), ds_config_optimal.json and cmd_optimal.txt (DeepSpeed's names) and
throughput_vs_memory.png (matplotlib) or .svg (written here when matplotlib is absent)."""

import csv
import dataclasses
import json
import os
import statistics

from .space import Candidate

GIB = 2**30
COLUMNS = (
    "candidate",
    "stage",
    "offload",
    "micro_batch",
    "gas",
    "bucket",
    "status",
    "predicted_peak_GiB",
    "measured_peak_GiB",
    "step_ms",
    "samples_per_s",
    "TFLOP_per_s",
    "finalist_samples_per_s",
    "finalist_median",
    "why",
)


@dataclasses.dataclass
class Row:
    """One candidate's fate. status: "best", "ok", "dropped" (the planner predicted it does
    not fit), "failed" (ran and did not report), "not run" (the search stopped first)."""

    candidate: Candidate
    status: str
    predicted_peak: int | None = None
    record: dict | None = None
    why: str = ""
    rounds: list = dataclasses.field(default_factory=list)  # finalist rounds' records (or None)

    def metric(self, metric: str) -> float | None:
        """The tuned metric, higher is better (latency: 1 / step seconds); None if unmeasured."""
        if self.record is None:
            return None
        if metric == "latency":
            return 1.0 / self.record["step_seconds"]
        key = {"throughput": "samples_per_s", "flops": "tflops"}[metric]
        return self.record.get(key)

    def round_metrics(self, metric: str) -> list[float]:
        """The metric of each finalist round, 0.0 for a round that reported nothing."""
        found = [Row(self.candidate, "ok", record=r).metric(metric) for r in self.rounds]
        return [0.0 if value is None else value for value in found]

    def values(self) -> dict:
        c, r = self.candidate, self.record or {}
        rounds = self.round_metrics("throughput")

        def fixed(value, scale=1.0, digits=3, kind="f"):
            return "" if value is None else f"{value * scale:.{digits}{kind}}"

        return {
            "candidate": c.name,
            "stage": c.stage,
            "offload": c.offload,
            "micro_batch": c.micro_batch,
            "gas": c.gradient_accumulation_steps,
            "bucket": "" if c.bucket is None else f"{c.bucket:.0e}",
            "status": self.status,
            "predicted_peak_GiB": fixed(self.predicted_peak, 1 / GIB),
            "measured_peak_GiB": fixed(r.get("peak_bytes"), 1 / GIB),
            "step_ms": fixed(r.get("step_seconds"), 1e3, 1),
            "samples_per_s": fixed(r.get("samples_per_s"), 1.0, 2),
            "TFLOP_per_s": fixed(r.get("tflops"), 1.0, 4, "g"),
            "finalist_samples_per_s": " ".join(fixed(x, 1.0, 2) for x in rounds) or "",
            "finalist_median": fixed(statistics.median(rounds) if rounds else None, 1.0, 2),
            "why": self.why,
        }


def table(rows: list[Row]) -> str:
    """The rows as an aligned text table (Markdown pipes)."""
    cells = [list(COLUMNS)] + [[str(v) for v in row.values().values()] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    lines = ["| " + " | ".join(v.ljust(w) for v, w in zip(line, widths)) + " |" for line in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def write_results(results_dir: str, rows: list[Row], best: Row, best_config, command) -> str:
    """Write every file of the module docstring; returns the plot's path."""
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, "results.csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(row.values() for row in rows)
    with open(os.path.join(results_dir, "results.txt"), "w") as handle:
        handle.write(table(rows) + "\n")
    with open(os.path.join(results_dir, "ds_config_optimal.json"), "w") as handle:
        json.dump(best_config, handle, indent=2)
        handle.write("\n")
    with open(os.path.join(results_dir, "cmd_optimal.txt"), "w") as handle:
        handle.write(" ".join(command) + "\n")
    return plot(results_dir, [r for r in rows if r.record is not None], best)


def _points(rows: list[Row]) -> list[tuple[float, float, str]]:
    return [
        (r.record["peak_bytes"] / GIB, r.record["samples_per_s"], r.candidate.name) for r in rows
    ]


def plot(results_dir: str, measured: list[Row], best: Row) -> str:
    """Samples/s against measured peak GiB per rank, one labelled point per measured candidate,
    the best one marked."""
    points = _points(measured)
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        return _svg(results_dir, points, best.candidate.name)
    figure, axes = pyplot.subplots(figsize=(7, 4.5))
    for x, y, name in points:
        chosen = name == best.candidate.name
        axes.scatter([x], [y], color="tab:red" if chosen else "tab:blue", zorder=3)
        axes.annotate(name + (" (best)" if chosen else ""), (x, y), fontsize=7)
    axes.set_xlabel("measured peak memory per rank (GiB)")
    axes.set_ylabel("samples/s")
    axes.set_title("zrun --autotuning: throughput against memory")
    axes.grid(True, alpha=0.3)
    path = os.path.join(results_dir, "throughput_vs_memory.png")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
    return path


def _svg(results_dir: str, points, best_name: str) -> str:
    width, height, margin = 640, 400, 60
    xs = [p[0] for p in points] or [0.0]
    ys = [p[1] for p in points] or [0.0]
    x_max, y_max = max(xs) * 1.1 or 1.0, max(ys) * 1.1 or 1.0

    def at(x, y):
        return (
            margin + x / x_max * (width - 2 * margin),
            height - margin - y / y_max * (height - 2 * margin),
        )

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="10">',
        f'<line x1="{margin}" y1="{height - margin}" x2="{width - margin}" '
        f'y2="{height - margin}" stroke="black"/>',
        f'<line x1="{margin}" y1="{margin}" x2="{margin}" y2="{height - margin}" stroke="black"/>',
        f'<text x="{width / 2}" y="{height - 20}" text-anchor="middle">measured peak memory '
        f"per rank (GiB, 0 to {x_max:.3g})</text>",
        f'<text x="15" y="{height / 2}" transform="rotate(-90 15 {height / 2})" '
        f'text-anchor="middle">samples/s (0 to {y_max:.3g})</text>',
    ]
    for x, y, name in points:
        px, py = at(x, y)
        color = "red" if name == best_name else "steelblue"
        parts.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4" fill="{color}"/>')
        parts.append(f'<text x="{px + 6:.1f}" y="{py - 6:.1f}">{name}</text>')
    parts.append("</svg>")
    path = os.path.join(results_dir, "throughput_vs_memory.svg")
    with open(path, "w") as handle:
        handle.write("\n".join(parts) + "\n")
    return path
