"""DataModules: synthetic set, samplers, batch augmentation, path errors, real data (skipped when absent)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from vispe.data.image_datamodule import ImageDataModule, ImageSource, TensorImageDataset, class_interleaved_order
from vispe.data import (
    CIFAR10JpegDataModule,
    DigitsDataModule,
    EpochSeededRandomSampler,
    FashionMNISTDataModule,
    ImageFolderDataModule,
    SyntheticDataModule,
    TorchvisionDataModule,
    load_cifar10_zip,
    random_crop_flip,
    read_idx,
    resolve_data_path,
)


def _data_root() -> Path | None:
    env = os.environ.get("VISPE_TEST_DATA")
    root = Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"
    return root if root.is_dir() else None


DATA = _data_root()
needs_data = pytest.mark.skipif(DATA is None, reason="real data folder (../shared/data or $VISPE_TEST_DATA) not present")


# -- synthetic ---------------------------------------------------------------------------------
def test_synthetic_deterministic_balanced_and_learnable():
    a = SyntheticDataModule(num_classes=4, image_size=16, train_size=200, val_size=100, seed=3)
    b = SyntheticDataModule(num_classes=4, image_size=16, train_size=200, val_size=100, seed=3)
    a.setup(), b.setup()
    assert torch.equal(a.train_set.images, b.train_set.images) and torch.equal(a.train_set.labels, b.train_set.labels)
    assert a.train_set.images.dtype == torch.uint8 and a.train_set.images.shape == (200, 3, 16, 16)
    assert torch.bincount(a.train_set.labels).tolist() == [50] * 4
    c = SyntheticDataModule(num_classes=4, image_size=16, train_size=200, val_size=100, seed=4)
    c.setup()
    assert not torch.equal(a.train_set.images, c.train_set.images)
    # learnable: an independent nearest-class-mean classifier on raw pixels separates held-out samples
    xtr, ytr = a.train_set.images.float().flatten(1), a.train_set.labels
    means = torch.stack([xtr[ytr == k].mean(0) for k in range(4)])
    xva, yva = a.val_set.images.float().flatten(1), a.val_set.labels
    acc = (torch.cdist(xva, means).argmin(1) == yva).float().mean().item()
    assert acc > 0.9, acc


def test_subset_is_class_balanced_and_seeded():
    dm = SyntheticDataModule(num_classes=4, train_size=400, val_size=80, train_subset=40, eval_subset=20, seed=1)
    dm.setup()
    assert len(dm.train_set) == 40 and torch.bincount(dm.train_set.labels).tolist() == [10] * 4
    assert len(dm.val_set) == 20 and torch.bincount(dm.val_set.labels).tolist() == [5] * 4
    dm2 = SyntheticDataModule(num_classes=4, train_size=400, val_size=80, train_subset=40, eval_subset=20, seed=1)
    dm2.setup()
    assert torch.equal(dm.train_set.images, dm2.train_set.images)


def test_normalize_matches_manual():
    dm = SyntheticDataModule(image_size=8)
    x = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    want = (x.float() / 255 - 0.5) / 0.25
    assert torch.allclose(dm.normalize(x), want, atol=1e-6)


# -- sampler and augmentation ------------------------------------------------------------------
def test_epoch_seeded_sampler_depends_only_on_seed_and_epoch():
    data = list(range(50))
    s1, s2 = EpochSeededRandomSampler(data, seed=7), EpochSeededRandomSampler(data, seed=7)
    s1.set_epoch(3), s2.set_epoch(3)
    o1 = list(iter(s1))
    list(iter(s2))  # consuming an epoch does not change the next draw for the same epoch
    s2.set_epoch(3)
    assert o1 == list(iter(s2)) and sorted(o1) == data
    s2.set_epoch(4)
    assert list(iter(s2)) != o1


def test_random_crop_flip_is_a_window_of_the_padded_image():
    torch.manual_seed(0)
    x = torch.arange(4 * 2 * 6 * 6, dtype=torch.float32).view(4, 2, 6, 6)
    pad = 2
    y = random_crop_flip(x, pad=pad, flip=True)
    assert y.shape == x.shape
    xp = torch.nn.functional.pad(x, (pad,) * 4)
    for b in range(4):  # naive search over every window and flip
        hits = [
            (oy, ox, f)
            for oy in range(2 * pad + 1)
            for ox in range(2 * pad + 1)
            for f in (False, True)
            if torch.equal(y[b], (lambda w: w.flip(-1) if f else w)(xp[b, :, oy:oy + 6, ox:ox + 6]))
        ]
        assert hits, f"sample {b} is not a (flipped) window of the padded input"
    z = random_crop_flip(x, pad=0, flip=True)
    assert all(torch.equal(z[b], x[b]) or torch.equal(z[b], x[b].flip(-1)) for b in range(4))


# -- paths and bad input -----------------------------------------------------------------------
def test_missing_paths_fail_at_construction_naming_the_path(tmp_path, monkeypatch):
    missing = tmp_path / "nope" / "cifar10-jpeg"
    with pytest.raises(FileNotFoundError, match="nope"):
        CIFAR10JpegDataModule(data_dir=str(missing))
    monkeypatch.delenv("VISPE_DATA_ROOT", raising=False)
    with pytest.raises(FileNotFoundError, match="VISPE_DATA_ROOT"):
        resolve_data_path(None, "cifar10-jpeg", "CIFAR-10")
    monkeypatch.setenv("VISPE_DATA_ROOT", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "fashion-mnist")):
        FashionMNISTDataModule()
    with pytest.raises(ValueError, match="augment"):
        SyntheticDataModule(augment="bogus")
    with pytest.raises(ValueError, match="unknown torchvision dataset 'NotADataset'"):
        TorchvisionDataModule("NotADataset", root=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="torchvision CIFAR10 not found"):
        dm = TorchvisionDataModule("CIFAR10", root=str(tmp_path))
        dm.setup()


def test_image_folder(tmp_path):
    from PIL import Image

    for split in ("train", "val"):
        for k, colour in enumerate([(255, 0, 0), (0, 0, 255)]):
            d = tmp_path / split / f"class{k}"
            d.mkdir(parents=True)
            for i in range(3):
                Image.new("RGB", (20, 14), colour).save(d / f"{i}.png")
    dm = ImageFolderDataModule(str(tmp_path / "train"), str(tmp_path / "val"), image_size=8, batch_size=4)
    assert dm.num_classes == 2
    dm.setup()
    x, y = next(iter(dm.val_dataloader()))
    assert x.dtype == torch.uint8 and x.shape == (4, 3, 8, 8)
    # red images are class 0, blue ones class 1
    assert torch.equal(y, (x[:, 2, 4, 4] > x[:, 0, 4, 4]).long())


# -- CIFAR-10 zips: a subset decodes its own members only ------------------------------------------
def _cifar_zips(folder: Path, per_class: int) -> Path:
    import io
    import zipfile

    import numpy as np
    from PIL import Image

    from vispe.data import CIFAR10_CLASSES

    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        with zipfile.ZipFile(folder / f"cifar10_{split}_jpeg.zip", "w") as z:
            for c in CIFAR10_CLASSES:
                for i in range(per_class):
                    buf = io.BytesIO()
                    Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(buf, format="JPEG")
                    z.writestr(f"{split}/{c}/{i:04d}.jpg", buf.getvalue())
    return folder


def test_cifar10_subset_decodes_only_its_members_and_equals_the_whole_split_decoded(tmp_path, monkeypatch):
    import vispe.data.image as image_module

    folder = _cifar_zips(tmp_path, per_class=6)
    decoded = []
    read_image = image_module.read_image
    monkeypatch.setattr(image_module, "read_image", lambda data, name: decoded.append(name) or read_image(data, name))
    dm = CIFAR10JpegDataModule(data_dir=str(folder), batch_size=4, train_subset=20, eval_subset=10, seed=3)
    dm.setup("fit")
    assert len(decoded) == 20 + 10  # the kept members of each split (val and test are one subset of the test split)
    assert dm.val_set is dm.test_set
    assert torch.bincount(dm.train_set.labels).tolist() == [2] * 10  # class-balanced, as before
    # the same subset as the whole split decoded and then cut (what the data module did before)
    whole = CIFAR10JpegDataModule(data_dir=str(folder), batch_size=4, seed=3)
    whole.setup("fit")
    x, y = whole.train_set.tensors()
    assert len(y) == 60 and isinstance(whole.train_set, TensorImageDataset)  # no subset: decoded once, here
    cut = dm._subset(TensorImageDataset(x, y), 20, salt=1)
    assert torch.equal(cut.images, dm.train_set.images) and torch.equal(cut.labels, dm.train_set.labels)


# -- real data (skipped without ../shared) -----------------------------------------------------
@needs_data
def test_cifar10_zip_members_decode_with_folder_labels():
    x, y = load_cifar10_zip(DATA / "cifar10-jpeg" / "cifar10_test_jpeg.zip", limit_per_class=2)
    assert x.shape == (20, 3, 32, 32) and x.dtype == torch.uint8
    assert torch.bincount(y).tolist() == [2] * 10
    assert x.float().std() > 20  # real pictures, not blank


@needs_data
def test_cifar10_datamodule_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("VISPE_DATA_ROOT", str(DATA))
    dm = CIFAR10JpegDataModule(batch_size=8, train_subset=20, eval_subset=10)
    assert (dm.num_classes, dm.in_chans, dm.image_size) == (10, 3, 32)


@needs_data
def test_fashion_mnist_idx_and_digits():
    labels = read_idx(DATA / "fashion-mnist" / "t10k-labels-idx1-ubyte.gz")
    assert labels.shape == (10000,) and (torch.bincount(torch.from_numpy(labels.astype("int64"))) == 1000).all()
    dm = DigitsDataModule(data_path=str(DATA / "sklearn-digits" / "digits.csv.gz"), image_size=16)
    dm.setup()
    assert len(dm.train_set) + len(dm.val_set) == 1797
    assert abs(len(dm.val_set) / 1797 - 0.2) < 0.01
    assert dm.train_set.images.max() == 255  # 0..16 counts scaled to 0..255
    x, _ = next(iter(dm.val_dataloader()))
    assert dm.normalize(x).shape[-2:] == (16, 16)


# -- evaluation order: any prefix of the val/test loader is class-stratified ----------------------------
class _SortedLabelImages(ImageSource):
    """Images stored sorted by class (as CIFAR-10's and Fashion-MNIST's test files are), unequal class sizes;
    each image's first pixel encodes its label so a fixed 'model' can score it."""

    def __init__(self, counts):
        super().__init__(locals())
        self.num_classes, self.in_chans, self.image_size = len(counts), 1, 4
        self.mean, self.std = (0.5,), (0.5,)
        self.counts = counts

    def build(self, seed):
        y = torch.cat([torch.full((n,), c) for c, n in enumerate(self.counts)])
        x = torch.zeros(len(y), 1, 4, 4, dtype=torch.uint8)
        x[:, 0, 0, 0] = y.to(torch.uint8)
        x[:, 0, 1, 1] = torch.arange(len(y)) % 7  # a varying pixel: the 'model' below errs on some images
        ds = TensorImageDataset(x, y)
        return ds, ds, ds


def test_first_eval_batches_cover_every_class_in_proportion():
    counts = [100, 100, 100, 100, 100, 100, 100, 100, 100, 100]
    dm = ImageDataModule(_SortedLabelImages(counts), batch_size=64, seed=0)
    dm.setup()
    assert torch.equal(dm.val_set.labels, dm.val_set.labels.sort().values)  # the stored order is class-sorted
    for loader in (dm.val_dataloader(), dm.test_dataloader()):
        seen = []
        for k, (_, y) in enumerate(loader, start=1):
            seen.append(y)
            got = torch.bincount(torch.cat(seen), minlength=10)
            want = torch.tensor(counts) * len(torch.cat(seen)) / sum(counts)
            assert (got - want).abs().max() <= 2, (k, got.tolist())
            if k == 1:  # "the first 64 in class order" would be class 0 only
                assert (got > 0).all(), got.tolist()
    # unequal classes: every prefix of the order still holds each class in proportion
    labels = torch.cat([torch.full((n,), c) for c, n in enumerate([500, 50, 250, 200])])
    order = class_interleaved_order(labels, seed=3)
    assert sorted(order.tolist()) == list(range(len(labels)))
    for k in (8, 40, 100, 333, 999):
        got = torch.bincount(labels[order[:k]], minlength=4).double()
        want = torch.tensor([500, 50, 250, 200]).double() * k / len(labels)
        assert (got - want).abs().max() <= 2, (k, got.tolist(), want.tolist())
    assert torch.equal(order, class_interleaved_order(labels, seed=3))
    assert not torch.equal(order, class_interleaved_order(labels, seed=4))
    # predictions keep the stored order (row i is image i)
    assert torch.equal(torch.cat([y for _, y in dm.predict_dataloader()]), dm.test_set.labels)


def test_full_set_accuracy_unchanged_by_the_eval_order():
    import lightning.pytorch as pl

    class FirstPixel(pl.LightningModule):  # right unless pixel (1, 1) of the image is 0 (normalised: below -0.99)
        def __init__(self):
            super().__init__()
            self.dummy = torch.nn.Parameter(torch.zeros(()))
            self.correct, self.count, self.first = 0, 0, []

        def validation_step(self, batch, batch_idx):
            x, y = batch
            pred = torch.where(x[:, 0, 1, 1] > -0.99, y, (y + 1) % 10)
            self.correct += int((pred == y).sum())
            self.count += len(y)

    dm = ImageDataModule(_SortedLabelImages([120, 80, 100, 100, 60, 140, 100, 100, 90, 110]), batch_size=64, eval_batch_size=64, augment="none")
    dm.setup()
    x, y = dm.val_set.images, dm.val_set.labels
    want = int((dm.normalize(x)[:, 0, 1, 1] > -0.99).sum())  # correct images, in the stored order, all at once
    assert 0.5 * len(y) < want < len(y)
    task = FirstPixel()
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.validate(task, datamodule=dm, verbose=False)
    assert task.count == len(y) and task.correct == want
    # limit_val_batches sees a class-mixed part of the set, not the first classes
    task2 = FirstPixel()
    seen = []
    task2.validation_step = lambda batch, *rest: seen.append(batch[1])
    pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, limit_val_batches=2).validate(task2, datamodule=dm, verbose=False)
    assert len(torch.cat(seen)) == 128 and torch.cat(seen).unique().numel() == 10


# -- one image DataModule over any data set ------------------------------------------------------
def test_former_names_are_the_one_datamodule_over_their_data_set():
    """``SyntheticDataModule(...)`` is ``ImageDataModule(SyntheticImages(...))`` with the former loader defaults; its
    hyper-parameters are plain data that build the same DataModule again, and a checkpoint record reads back both ways."""
    import yaml

    from vispe.data import SyntheticImages
    from vispe.data.image import former_record

    old = SyntheticDataModule(num_classes=3, image_size=8, train_size=48, val_size=24, seed=2)
    new = ImageDataModule(SyntheticImages(num_classes=3, image_size=8, train_size=48, val_size=24), batch_size=32,
                          augment="flip", seed=2)
    assert isinstance(old, ImageDataModule) and (old.batch_size, old.augment) == (new.batch_size, new.augment)
    assert (old.num_classes, old.in_chans, old.image_size, old.mean, old.std) == (3, 3, 8, (0.5,), (0.25,))
    record = {"class_path": "vispe.data.image_datamodule.ImageDataModule", "init_args": dict(new.hparams)}
    yaml.safe_dump(record)  # no object inside: a checkpoint stores it under weights_only
    again = ImageDataModule(**record["init_args"])
    flat = former_record(record)
    assert flat["class_path"] == "vispe.data.image.SyntheticDataModule" and flat["init_args"]["train_size"] == 48
    former = SyntheticDataModule(**{k: v for k, v in flat["init_args"].items() if not k.startswith("_")})
    for dm in (old, new, again, former):
        dm.setup()
    for dm in (new, again, former):
        assert torch.equal(dm.train_set.images, old.train_set.images) and torch.equal(dm.val_set.labels, old.val_set.labels)


def test_datamodule_refuses_what_is_not_a_data_set():
    with pytest.raises(ValueError, match=r"dataset must be an ImageSource \(CIFAR10Images, .*SyntheticImages.*got str 'cifar10'"):
        ImageDataModule("cifar10")
    with pytest.raises(ValueError, match=r"class_path 'torch.nn.Linear' is not an ImageSource; use one of"):
        ImageDataModule({"class_path": "torch.nn.Linear", "init_args": {}})
