"""benchmarks/emoji.py on small packages of the npm layout. Transfer: the split by category and by emoji, no sibling
of a test image among the training images, RGB on white, and a refusal where a class is too small. Semi-supervised:
every vendor pooled, split by emoji (identical drawings and obsoleted codes kept together), the nine categories as
classes, transparency over mpp's grey, shards in one command, and configs/compare/emoji_semi.yaml's dry run on them."""

import importlib.util
import io
import json
import math
import tarfile
import zlib
from collections import Counter

import pytest
from PIL import Image

from conftest import ROOT
from mpp.data.images import BACKGROUND
from pipelines.comparison.plan import load_compare_config
from pipelines.stages import compare

spec = importlib.util.spec_from_file_location("emoji_benchmark", ROOT / "benchmarks" / "emoji.py")
emoji = importlib.util.module_from_spec(spec)
spec.loader.exec_module(emoji)


def png(colour, alpha=255) -> bytes:
    out = io.BytesIO()
    Image.new("RGBA", (64, 64), (*colour, alpha)).save(out, format="PNG")
    return out.getvalue()


def drawing(name: str) -> bytes:
    """Each emoji's own colour (from its code); category 00's drawings fully transparent."""
    c, i = int(name[:2], 16), int(name[2:4], 16)
    return png((10 + 20 * c, 10 + 20 * i, 200), alpha=0 if name.startswith("00") else 255)


def write_packages(directory, per_category=6, edit=lambda entries: None, draw=drawing):
    entries = []
    for c, category in enumerate(emoji.UPSTREAM + emoji.DOWNSTREAM + ("Component",)):
        for i in range(per_category):
            code = f"{c:02x}{i:02x}"
            skin = {"1F3FB": {"image": f"{code}-1f3fb.png"}} if i == 0 else None
            entries.append({"unified": code, "image": f"{code}.png", "category": category, "skin_variations": skin,
                            **{f"has_img_{v}": True for v in emoji.VENDORS}})
    edit(entries)
    for vendor in emoji.VENDORS:
        with tarfile.open(directory / f"emoji-datasource-{vendor}-{emoji.VERSION}.tgz", "w:gz") as tar:
            def add(name, data):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            add("package/emoji.json", json.dumps(entries).encode())
            for e in entries:
                for name in emoji.renditions(e):
                    if e[f"has_img_{vendor}"]:
                        add(f"package/img/{vendor}/64/{name}", draw(name))


def test_the_emoji_benchmark_splits_by_category_and_by_emoji_with_one_vendor_downstream(tmp_path):
    write_packages(tmp_path)
    written = emoji.arrange(tmp_path, tmp_path / "out", train_per_class=2, down_vendor="facebook")
    out = tmp_path / "out"
    classes = {part: sorted(p.name for p in (out / part).iterdir()) for part in ("up_train", "down_train", "down_test")}
    assert classes["down_train"] == classes["down_test"] == sorted(emoji.folder_name(c) for c in emoji.DOWNSTREAM)
    assert set(classes["up_train"]) <= {emoji.folder_name(c) for c in emoji.UPSTREAM}
    assert not any("component" in name for names in classes.values() for name in names)
    train = {p.name for p in (out / "down_train").rglob("*.png")}
    test = {p.name for p in (out / "down_test").rglob("*.png")}
    assert all(name.startswith("facebook-") for name in train | test)  # one vendor downstream
    code = lambda name: name.split("-")[1].removesuffix(".png")  # noqa: E731
    assert not {code(n) for n in train} & {code(n) for n in test}  # no emoji on both sides
    assert not any("1f3fb" in n for n in train | test)  # skin-tone variants only upstream
    assert sum(n for (part, _), n in written.items() if part == "down_train") == 2 * len(emoji.DOWNSTREAM)
    assert sum(n for (part, _), n in written.items() if part.startswith("up")) == 4 * len(emoji.UPSTREAM) * 7  # 6 + 1 variant
    up = next((out / "up_train").rglob("apple-00*.png"), None) or next((out / "up_val").rglob("apple-00*.png"))
    assert Image.open(up).mode == "RGB" and Image.open(up).getpixel((0, 0)) == (255, 255, 255)  # transparent -> white


def test_a_class_with_too_few_emoji_for_the_training_share_is_refused(tmp_path):
    write_packages(tmp_path, per_category=3)
    with pytest.raises(SystemExit, match="has 3 facebook emoji, not more than --train-per-class 3; lower it"):
        emoji.arrange(tmp_path, tmp_path / "out", train_per_class=3, down_vendor="facebook")


SEMI_CLASSES = sorted(emoji.folder_name(c) for c in emoji.UPSTREAM + emoji.DOWNSTREAM)


def write_semi_packages(directory, per_category=10) -> dict[str, str]:
    """Packages in which one People & Body emoji is obsoleted by another, two Travel & Places emoji are drawn alike (as
    two flags of one design are), and Google never drew 0303. Each pair is the emoji its category's hash ranks first
    and last, which a split by code alone would put on opposite sides. Returns {one code: the other} of the pairs."""
    ranked = lambda c: sorted((f"{c:02x}{i:02x}" for i in range(per_category)), key=lambda code: (zlib.crc32(code.encode()), code))  # noqa: E731
    obsolete, alike = (ranked(1)[0], ranked(1)[-1]), (ranked(2)[0], ranked(2)[-1])

    def edit(entries):
        by_code = {e["unified"]: e for e in entries}
        by_code[obsolete[0]]["obsoleted_by"] = obsolete[1]
        by_code["0303"]["has_img_google"] = False
    write_packages(directory, per_category, edit, lambda name: drawing(f"{alike[1]}.png" if name == f"{alike[0]}.png" else name))
    return dict([obsolete, alike])


def test_the_semi_supervised_split_pools_every_vendor_and_keeps_each_emoji_on_one_side(tmp_path):
    pairs = write_semi_packages(tmp_path)
    written = emoji.arrange_semi(tmp_path, tmp_path / "out", test_share=0.3)
    out = tmp_path / "out"
    assert sorted(p.name for p in (out / "train").iterdir()) == sorted(p.name for p in (out / "test").iterdir()) == SEMI_CLASSES
    files = {part: {p.name: p for p in (out / part).rglob("*.png")} for part in emoji.SEMI_PARTS}
    code = lambda name: name.split("-")[1].split("_")[0]  # noqa: E731  <vendor>-<code>_<emoji>.png
    one_emoji = lambda name: name.removesuffix(".png").rsplit("_", 1)[1]  # noqa: E731
    codes = {part: {code(n) for n in names} for part, names in files.items()}
    assert not codes["train"] & codes["test"]  # split by emoji: no emoji in both, in any vendor's drawing
    assert not any("1f3fb" in n for names in files.values() for n in names)  # skin-tone variants left out
    assert not any(c.startswith("09") for names in codes.values() for c in names)  # Component left out
    side = {c: part for part, cs in codes.items() for c in cs}
    assert all(side[a] == side[b] for a, b in pairs.items())  # an obsoleted code and a shared drawing
    # Each file names its emoji (the split's unit, what image_groups reads): its own code, or the first of its pair's.
    pair_of = {**pairs, **{b: a for a, b in pairs.items()}}
    assert all(one_emoji(n) == min(code(n), pair_of.get(code(n), code(n))) for names in files.values() for n in names)
    # Every vendor's drawing of every emoji of the nine classes, once (Google never drew 0303), in its category.
    assert sum(map(len, files.values())) == 9 * 10 * 4 - 1 == sum(n for (p, c), n in written.items() if c != "emoji")
    assert not any(n.startswith("google-0303_") for n in files["train"] | files["test"])
    category = lambda name: emoji.folder_name((emoji.UPSTREAM + emoji.DOWNSTREAM)[int(code(name)[:2], 16)])  # noqa: E731
    assert all(path.parent.name == category(name) for names in files.values() for name, path in names.items())
    # Stratified by emoji: round(0.3 x 10) = 3 of each category's emoji to test, round(0.3 x 9) = 3 where two are one.
    tested = Counter(category(f"x-{c}.png") for c in {pairs.get(c, c) for c in codes["test"]})
    assert tested == Counter({c: 3 for c in SEMI_CLASSES}), tested
    assert written["test", "emoji"] + written["train", "emoji"] == 90
    transparent = next(iter((out / "train" / "smileys-and-emotion").glob("*.png")))  # category 00: drawn transparent
    assert Image.open(transparent).mode == "RGB" and Image.open(transparent).getpixel((0, 0)) == BACKGROUND  # mpp's grey
    with pytest.raises(SystemExit, match=r"has 10 emoji, so --test-share 0.01 leaves one side of the split without it"):
        emoji.arrange_semi(tmp_path, tmp_path / "other", test_share=0.01)


def test_the_semi_supervised_plan_builds_its_shards_in_one_command_and_its_dry_run_checks_them(tmp_path, capsys):
    (tmp_path / "npm").mkdir()
    write_semi_packages(tmp_path / "npm")
    emoji.main(["--mode", "semi", "--packages", str(tmp_path / "npm"), "--out", str(tmp_path / "images"),
                "--shards", str(tmp_path / "shards"), "--test-share", "0.3"])
    summaries = {part: json.loads((tmp_path / "shards" / part / "summary.json").read_text()) for part in emoji.SEMI_PARTS}
    assert all(s["class_names"] == SEMI_CLASSES for s in summaries.values())
    test_images = len(list((tmp_path / "images" / "test").rglob("*.png")))
    assert summaries["test"]["samples"] == test_images and summaries["train"]["samples"] == 359 - test_images
    plan = ROOT / "configs" / "compare" / "emoji_semi.yaml"
    data = [f"pretrain.data.shards={tmp_path / 'shards' / 'train'}", f"pretrain.data.val_shards={tmp_path / 'shards' / 'test'}",
            f"finetune.data.shards={tmp_path / 'shards' / 'train'}", f"finetune.data.val_shards={tmp_path / 'shards' / 'test'}",
            f"output_dir={tmp_path / 'cmp'}"]
    cc = load_compare_config(plan, [*data, "labels_per_class=[3,4]"])
    assert [(arm.name, arm.control) for arm in cc.arms] == [("scratch", None), ("mpp", None), ("mpp-noise", "noise")]
    capsys.readouterr()
    design = compare.check(cc)
    assert (design["test_images"], design["seeds"]) == (test_images, 3)
    out = capsys.readouterr().out
    # image_groups names each test drawing's emoji from its key: the drawings of one emoji are one group, assumed answered
    # alike before the runs, so the design counts the test emoji as its independent images.
    test_emoji = {p.stem.rsplit("_", 1)[1] for p in (tmp_path / "images" / "test").rglob("*.png")}
    assert design["test_groups"] == len(test_emoji) == 27 and design["planned"]["design_effect"] > 3.9
    assert (f"[compare] design: {test_images} test images in 27 groups (image_groups), each group's images assumed "
            f"answered alike, so they count as {test_images / design['planned']['design_effect']:.0f} independent images "
            f"and 3 seed(s) per arm") in out
    # Each budget's picks as its run will make them: 3 and 4 of each of 9 classes, by the plan's 3 folds over all of
    # them; 2.8016 x sqrt(0.2 / n) is what n dev images resolve at 80% power.
    for per_class in (3, 4):
        n = 9 * per_class
        assert (f"[compare] design: Budget {per_class} ({n} labelled images) picks by 3-fold cross-validation "
                f"over all {n}, which tell two candidates apart, 4 times in 5, when they differ by "
                f"{100 * 2.801585 * math.sqrt(0.2 / n):.2f} points or more.") in out
    split = compare.check(load_compare_config(plan, [*data, "labels_per_class=[20]", "dev_folds=0"]))["budgets"]["20"]
    assert (split["images"], split["folds"], split["dev_images"]) == (180, 0, 18)  # round(0.1 x 20) of each class
    assert "Budget 20 (180 labelled images) picks by a dev split of 18 of its 180 labelled images" in capsys.readouterr().out
    assert design["budgets"]["4"] == {"images": 36, "folds": 3, "dev_images": 36,
                                      "dev_resolvable": pytest.approx(2.801585 * math.sqrt(0.2 / 36), rel=1e-5)}
    assert not (tmp_path / "cmp").exists()  # nothing drawn, pretrained or fine-tuned
    smallest = min(Counter(p.parent.name for p in (tmp_path / "images" / "train").rglob("*.png")).values())
    with pytest.raises(compare.CompareError, match=rf"labels_per_class 100 needs that many images of every class, and class \d of .* has {smallest};"):
        compare.check(load_compare_config(plan, data))  # the plan's own budgets need the real data's 196 per class
