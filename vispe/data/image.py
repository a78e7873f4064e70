"""Image classification data sets for :class:`vispe.data.ImageDataModule`: CIFAR-10 (JPEG zips), torchvision
datasets, ImageFolder trees, Fashion-MNIST (IDX), scikit-learn digits (csv.gz) and a synthetic set that needs no files.

Each is an :class:`~vispe.data.image_datamodule.ImageSource`: ``ImageDataModule(dataset=CIFAR10Images(...),
batch_size=...)``; in a config, ``data.init_args.dataset: {class_path: vispe.data.CIFAR10Images, init_args: {...}}``.
Locations come from arguments or ``$VISPE_DATA_ROOT``; missing or damaged files raise when the source is built
(LightningCLI builds the DataModule before the Trainer runs anything).

The former per-dataset DataModules (``CIFAR10JpegDataModule``, ``SyntheticDataModule``, ...) stay importable: each is
``ImageDataModule`` over its source, with that source's arguments and its former loader defaults.
"""
from __future__ import annotations

import inspect
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ..files import DamagedFileError, ImageDecodeError, check_idx, check_zip, read_idx, read_image
from .image_datamodule import (
    ImageDataModule,
    ImageSource,
    LazyImageDataset,
    TensorImageDataset,
    channel_fix,
    make_pil_to_uint8,
)
from .loading import resolve_data_path

__all__ = [
    "CIFAR10_CLASSES",
    "CIFAR10Images",
    "DigitsImages",
    "FashionMNISTImages",
    "FolderImages",
    "SyntheticImages",
    "TorchvisionImages",
    "CIFAR10Zip",
    "load_cifar10_zip",
    # former names: ImageDataModule over one source
    "CIFAR10JpegDataModule",
    "DigitsDataModule",
    "FashionMNISTDataModule",
    "ImageFolderDataModule",
    "SyntheticDataModule",
    "TorchvisionDataModule",
]

#: the flag that sets a source's argument under ``vispe fit`` (named in "not found" errors)
_FLAG = "--data.init_args.dataset.init_args.{}"

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
FASHION_MNIST_MEAN, FASHION_MNIST_STD = (0.2860,), (0.3530,)


def _image_shape(num_classes: int, in_chans: int, image_size: int) -> tuple[int, int, int]:
    """``(num_classes, in_chans, image_size)`` as ints, refused when a count is below its minimum (at construction)."""
    for name, value, low in (("num_classes", num_classes, 1), ("in_chans", in_chans, 1), ("image_size", image_size, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(num_classes), int(in_chans), int(image_size)


# ------------------------------------------------------------------------------------------
# CIFAR-10 from the JPEG zips
# ------------------------------------------------------------------------------------------
def load_cifar10_zip(zip_path: str | Path, limit_per_class: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode ``<split>/<class>/NNNN.jpg`` members straight from the zip -> uint8 (N, 3, 32, 32), labels."""
    return CIFAR10Zip(zip_path, limit_per_class).select().tensors()


class CIFAR10Zip(LazyImageDataset):
    """The ``<split>/<class>/NNNN.jpg`` members of a CIFAR-10 zip, labelled from their folder names on construction
    and decoded by :meth:`select`: a ``train_subset`` / ``eval_subset`` decodes its own images only (the whole
    training split is 50,000 JPEGs, ~20 s on a 2-core CPU)."""

    def __init__(self, zip_path: str | Path, limit_per_class: int | None = None) -> None:
        check_zip(zip_path, "CIFAR-10 archive", member_suffix=".jpg")
        self.zip_path = zip_path
        with zipfile.ZipFile(zip_path) as z:
            names = sorted(n for n in z.namelist() if n.lower().endswith(".jpg"))
        if limit_per_class is not None:
            count: dict[str, int] = {}
            kept = []
            for n in names:
                c = n.split("/")[-2]
                if count.get(c, 0) < limit_per_class:
                    kept.append(n)
                    count[c] = count.get(c, 0) + 1
            names = kept
        if not names:
            raise ValueError(f"{zip_path} holds no .jpg members")
        for n in names:
            if n.split("/")[-2] not in CIFAR10_CLASSES:
                raise ValueError(f"member {n!r} of {zip_path} is not in a CIFAR-10 class folder {CIFAR10_CLASSES}")
        self.names = names
        self.labels = torch.tensor([CIFAR10_CLASSES.index(n.split("/")[-2]) for n in names], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.names)

    def select(self, index: torch.Tensor | None = None) -> TensorImageDataset:
        names = self.names if index is None else [self.names[i] for i in index.tolist()]
        images = np.empty((len(names), 32, 32, 3), dtype=np.uint8)
        with zipfile.ZipFile(self.zip_path) as z:
            for i, n in enumerate(names):
                try:
                    data = z.read(n)
                except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as err:  # CRC mismatch, cut member
                    raise DamagedFileError(self.zip_path, f"member {n!r} is damaged ({type(err).__name__}: {err})", "download or copy the archive again") from None
                try:
                    img = channel_fix(read_image(data, f"{self.zip_path}:{n}"), 3)  # the one decoder (its mode rules)
                except ImageDecodeError as err:
                    raise DamagedFileError(self.zip_path, f"member {n!r} is damaged ({err.problem})", "download or copy the archive again") from None
                if tuple(img.shape[-2:]) != (32, 32):
                    raise DamagedFileError(self.zip_path, f"member {n!r} is {img.shape[-1]}x{img.shape[-2]} px, CIFAR-10 images are 32x32", "check that it is the CIFAR-10 JPEG archive")
                images[i] = img.permute(1, 2, 0).numpy()
        labels = self.labels if index is None else self.labels[index]
        return TensorImageDataset(torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), labels.clone())


class CIFAR10Images(ImageSource):
    """CIFAR-10 read from ``cifar10_train_jpeg.zip`` / ``cifar10_test_jpeg.zip`` (members decoded in memory).

    Validation and test both use the official test split (``eval_subset`` keeps a fixed,
    class-balanced part of it). Images are 32 px; ``image_size`` resizes them (bicubic).

    Args:
        data_dir: folder with the two zips (default ``$VISPE_DATA_ROOT/cifar10-jpeg``).
        image_size: model input size in pixels.
        cache_dir: if set, decoded arrays are cached there as ``.npz`` (decoding 60k JPEGs takes ~10 s).
    """

    def __init__(self, data_dir: str | None = None, image_size: int = 32, cache_dir: str | None = None) -> None:
        super().__init__(locals())
        self.data_dir = resolve_data_path(data_dir, "cifar10-jpeg", "CIFAR-10 JPEG data", flag=_FLAG.format("data_dir"))
        for split in ("train", "test"):
            zp = self.data_dir / f"cifar10_{split}_jpeg.zip"
            if not zp.is_file():
                raise FileNotFoundError(f"CIFAR-10 {split} archive not found at {str(zp)!r}")
            check_zip(zp, f"CIFAR-10 {split} archive", member_suffix=".jpg")  # a damaged zip fails here, not in setup
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.num_classes, self.in_chans, self.image_size = _image_shape(10, 3, image_size)
        self.mean, self.std = CIFAR_MEAN, CIFAR_STD

    def _load(self, split: str) -> Dataset:
        cache = self.cache_dir / f"cifar10_{split}_uint8.npz" if self.cache_dir else None
        if cache is not None and cache.is_file():
            check_zip(cache, "CIFAR-10 decoded cache (.npz; delete it and it is rebuilt)")
            with np.load(cache, allow_pickle=False) as f:
                return TensorImageDataset(torch.from_numpy(f["x"]), torch.from_numpy(f["y"]))
        members = CIFAR10Zip(self.data_dir / f"cifar10_{split}_jpeg.zip")
        if cache is None:
            return members  # decoded by the data module: the subset it keeps, or the whole split once
        x, y = members.select().tensors()
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp.npz")
        np.savez(tmp, x=x.numpy(), y=y.numpy())
        tmp.replace(cache)
        return TensorImageDataset(x, y)

    def build(self, seed: int) -> tuple[Dataset, Dataset, Dataset]:
        train = self._load("train")
        test = self._load("test")
        return train, test, test


# ------------------------------------------------------------------------------------------
# torchvision datasets by name / ImageFolder
# ------------------------------------------------------------------------------------------
class _Uint8Wrap(Dataset):
    """Apply a PIL -> uint8 CHW transform on top of a torchvision dataset returning ``(img, label)``."""

    def __init__(self, ds: Any, image_size: int, in_chans: int) -> None:
        self.ds = ds
        self.tf = make_pil_to_uint8(image_size, in_chans)
        self.targets = getattr(ds, "targets", None)

    def __len__(self) -> int:
        return len(self.ds)

    def _name(self, i: int) -> str:
        samples = getattr(self.ds, "samples", None)  # ImageFolder: the file
        return str(samples[i][0]) if samples is not None else f"{type(self.ds).__name__} item {i}"

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        img, label = self.ds[i]
        return self.tf(img, self._name(i)), int(label)


class TorchvisionImages(ImageSource):
    """Any ``torchvision.datasets`` class by name (``'CIFAR10'``, ``'CIFAR100'``, ``'SVHN'``, ``'STL10'`` ...).

    Datasets with a ``train=`` flag use ``train=True/False``; those with ``split=`` use
    ``train_split``/``test_split``. Validation uses the test split. ``download=True`` fetches the
    files (needs internet; in ``prepare_data``); without it a missing dataset raises before training.
    """

    def __init__(
        self,
        name: str,
        root: str | None = None,
        download: bool = False,
        num_classes: int = 10,
        in_chans: int = 3,
        image_size: int = 32,
        train_split: str = "train",
        test_split: str = "test",
        mean: tuple[float, ...] = IMAGENET_MEAN,
        std: tuple[float, ...] = IMAGENET_STD,
    ) -> None:
        super().__init__(locals())
        import torchvision.datasets as tvd

        cls = getattr(tvd, name, None)
        if not (isinstance(cls, type) and issubclass(cls, Dataset)):
            valid = sorted(n for n in dir(tvd) if isinstance(getattr(tvd, n), type) and issubclass(getattr(tvd, n), Dataset) and n[0].isupper())
            raise ValueError(f"unknown torchvision dataset {name!r}; choose one of {valid}")
        self.dataset_cls = cls
        self.name = name
        if download:
            self.root = Path(root if root else ".")
        else:
            self.root = resolve_data_path(root, name.lower(), f"torchvision dataset {name}", arg="root", flag=_FLAG.format("root"))
        self.download = download
        self.train_split, self.test_split = train_split, test_split
        self.num_classes, self.in_chans, self.image_size = _image_shape(num_classes, in_chans, image_size)
        self.mean, self.std = tuple(mean), tuple(std)

    def _make(self, train: bool) -> Dataset:
        import inspect

        params = inspect.signature(self.dataset_cls.__init__).parameters
        kwargs: dict[str, Any] = {}
        if "train" in params:
            kwargs["train"] = train
        elif "split" in params:
            kwargs["split"] = self.train_split if train else self.test_split
        if "download" in params:
            kwargs["download"] = self.download
        try:
            ds = self.dataset_cls(str(self.root), **kwargs)
        except RuntimeError as err:  # torchvision's "Dataset not found or corrupted"
            raise FileNotFoundError(f"torchvision {self.name} not found under {str(self.root)!r}: {err}") from err
        return _Uint8Wrap(ds, self.image_size, self.in_chans)

    def prepare(self) -> None:
        if self.download:
            self._make(True)
            self._make(False)

    def build(self, seed: int) -> tuple[Dataset, Dataset, Dataset]:
        test = self._make(False)
        return self._make(True), test, test


class FolderImages(ImageSource):
    """``torchvision.datasets.ImageFolder`` trees (``<root>/<class>/<image>``) for train / val / (test).

    Images are resized (shorter side, bicubic) and centre-cropped to ``image_size`` per sample;
    the random crop/flip augmentation then runs on the batch. ``test_dir`` defaults to ``val_dir``.
    """

    def __init__(
        self,
        train_dir: str,
        val_dir: str,
        test_dir: str | None = None,
        image_size: int = 224,
        in_chans: int = 3,
        mean: tuple[float, ...] = IMAGENET_MEAN,
        std: tuple[float, ...] = IMAGENET_STD,
    ) -> None:
        super().__init__(locals())
        self.train_dir = resolve_data_path(train_dir, "", "ImageFolder train_dir", arg="train_dir", flag=_FLAG.format("train_dir"))
        self.val_dir = resolve_data_path(val_dir, "", "ImageFolder val_dir", arg="val_dir", flag=_FLAG.format("val_dir"))
        self.test_dir = (resolve_data_path(test_dir, "", "ImageFolder test_dir", arg="test_dir", flag=_FLAG.format("test_dir"))
                         if test_dir else self.val_dir)
        classes = sorted(p.name for p in self.train_dir.iterdir() if p.is_dir())
        if not classes:
            raise ValueError(f"ImageFolder train_dir {str(self.train_dir)!r} has no class sub-folders")
        for name, folder in (("val_dir", self.val_dir), ("test_dir", self.test_dir)):
            other = sorted(p.name for p in folder.iterdir() if p.is_dir())
            if other != classes:  # checked here (a directory listing), not when setup builds the datasets
                raise ValueError(f"class folders of {name} {str(folder)!r} {other} differ from train_dir's {classes}")
        self.classes = tuple(classes)
        self.num_classes, self.in_chans, self.image_size = _image_shape(len(classes), in_chans, image_size)
        self.mean, self.std = tuple(mean), tuple(std)

    def build(self, seed: int) -> tuple[Dataset, Dataset, Dataset]:
        from torchvision.datasets import ImageFolder

        from ..files import image_loader

        def make(root: Path) -> Dataset:
            ds = ImageFolder(str(root), loader=image_loader)  # vispe's one decoder (mode rules, bombs, non-finite pixels)
            if tuple(ds.classes) != self.classes:
                raise ValueError(f"class folders of {str(root)!r} {ds.classes} differ from train_dir's {self.classes}")
            return _Uint8Wrap(ds, self.image_size, self.in_chans)

        return make(self.train_dir), make(self.val_dir), make(self.test_dir)


# ------------------------------------------------------------------------------------------
# Fashion-MNIST (IDX) and scikit-learn digits (csv.gz)
# ------------------------------------------------------------------------------------------
class FashionMNISTImages(ImageSource):
    """Fashion-MNIST from the four official IDX files (``.gz`` or decompressed), 28 px grey.

    ``in_chans=3`` repeats the grey channel; validation and test use the official test split.
    """

    def __init__(self, data_dir: str | None = None, image_size: int = 28, in_chans: int = 1) -> None:
        super().__init__(locals())
        self.data_dir = resolve_data_path(data_dir, "fashion-mnist", "Fashion-MNIST IDX files", flag=_FLAG.format("data_dir"))
        self.files = {k: self._find(k) for k in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
        for prefix in ("train", "t10k"):
            images, labels = (check_idx(self.files[f"{prefix}-{kind}"]) for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"))
            if len(images) != 3 or len(labels) != 1 or images[0] != labels[0]:
                raise DamagedFileError(self.files[f"{prefix}-labels-idx1-ubyte"], f"holds labels of shape {labels} for images of shape {images}",
                                       "use the images and labels files of the same split")
        self.num_classes, self.in_chans, self.image_size = _image_shape(10, in_chans, image_size)
        self.mean, self.std = FASHION_MNIST_MEAN, FASHION_MNIST_STD

    def _find(self, stem: str) -> Path:
        for name in (stem + ".gz", stem):
            if (self.data_dir / name).is_file():
                check_idx(self.data_dir / name, f"Fashion-MNIST file {stem}")  # a truncated file fails here, not in setup
                return self.data_dir / name
        raise FileNotFoundError(f"Fashion-MNIST file {stem}(.gz) not found in {str(self.data_dir)!r}")

    def _split(self, prefix: str) -> TensorImageDataset:
        x = torch.from_numpy(read_idx(self.files[f"{prefix}-images-idx3-ubyte"]).copy())[:, None]
        y = torch.from_numpy(read_idx(self.files[f"{prefix}-labels-idx1-ubyte"]).astype(np.int64))
        if self.in_chans != 1:
            x = x.expand(-1, self.in_chans, -1, -1).contiguous()
        return TensorImageDataset(x, y)

    def build(self, seed: int) -> tuple[Dataset, Dataset, Dataset]:
        test = self._split("t10k")
        return self._split("train"), test, test


class DigitsImages(ImageSource):
    """scikit-learn's 8x8 digits (``digits.csv.gz``: 64 pixel columns 0..16 + label), a seeded split.

    Pixel counts 0..16 are scaled to 0..255. ``val_fraction`` of the 1,797 samples (class-balanced,
    seeded by the data module's ``seed``) form the validation/test split. ``image_size`` upsamples (e.g. 16 for patch 4).
    """

    def __init__(self, data_path: str | None = None, image_size: int = 8, in_chans: int = 1, val_fraction: float = 0.2) -> None:
        super().__init__(locals())
        path = resolve_data_path(data_path, "sklearn-digits/digits.csv.gz", "scikit-learn digits csv.gz", arg="data_path",
                                 flag=_FLAG.format("data_path"))
        if path.is_dir():
            path = path / "digits.csv.gz"
            if not path.is_file():
                raise FileNotFoundError(f"digits.csv.gz not found in {str(path.parent)!r}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.data_path = path
        self._table = self._read_table()  # 1,797 rows: read now so a damaged file fails at construction
        self.val_fraction = float(val_fraction)
        self.num_classes, self.in_chans, self.image_size = _image_shape(10, in_chans, image_size)
        self.mean, self.std = (0.5,), (0.5,)

    def _read_table(self) -> np.ndarray:
        try:
            a = np.loadtxt(self.data_path, delimiter=",", ndmin=2)
        except (OSError, EOFError, ValueError, zlib.error) as err:
            raise DamagedFileError(self.data_path, f"is not a readable digits csv(.gz) ({type(err).__name__}: {err})", "download the file again") from None
        if a.shape[1] != 65:
            raise DamagedFileError(self.data_path, f"has {a.shape[1]} columns, expected 65 (64 pixels + label)", "check that it is scikit-learn's digits.csv.gz")
        return a

    def build(self, seed: int) -> tuple[Dataset, Dataset, Dataset]:
        a = self._table
        x = torch.from_numpy(np.round(a[:, :64] * (255.0 / 16.0)).astype(np.uint8)).view(-1, 1, 8, 8)
        y = torch.from_numpy(a[:, 64].astype(np.int64))
        if self.in_chans != 1:
            x = x.expand(-1, self.in_chans, -1, -1).contiguous()
        g = torch.Generator().manual_seed(seed)
        val_idx = []
        for c in range(10):  # class-balanced hold-out
            idx = (y == c).nonzero().flatten()
            idx = idx[torch.randperm(len(idx), generator=g)]
            val_idx.append(idx[: int(round(len(idx) * self.val_fraction))])
        val_mask = torch.zeros(len(y), dtype=torch.bool)
        val_mask[torch.cat(val_idx)] = True
        val = TensorImageDataset(x[val_mask], y[val_mask])
        return TensorImageDataset(x[~val_mask], y[~val_mask]), val, val


# ------------------------------------------------------------------------------------------
# Synthetic: learnable without any file
# ------------------------------------------------------------------------------------------
class SyntheticImages(ImageSource):
    """Generated images, no files: each class is a fixed random low-frequency colour pattern
    (a 4x4 template upsampled bilinearly), each sample adds Gaussian noise and a random brightness
    shift. Deterministic given the data module's ``seed``; a small ViT separates the classes within a few steps.
    """

    def __init__(self, num_classes: int = 4, image_size: int = 16, in_chans: int = 3, train_size: int = 256,
                 val_size: int = 128, noise: float = 0.35) -> None:
        super().__init__(locals())
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        if image_size < 4:
            raise ValueError(f"image_size must be >= 4, got {image_size}")
        self.num_classes, self.in_chans, self.image_size = _image_shape(num_classes, in_chans, image_size)
        self.train_size, self.val_size, self.noise = int(train_size), int(val_size), float(noise)
        self.mean, self.std = (0.5,), (0.25,)

    def generate(self, n: int, stream: int, seed: int) -> TensorImageDataset:
        g_tpl = torch.Generator().manual_seed(seed)
        templates = torch.rand(self.num_classes, self.in_chans, 4, 4, generator=g_tpl)
        templates = F.interpolate(templates, size=(self.image_size,) * 2, mode="bilinear", align_corners=False)
        g = torch.Generator().manual_seed(seed * 1009 + stream)
        y = torch.arange(n) % self.num_classes
        y = y[torch.randperm(n, generator=g)]
        x = templates[y]
        x = x + self.noise * torch.randn(x.shape, generator=g) + 0.1 * torch.randn(n, 1, 1, 1, generator=g)
        x = (x.clamp(0, 1) * 255).round().to(torch.uint8)
        return TensorImageDataset(x, y)

    def build(self, seed: int) -> tuple[Dataset, Dataset, Dataset]:
        val = self.generate(self.val_size, stream=2, seed=seed)
        return self.generate(self.train_size, stream=1, seed=seed), val, val


# ------------------------------------------------------------------------------------------
# Former names: ImageDataModule over one source, with that source's arguments and former loader defaults
# ------------------------------------------------------------------------------------------
def _former_datamodule(name: str, source: type[ImageSource], **loader_defaults: Any) -> type[ImageDataModule]:
    """``name(**source_args, **loader_args)`` = ``ImageDataModule(source(**source_args), **loader_args)``: the
    per-dataset DataModule of earlier configs, checkpoints and scripts, with no arguments of its own."""
    source_params = [p for p in inspect.signature(source.__init__).parameters.values() if p.name != "self"]
    loader_params = [p.replace(default=loader_defaults.get(p.name, p.default), kind=inspect.Parameter.KEYWORD_ONLY)
                     for p in inspect.signature(ImageDataModule.__init__).parameters.values() if p.name not in ("self", "dataset")]

    def __init__(self: ImageDataModule, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        values.pop("self")
        src = source(**{p.name: values.pop(p.name) for p in source_params})
        ImageDataModule.__init__(self, src, **values)

    signature = inspect.Signature([inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *source_params, *loader_params])
    __init__.__signature__ = signature  # type: ignore[attr-defined]
    doc = f"``ImageDataModule(dataset={source.__name__}(...))`` under its former name (earlier configs and checkpoints)."
    return type(name, (ImageDataModule,), {"__init__": __init__, "__doc__": doc, "__module__": __name__, "former_source": source})


CIFAR10JpegDataModule = _former_datamodule("CIFAR10JpegDataModule", CIFAR10Images)
TorchvisionDataModule = _former_datamodule("TorchvisionDataModule", TorchvisionImages)
ImageFolderDataModule = _former_datamodule("ImageFolderDataModule", FolderImages, batch_size=64)
FashionMNISTDataModule = _former_datamodule("FashionMNISTDataModule", FashionMNISTImages)
DigitsDataModule = _former_datamodule("DigitsDataModule", DigitsImages, batch_size=64, augment="none")
SyntheticDataModule = _former_datamodule("SyntheticDataModule", SyntheticImages, batch_size=32, augment="flip")

_FORMER_NAMES = (CIFAR10JpegDataModule, TorchvisionDataModule, ImageFolderDataModule, FashionMNISTDataModule,
                 DigitsDataModule, SyntheticDataModule)


def former_record(record: dict[str, Any]) -> dict[str, Any]:
    """A recorded ``ImageDataModule`` (``{'class_path', 'init_args': {'dataset': {...}, ...}}``, as checkpoints keep
    it) in the flat form of its former per-dataset name (``CIFAR10JpegDataModule`` with ``data_dir`` ...), which
    earlier checkpoints hold and readers of records understand; any other record unchanged."""
    init = dict(record.get("init_args") or {})
    dataset = init.get("dataset")
    if not str(record.get("class_path", "")).endswith(".ImageDataModule") or not isinstance(dataset, dict):
        return record
    path = str(dataset.get("class_path", ""))
    former = next((c for c in _FORMER_NAMES if path in (f"{c.former_source.__module__}.{c.former_source.__name__}",
                                                         f"vispe.data.{c.former_source.__name__}")), None)
    if former is None:
        return record
    init.pop("dataset")
    return {**record, "class_path": f"{former.__module__}.{former.__name__}", "init_args": {**init, **(dataset.get("init_args") or {})}}
