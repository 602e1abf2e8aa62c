"""The README's picture: per cache, the largest batch that fits one GPU and the tokens/s at it, drawn
as a plain SVG from a saved `bench e2e` run (standard library only, so the picture can be remade
anywhere the repository is checked out).

    python docs/figures/memory_throughput.py      # writes docs/figures/memory_throughput.svg

Both panels read the run's `summary` rows: `max_batch`, and `tokens_per_s_max_batch`, the estimate
from timed steps (prefill and packing steps included). The real generations at the largest batches
are in docs/results.md.
"""

import json
from html import escape
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "data" / "results" / "e2e_qwen3-8b_h200_graph.json"
OUT = Path(__file__).with_suffix(".svg")
ORDER = ["static-compiled", "fp16-prealloc", "kivi-k2v2", "kitty", "kitty-pro"]
LABELS = {"static-compiled": "StaticCache, compiled (transformers)", "fp16-prealloc": "fp16-prealloc (FP16, cuDNN)"}
BASELINE, QUANTIZED = "#8c8c8c", "#e07b22"
WIDTH, ROW, TOP, LABEL_W, PANEL_W, GAP = 900, 30, 62, 250, 250, 70


def rows(run: dict) -> list[dict]:
    by_cache = {r["cache"]: r for r in run["summary"]}
    return [by_cache[c] for c in ORDER if c in by_cache]


def panel(x0: float, title: str, values: list[float], colors: list[str]) -> list[str]:
    """One horizontal bar panel: bars from x0, scaled to the largest value, each with its number."""
    top = max(values)
    out = [f'<text x="{x0}" y="{TOP - 14}" class="title">{escape(title)}</text>']
    for i, (v, color) in enumerate(zip(values, colors)):
        y = TOP + i * ROW
        w = max(1.0, PANEL_W * v / top)
        out.append(f'<rect x="{x0}" y="{y}" width="{w:.1f}" height="{ROW - 10}" fill="{color}"/>')
        out.append(f'<text x="{x0 + w + 6:.1f}" y="{y + (ROW - 10) / 2}" class="value">{v:,.0f}</text>')
    return out


def svg(run: dict) -> str:
    data = rows(run)
    s = run["settings"]
    height = TOP + ROW * len(data) + 50
    colors = [BASELINE if r["cache"] in ("static-compiled", "fp16-prealloc") else QUANTIZED for r in data]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" '
        'font-family="Helvetica, Arial, sans-serif" font-size="13">',
        "<style>.title{font-weight:bold}.value{dominant-baseline:middle}.cache{dominant-baseline:middle;"
        "text-anchor:end}.note{fill:#555;font-size:11px}</style>",
        '<rect width="100%" height="100%" fill="white"/>',
    ]
    for i, r in enumerate(data):
        label = LABELS.get(r["cache"], r["cache"])
        parts.append(f'<text x="{LABEL_W - 10}" y="{TOP + i * ROW + ROW / 2 - 5}" class="cache">{escape(label)}</text>')
    parts += panel(LABEL_W, "largest batch that fits", [r["max_batch"] for r in data], colors)
    parts += panel(LABEL_W + PANEL_W + GAP, "tokens/s at that batch (estimated from timed steps)",
                   [r["tokens_per_s_max_batch"] for r in data], colors)
    notes = (f"One {s['gpu']}; {s['model']} ({s['dtype']}, random weights); a {s['prompt']}-token prompt and "
             f"{s['generate']:,} generated tokens per sequence; {s['decode']} decode.",
             f"Data: {RUN.relative_to(ROOT)}")
    for i, note in enumerate(notes):
        parts.append(f'<text x="10" y="{height - 26 + 14 * i}" class="note">{escape(note)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main() -> None:
    OUT.write_text(svg(json.loads(RUN.read_text())))
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
