"""benchmarks/emoji.py on small packages of the npm layout: the split by category and by emoji, no sibling of a test
image among the training images, RGB on white, and a refusal where a class is too small."""

import importlib.util
import io
import json
import tarfile

import pytest
from PIL import Image

from conftest import ROOT

spec = importlib.util.spec_from_file_location("emoji_benchmark", ROOT / "benchmarks" / "emoji.py")
emoji = importlib.util.module_from_spec(spec)
spec.loader.exec_module(emoji)


def png(colour, alpha=255) -> bytes:
    out = io.BytesIO()
    Image.new("RGBA", (64, 64), (*colour, alpha)).save(out, format="PNG")
    return out.getvalue()


def write_packages(directory, per_category=6):
    entries = []
    for c, category in enumerate(emoji.UPSTREAM + emoji.DOWNSTREAM + ("Component",)):
        for i in range(per_category):
            code = f"{c:02x}{i:02x}"
            skin = {"1F3FB": {"image": f"{code}-1f3fb.png"}} if i == 0 else None
            entries.append({"unified": code, "image": f"{code}.png", "category": category, "skin_variations": skin,
                            **{f"has_img_{v}": True for v in emoji.VENDORS}})
    for vendor in emoji.VENDORS:
        with tarfile.open(directory / f"emoji-datasource-{vendor}-{emoji.VERSION}.tgz", "w:gz") as tar:
            def add(name, data):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            add("package/emoji.json", json.dumps(entries).encode())
            for e in entries:
                for name in emoji.renditions(e):
                    add(f"package/img/{vendor}/64/{name}", png((200, 10, 10), alpha=0 if name.startswith("00") else 255))


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
