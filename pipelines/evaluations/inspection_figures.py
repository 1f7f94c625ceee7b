"""The inspection views (mpp.evaluation.views) drawn as the paper draws them, from plain arrays.

Drawn on an explicit Figure with the Agg canvas, never through pyplot, as pipelines/plots.py does: no display, and no
global figure state left behind by an evaluator that draws every few hundred steps.
"""

from __future__ import annotations

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

GAP = 1  # pixels between the tiles of a mosaic


def mosaic(tiles: np.ndarray, columns: int, fill: float) -> np.ndarray:
    """Tiles (K, h, w[, 3]) laid out row-major in `columns`, GAP pixels of `fill` between them."""
    k, h, w = tiles.shape[:3]
    rows = -(-k // columns)
    out = np.full((rows * (h + GAP) - GAP, columns * (w + GAP) - GAP, *tiles.shape[3:]), fill, dtype=float)
    for i, tile in enumerate(tiles):
        r, c = divmod(i, columns)
        out[r * (h + GAP): r * (h + GAP) + h, c * (w + GAP): c * (w + GAP) + w] = tile
    return out


def filters_figure(components: np.ndarray, explained: np.ndarray, grey: bool) -> Figure:
    """Fig. 7 left: principal components (K, 3, P, P) of the patch-embedding filters as RGB tiles, each stretched to
    its own range (a component's sign and scale are arbitrary); `grey`: of the filters summed over colour channels."""
    tiles = components.transpose(0, 2, 3, 1)
    low, high = tiles.min(axis=(1, 2, 3), keepdims=True), tiles.max(axis=(1, 2, 3), keepdims=True)
    tiles = (tiles - low) / np.maximum(high - low, 1e-12)
    columns = min(7, len(tiles))
    figure = Figure(figsize=(1.0 * columns + 0.4, 1.0 * -(-len(tiles) // columns) + 0.8), dpi=100)
    ax = figure.add_subplot()
    ax.imshow(mosaic(tiles, columns, fill=1.0), interpolation="nearest")
    ax.set_axis_off()
    kind = "embedding filters summed over R, G, B (grey images)" if grey else "RGB embedding filters"
    ax.set_title(f"{kind}: first {len(tiles)} principal components\n({explained.sum():.0%} of the filters' variance)",
                 fontsize=9)
    figure.tight_layout()
    return figure


def similarity_figure(similarity: np.ndarray, grid: int) -> Figure:
    """Fig. 7 centre: for the patch at row r, column c, a grid x grid map of its position embedding's cosine
    similarity to every position's, drawn in the cell at (r, c)."""
    tiles = similarity.reshape(grid * grid, grid, grid)
    figure = Figure(figsize=(5.2, 4.6), dpi=100)
    ax = figure.add_subplot()
    cmap = colormaps["viridis"].with_extremes(bad="white")
    shown = ax.imshow(mosaic(tiles, grid, fill=np.nan), cmap=cmap, vmin=-1, vmax=1, interpolation="nearest")
    step = grid + GAP
    ticks = np.arange(grid) * step + (grid - 1) / 2
    ax.set_xticks(ticks, [str(i + 1) for i in range(grid)], fontsize=6)
    ax.set_yticks(ticks, [str(i + 1) for i in range(grid)], fontsize=6)
    ax.tick_params(length=0)
    ax.set_xlabel("input patch column")
    ax.set_ylabel("input patch row")
    ax.set_title("position embedding similarity", fontsize=10)
    figure.colorbar(shown, ax=ax, label="cosine similarity", fraction=0.046, pad=0.04)
    figure.tight_layout()
    return figure


def distance_figure(distance: np.ndarray, uniform: float, image_size: int) -> Figure:
    """Fig. 7 right: each head's mean attention distance (depth, heads) against its layer, one point per head, with
    the distance that uniform attention over the patches would give."""
    depth, heads = distance.shape
    figure = Figure(figsize=(4.6, 3.4), dpi=100)
    ax = figure.add_subplot()
    colours = colormaps["tab10"] if heads <= 10 else colormaps["viridis"].resampled(heads)
    for head in range(heads):
        ax.scatter(np.arange(1, depth + 1), distance[:, head], s=14, color=colours(head), label=f"head {head + 1}")
    ax.axhline(uniform, color="grey", linestyle="--", linewidth=1, label="uniform attention")
    ax.set_xlabel("network depth (layer)")
    ax.set_ylabel("mean attention distance (pixels)")
    ax.set_xticks(np.arange(1, depth + 1))
    ax.set_ylim(0, max(uniform, float(distance.max())) * 1.1)
    ax.set_title(f"mean attention distance ({image_size}-px images)", fontsize=10)
    if heads <= 16:
        ax.legend(fontsize=6, ncol=2, loc="lower right")
    figure.tight_layout()
    return figure


def rollout_figure(images: np.ndarray, reach: dict[str, np.ndarray], grid: int) -> Figure:
    """Fig. 6: each image (R, 3, H, W) uint8 beside its attention rollout to each output ({name: (R, N)}), overlaid as
    a heat map over the patches (each map scaled to its own maximum)."""
    rows, size = len(images), images.shape[-1]
    columns = 1 + len(reach)
    figure = Figure(figsize=(1.7 * columns, 1.7 * rows + 0.3), dpi=100)
    axes = figure.subplots(rows, columns, squeeze=False)
    for r in range(rows):
        picture = images[r].transpose(1, 2, 0)
        axes[r, 0].imshow(picture, interpolation="nearest")
        for c, (name, maps) in enumerate(reach.items(), start=1):
            heat = maps[r].reshape(grid, grid)
            axes[r, c].imshow(picture, interpolation="nearest")
            shown = axes[r, c].imshow(heat / max(float(heat.max()), 1e-12), cmap="inferno", alpha=0.6, vmin=0, vmax=1,
                                      extent=(-0.5, size - 0.5, size - 0.5, -0.5), interpolation="bilinear")
            if r == 0:
                axes[r, c].set_title(f"rollout to\n{name}", fontsize=8)
        if r == 0:
            axes[r, 0].set_title("input", fontsize=8)
    for ax in axes.flat:
        ax.set_axis_off()
    figure.tight_layout()
    if reach:  # after the layout, which a colour bar's own axes would upset: one scale serves every map
        figure.colorbar(shown, ax=axes[:, 1:].ravel().tolist(), label="attention (share of the map's maximum)",
                        fraction=0.03, pad=0.02)
    return figure


def pixels(figure: Figure) -> np.ndarray:
    """The figure rendered as an (H, W, 3) uint8 array, for TensorBoard."""
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()
