"""The one image decoder (vispe.files.read_image / image_to_uint8): every PIL mode converted by its stated rule or
refused naming the file and the mode; training (ImageFolderDataModule), evaluation sets and the sweep read the same."""
from __future__ import annotations

import zipfile

import numpy as np
import pytest
import torch
from PIL import Image

from vispe.files import IMAGE_MODE_RULES, ImageDecodeError, image_to_uint8, read_image


def _save(img: Image.Image, path) -> str:
    img.save(path)
    return str(path)


# ------------------------------------------------------------------------------------------
# conversion rules, mode by mode (expected values computed from the rule, not from the decoder)
# ------------------------------------------------------------------------------------------
def test_images_16bit_png_scaled_by_bit_depth(tmp_path):
    v = np.array([[0, 257, 32639], [65535, 1000, 40000]], dtype=np.uint16)
    x = read_image(_save(Image.fromarray(v), tmp_path / "a.png"))
    assert x.dtype == torch.uint8 and x.shape == (1, 2, 3)
    assert x[0].tolist() == np.rint(v.astype(np.float64) * 255 / 65535).astype(int).tolist()  # 32639 -> 127, not clipped to 255


def test_images_int32_read_as_16bit_and_out_of_range_refused(tmp_path):
    ok = Image.fromarray(np.array([[0, 65535]], dtype=np.int32))
    assert ok.mode == "I"
    assert image_to_uint8(ok, "ok.tif")[0].tolist() == [[0, 255]]
    with pytest.raises(ImageDecodeError, match=r"'big.tif'.*'I'.*\[-5, 70000\].*\[0, 65535\]"):
        image_to_uint8(Image.fromarray(np.array([[-5, 70000]], dtype=np.int32)), "big.tif")


def test_images_float_tiff_in_unit_range(tmp_path):
    v = np.array([[0.0, 0.25, 0.5, 1.0]], dtype=np.float32)
    x = read_image(_save(Image.fromarray(v), tmp_path / "f.tif"))
    assert x[0].tolist() == [[0, 64, 128, 255]]  # round(v * 255), half to even


@pytest.mark.parametrize("value,needle", [(float("nan"), "non-finite"), (float("inf"), "non-finite"), (2.0, r"\[0.5, 2\]"),
                                          (-0.5, r"\[-0.5, 0.5\]")])
def test_images_float_non_finite_or_out_of_range_refused_naming_the_file(tmp_path, value, needle):
    v = np.full((4, 4), 0.5, dtype=np.float32)
    v[1, 2] = value
    path = _save(Image.fromarray(v), tmp_path / "bad.tif")
    with pytest.raises(ImageDecodeError, match=needle) as info:
        read_image(path)
    assert "bad.tif" in str(info.value) and "'F'" in str(info.value)


def test_images_alpha_composited_over_black():
    rgba = np.zeros((1, 2, 4), dtype=np.uint8)
    rgba[0, 0] = (200, 100, 50, 255)  # opaque: as is
    rgba[0, 1] = (200, 100, 50, 51)  # 20 % alpha: 0.2 x the colour
    x = image_to_uint8(Image.fromarray(rgba, "RGBA"))
    assert x[:, 0, 0].tolist() == [200, 100, 50] and x[:, 0, 1].tolist() == [40, 20, 10]
    la = Image.fromarray(np.array([[[100, 255], [100, 0]]], dtype=np.uint8), "LA")
    assert image_to_uint8(la)[0].tolist() == [[100, 0]]


def test_images_palette_with_and_without_transparency():
    p = Image.new("P", (2, 1))
    p.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)
    p.putpixel((0, 0), 0)
    p.putpixel((1, 0), 1)
    assert image_to_uint8(p)[:, 0].T.tolist() == [[255, 0, 0], [0, 255, 0]]
    p.info["transparency"] = 1  # palette entry 1 fully transparent: composited over black
    assert image_to_uint8(p)[:, 0].T.tolist() == [[255, 0, 0], [0, 0, 0]]


def test_images_one_bit_cmyk_and_rgbx():
    one = Image.fromarray(np.array([[0, 1]], dtype=bool))
    assert one.mode == "1" and image_to_uint8(one)[0].tolist() == [[0, 255]]
    cmyk = Image.new("CMYK", (1, 1), (0, 255, 0, 0))  # full magenta: R = 255, G = 0, B = 255
    assert image_to_uint8(cmyk)[:, 0, 0].tolist() == [255, 0, 255]
    assert image_to_uint8(Image.new("RGB", (1, 1), (1, 2, 3)).convert("RGBX"))[:, 0, 0].tolist() == [1, 2, 3]


def test_images_mode_without_a_rule_refused_naming_file_and_mode():
    class Fake:
        mode = "I;16S"

    with pytest.raises(ImageDecodeError, match=r"'x.tif'.*'I;16S'.*modes vispe reads"):
        image_to_uint8(Fake(), "x.tif")
    assert set(IMAGE_MODE_RULES) >= {"L", "RGB", "RGBA", "LA", "P", "PA", "1", "CMYK", "I;16", "I", "F"}


def test_images_decompression_bomb_refused_naming_the_file(tmp_path, monkeypatch):
    path = _save(Image.new("L", (40, 40)), tmp_path / "bomb.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 1600 px > 2 x 100: PIL's bomb error
    with pytest.raises(ImageDecodeError, match=r"bomb.png.*decompression bomb.*MAX_IMAGE_PIXELS"):
        read_image(path)


def test_images_truncated_or_not_an_image_named(tmp_path):
    path = _save(Image.fromarray(np.zeros((64, 64, 3), dtype=np.uint8)), tmp_path / "cut.png")
    data = open(path, "rb").read()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(ImageDecodeError, match=r"cut.png.*not a readable image"):
        read_image(path)
    (tmp_path / "text.jpg").write_text("hello")
    with pytest.raises(ImageDecodeError, match=r"text.jpg.*not a readable image"):
        read_image(tmp_path / "text.jpg")
    with pytest.raises(FileNotFoundError, match="missing.png"):
        read_image(tmp_path / "missing.png")


# ------------------------------------------------------------------------------------------
# one decoder everywhere: training, evaluation sets, the sweep
# ------------------------------------------------------------------------------------------
def _folder(root, make):
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        make(root / c)
    return root


def test_images_training_and_evaluation_read_the_same_pixels(tmp_path):
    from vispe.data import ImageFolderDataModule
    from vispe.data.eval_sets import open_eval_set

    v16 = np.full((8, 8), 32639, dtype=np.uint16)  # 127 of 255
    png16 = _folder(tmp_path / "png16", lambda d: Image.fromarray(v16).save(d / "0.png"))
    ftif = _folder(tmp_path / "ftif", lambda d: Image.fromarray(np.full((8, 8), 0.25, dtype=np.float32)).save(d / "0.tif"))
    for root, mean in ((png16, 127.0), (ftif, 64.0)):
        es = open_eval_set(str(root))
        assert es.load([0])[0].float().mean().item() == mean
        dm = ImageFolderDataModule(str(root), str(root), image_size=8)
        dm.setup()
        x, _ = dm.train_set[0]
        assert x.dtype == torch.uint8 and x.shape == (3, 8, 8) and x.float().mean().item() == mean


def test_images_training_refuses_a_nan_image_naming_it(tmp_path):
    from vispe.data import ImageFolderDataModule

    def make(d):
        v = np.full((8, 8), 0.5, dtype=np.float32)
        v[0, 0] = np.nan
        Image.fromarray(v).save(d / "nan.tif")

    root = _folder(tmp_path / "nan", make)
    dm = ImageFolderDataModule(str(root), str(root), image_size=8)
    dm.setup()
    with pytest.raises(ImageDecodeError, match=r"nan.tif.*non-finite"):
        dm.train_set[0]


def test_images_zip_member_and_csv_list_with_bom(tmp_path):
    from vispe.data.eval_sets import open_eval_set

    v16 = np.full((4, 4), 65535, dtype=np.uint16)
    Image.fromarray(v16).save(tmp_path / "w.png")
    with zipfile.ZipFile(tmp_path / "set.zip", "w") as z:
        z.write(tmp_path / "w.png", "test/a/w.png")
        z.writestr("test/b/broken.png", b"not a png")
    es = open_eval_set(str(tmp_path / "set.zip"))
    assert es.load([0])[0].float().mean().item() == 255.0
    with pytest.raises(ImageDecodeError, match=r"set.zip:test/b/broken.png"):
        es.load([1])
    (tmp_path / "list.csv").write_bytes(b"\xef\xbb\xbfpath,label\nw.png,a\nw.png,b\n")  # a spreadsheet's UTF-8 BOM
    es = open_eval_set(str(tmp_path / "list.csv"))
    assert es.classes == ("a", "b") and len(es) == 2
    (tmp_path / "bad.csv").write_bytes(b"path,label\n\xff\xfe.png,a\n")
    with pytest.raises(ValueError, match=r"bad.csv.*not UTF-8"):
        open_eval_set(str(tmp_path / "bad.csv"))


def test_images_torchvision_dataset_without_a_root_refused(tmp_path):
    from vispe.data.eval_sets import open_eval_set

    with pytest.raises(ValueError, match=r"torchvision:FakeData is not a dataset read from disk"):
        open_eval_set("torchvision:FakeData", str(tmp_path))
