import xml.etree.ElementTree as ET

import pytest

from PIL import Image

from pipelines.comparison.plots import arm_colours, comparison_figure, seed_band

ARMS = ["mpp", "mpp-pixel", "mpp-15pct", "supervised", "scratch"]


def assert_png_and_svg(written, stem):
    png, svg = written
    assert (png, svg) == (stem.with_suffix(".png"), stem.with_suffix(".svg"))
    with Image.open(png) as image:
        assert image.format == "PNG" and image.width > 300 and image.height > 200
        image.verify()
    assert ET.parse(svg).getroot().tag == "{http://www.w3.org/2000/svg}svg"


def test_the_comparison_figure_of_five_arms_writes_png_and_svg_with_every_panel(tmp_path):
    finetune = {arm: {seed: [[step, 0.5 + 0.05 * i + 0.001 * step + 0.01 * seed] for step in (0, 50, 100)]
                      for seed in (0, 1, 2)} for i, arm in enumerate(ARMS)}
    pretraining = {arm: {"val/pretext_loss": [[0, 6.0], [100, 4.0], [200, 3.5]], "knn/top1": [[0, 0.2], [200, 0.4]]}
                   for arm in ARMS[:3]}
    pretraining["supervised"] = {"val/loss": [[0, 2.3], [200, 0.9]]}  # no kNN curve logged: its panel is skipped
    gaps = [{"arms": [a, b], "gap": 0.01 * i, "low": 0.01 * i - 0.02, "high": 0.01 * i + 0.02, "confidence": 0.95}
            for i, (a, b) in enumerate((a, b) for j, a in enumerate(ARMS) for b in ARMS[j + 1:])]
    stem = tmp_path / "out" / "comparison"
    assert_png_and_svg(comparison_figure(finetune, pretraining, gaps, stem), stem)
    svg = stem.with_suffix(".svg").read_text()  # matplotlib's SVG draws text as glyphs and keeps it in a comment
    for label in ["(a) fine-tuning", "(b) pretraining", "(c) test top-1 gaps", "mpp-15pct: kNN top-1 (%)",
                  "mpp: val/pretext_loss", "supervised: validation val/loss", "mpp − scratch", "supervised − scratch"]:
        assert label in svg, label
    assert "supervised: kNN top-1" not in svg


def test_one_arm_without_pretraining_or_gaps_draws_the_fine_tuning_panel_alone(tmp_path):
    stem = tmp_path / "one"
    comparison_figure({"scratch": {"0": [[0, 0.1], [10, 0.3]]}}, {}, [], stem.with_suffix(".png"))
    assert_png_and_svg((stem.with_suffix(".png"), stem.with_suffix(".svg")), stem)
    svg = stem.with_suffix(".svg").read_text()
    assert "(a) fine-tuning" in svg and "(b) pretraining" not in svg and "(c)" not in svg


def test_a_figure_whose_writing_fails_half_way_leaves_the_earlier_one_whole(tmp_path, monkeypatch):
    # A plan's figures are redrawn at each budget, by each compare process of a plan split over disjoint arms; drawn
    # in place, a kill (or two processes at once) left a cut or mixed file.
    from matplotlib.figure import Figure

    stem = tmp_path / "one"
    curves = {"scratch": {"0": [[0, 0.1], [10, 0.3]]}}
    comparison_figure(curves, {}, [], stem)
    earlier = stem.with_suffix(".png").read_bytes(), stem.with_suffix(".svg").read_bytes()
    savefig = Figure.savefig

    def half_then_killed(figure, path, **kwargs):
        savefig(figure, path, **kwargs)
        with open(path, "r+b") as file:
            file.truncate(len(file.read()) // 2)
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", half_then_killed)
    with pytest.raises(KeyboardInterrupt):
        comparison_figure({"scratch": {"0": [[0, 0.2], [10, 0.9]]}}, {}, [], stem)
    monkeypatch.undo()
    assert (stem.with_suffix(".png").read_bytes(), stem.with_suffix(".svg").read_bytes()) == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.png", "one.svg"]


def test_seed_band_is_the_mean_and_min_max_over_the_seeds_that_logged_each_step():
    steps, mean, low, high = seed_band({0: [[0, 0.2], [10, 0.5]], 1: [[0, 0.4], [10, 0.7]], 2: [[0, 0.3]]})
    assert steps.tolist() == [0, 10]
    assert mean == pytest.approx([0.3, 0.6])
    assert low.tolist() == [0.2, 0.5] and high.tolist() == [0.4, 0.7]


def test_arm_colours_are_distinct_for_any_number_of_arms():
    for count in (1, 5, 10, 12):
        colours = arm_colours([f"arm{i}" for i in range(count)])
        assert len(set(colours.values())) == count
