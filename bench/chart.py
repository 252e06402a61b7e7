"""Wall time against model size, from the bench's results: verl's merger, mergeflow and the I/O floor, as an SVG.

    python -m bench.chart bench/results/bench.json docs/img/wall-time.svg

`bench.run` draws it after each run; the chart needs no plotting library (a few lines and circles of SVG).
"""

import argparse
import json
from pathlib import Path
from xml.sax.saxutils import escape

SERIES = {
    "verl 0.9.1 merger": ("verl", "cold", "-"),
    "mergeflow merge, running server": ("mergeflow merge (CLI), running server", "cold", "seen config"),
    "mergeflow engine": ("mergeflow", "cold", "seen config"),
}
"""Each line: (step, page cache, config) of the runs whose median it draws."""
FLOOR = "I/O floor"
COLORS = {"verl 0.9.1 merger": "#d62728", "mergeflow merge, running server": "#1f77b4",
          "mergeflow engine": "#2ca02c", FLOOR: "#7f7f7f"}  # fmt: skip
WIDTH, HEIGHT, MARGIN = 640, 400, 60
BYTES_PER_PARAMETER = 2
"""The bench merges to bf16."""


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def floor_seconds(floor: dict) -> float:
    """An I/O floor's read plus write seconds (one sample, or a result's median); results stored before the floor
    was also timed with O_DIRECT call the read `cat_seconds`."""
    return floor.get("read_seconds", floor.get("cat_seconds")) + floor["write_seconds"]


def points(results: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """(billions of parameters, median seconds) per line, for the models that have runs of it."""
    lines: dict[str, list[tuple[float, float]]] = {name: [] for name in (*SERIES, FLOOR)}
    for result in results:
        size = result["output_bytes"] / BYTES_PER_PARAMETER / 1e9
        lines[FLOOR].append((size, floor_seconds(result)))
        for name, (step, cache, config) in SERIES.items():
            walls = [run["wall_seconds"] for run in result["runs"]
                     if (run["step"], run["cache"], run.get("config", "-")) == (step, cache, config)]  # fmt: skip
            if walls:
                lines[name].append((size, median(walls)))
    return {name: sorted(line) for name, line in lines.items() if line}


def svg(lines: dict[str, list[tuple[float, float]]], title: str) -> str:
    largest_size = max(x for line in lines.values() for x, _ in line) * 1.1
    longest = max(y for line in lines.values() for _, y in line) * 1.1

    def at(x: float, y: float) -> tuple[float, float]:
        return (MARGIN + x / largest_size * (WIDTH - 2 * MARGIN),
                HEIGHT - MARGIN - y / longest * (HEIGHT - 2 * MARGIN))  # fmt: skip

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
             f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
             f'<text x="{WIDTH / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
             f'<line x1="{MARGIN}" y1="{HEIGHT - MARGIN}" x2="{WIDTH - MARGIN}" y2="{HEIGHT - MARGIN}" stroke="black"/>',
             f'<line x1="{MARGIN}" y1="{MARGIN}" x2="{MARGIN}" y2="{HEIGHT - MARGIN}" stroke="black"/>',
             f'<text x="{WIDTH / 2}" y="{HEIGHT - 15}" text-anchor="middle">parameters (billions)</text>',
             f'<text x="15" y="{HEIGHT / 2}" text-anchor="middle" transform="rotate(-90 15 {HEIGHT / 2})">'
             "wall time (s), cold page cache</text>"]  # fmt: skip
    for tick in range(5):
        seconds = longest * tick / 4
        _, y = at(0, seconds)
        parts.append(f'<text x="{MARGIN - 6}" y="{y + 4:.1f}" text-anchor="end">{seconds:.0f}</text>')
    for x in sorted({x for line in lines.values() for x, _ in line}):
        left, _ = at(x, 0)
        parts.append(f'<text x="{left:.1f}" y="{HEIGHT - MARGIN + 16}" text-anchor="middle">{x:.1f}</text>')
    for row, (name, line) in enumerate(lines.items()):
        color = COLORS[name]
        coordinates = " ".join(f"{px:.1f},{py:.1f}" for px, py in (at(x, y) for x, y in line))
        dash = ' stroke-dasharray="6 4"' if name == FLOOR else ""
        parts.append(f'<polyline points="{coordinates}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        parts.extend(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{color}"/>' for px, py in (at(x, y) for x, y in line))
        parts.append(f'<text x="{MARGIN + 10}" y="{MARGIN + 14 * row}" fill="{color}">{escape(name)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def draw(results_file: Path, chart_file: Path) -> None:
    results = json.loads(results_file.read_text())
    title = "Merging an 8-rank fp32 FSDP checkpoint to bf16 (medians of the bench's rounds)"
    chart_file.parent.mkdir(parents=True, exist_ok=True)
    chart_file.write_text(svg(points(results), title))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path)
    parser.add_argument("chart", type=Path)
    args = parser.parse_args()
    draw(args.results, args.chart)


if __name__ == "__main__":
    main()
