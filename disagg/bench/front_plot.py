"""The figure of `python -m disagg.bench front`: where each front stops, beside the engines and the targets.

Three panels, from what the run printed: tokens/s by streams per path, with the computing decode engine's
peak and the ceiling target (3x it); each ceiling round's ratio per front, since the machine's speed moves
between rounds and a single ratio hides it; and what each path added to the first token in the alternated
rounds, with the 1.5-ms target and front_floor, the least any Python model in front adds here.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class FrontFigure:
    """What is plotted, in the bench's units."""

    tokens: dict[str, list[tuple[int, float]]]  # path -> (streams, tokens/s) per level
    engine_peaks: list[float]  # the computing decode engine's best tokens/s, by ceiling round
    ratios: dict[str, list[float]]  # front (or the engines called directly) -> its tokens/s / the engine's, by round
    ttft_added: dict[str, list[float]]  # path -> TTFT it added to the engines called directly, ms, by alternated round
    ceiling_target: float  # times the engine's peak
    ttft_target_ms: float
    ceiling_client: str = ""  # what drove the ceiling rounds' paths


def plot(figure: FrontFigure, path: Path) -> Path | None:
    """Writes the figure as a PNG; None without matplotlib (an extra: `pip install -e '.[load]'`)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (by_streams, by_round, first_token) = plt.subplots(1, 3, figsize=(16, 4.8))
    names = list(dict.fromkeys([*figure.tokens, *figure.ratios, *figure.ttft_added]))
    color = {name: f"C{i}" for i, name in enumerate(names)}  # a path has one colour in every panel
    for name, points in figure.tokens.items():
        streams, rates = zip(*sorted(points))
        by_streams.plot(streams, rates, marker="o", label=name, color=color[name])
    if figure.engine_peaks:
        peak = float(np.median(figure.engine_peaks))
        by_streams.axhline(peak, color="black", linewidth=1, label=f"computing decode engine's peak ({peak:.0f}, median)")
        by_streams.axhline(figure.ceiling_target * peak, color="black", linestyle="--", linewidth=1,
                           label=f"ceiling target ({figure.ceiling_target:g}x it)")
    by_streams.set(title="tokens/s by concurrent streams (this bench's client)", xlabel="streams (log scale)", ylabel="output tokens/s")
    by_streams.set_xscale("log", base=2)
    levels = sorted({streams for points in figure.tokens.values() for streams, _ in points})
    by_streams.set_xticks(levels, [str(n) for n in levels])
    by_streams.legend(fontsize=7)
    for name, ratios in figure.ratios.items():
        by_round.plot(range(1, len(ratios) + 1), ratios, marker="o", label=name, color=color[name])
    if figure.ratios:
        by_round.axhline(figure.ceiling_target, color="black", linestyle="--", linewidth=1, label="target")
        by_round.set_xticks(range(1, max(len(r) for r in figure.ratios.values()) + 1))
        by_round.legend(fontsize=7)
    driven = f" ({figure.ceiling_client})" if figure.ceiling_client else ""
    by_round.set(title=f"ceiling rounds{driven}: tokens/s / the engine's peak", xlabel="round", ylabel="x the engine's peak in that round")
    added = {name: values for name, values in figure.ttft_added.items() if values}
    if added:
        boxes = first_token.boxplot(list(added.values()), patch_artist=True)
        for box, name in zip(boxes["boxes"], added):
            box.set(facecolor=color[name], alpha=0.5)
        first_token.set_xticks(range(1, len(added) + 1), list(added), rotation=15, fontsize=7)
        first_token.axhline(figure.ttft_target_ms, color="black", linestyle="--", linewidth=1, label=f"target ({figure.ttft_target_ms:g} ms)")
        first_token.legend(fontsize=7)
    first_token.set(title="TTFT added, one request after one on its path", ylabel="ms over the engines called directly")
    for ax in (by_streams, by_round, first_token):
        ax.grid(alpha=0.3)
        ax.title.set_fontsize(10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
