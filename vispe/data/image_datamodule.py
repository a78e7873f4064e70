"""The image LightningDataModule, the data sets it reads (:class:`ImageSource`) and its batch transforms.

One DataModule serves every image data set: ``ImageDataModule(dataset=SyntheticImages(...), batch_size=32)``
(sources in :mod:`vispe.data.image`). It hands the model ``uint8`` tensors ``(B, C, H, W)`` from its DataLoaders and
turns them into normalised float batches in :meth:`ImageDataModule.on_after_batch_transfer`:
batch-level augmentation (random crop with padding + horizontal flip, drawn from the torch RNG of
the main process) during training, plain normalisation otherwise. Keeping augmentation out of the
workers makes it cheap on CPU and makes a run reproducible from the global seed alone.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler

from .loading import EpochSeededRandomSampler, NumWorkers, ResumableDataLoader, resolve_num_workers

__all__ = ["AUGMENTATIONS", "RESOLUTION_SAMPLING", "ClassInterleavedSampler", "ImageDataModule", "ImageSource",
           "LazyImageDataset", "class_interleaved_order", "normalize_images", "parse_resolutions", "TensorImageDataset",
           "channel_fix", "make_pil_to_uint8", "random_crop_flip", "resize_images"]

#: Batch-level training augmentations: 'crop_flip' (pad by size/8, random crop, random h-flip),
#: 'flip' (random h-flip only), 'none'.
AUGMENTATIONS = ("crop_flip", "flip", "none")
#: How training draws from ``resolutions``: one size for the whole batch, or one per sample (a mixed batch).
RESOLUTION_SAMPLING = ("batch", "sample")


def parse_resolutions(resolutions: Any, patch_size: int | None = None) -> tuple[tuple[int, int], ...]:
    """``[28, [21, 35], ...]`` -> ``((28, 28), (21, 35), ...)`` (pixels, ``(H, W)``); each a multiple of ``patch_size``
    when given. Raises naming the bad entry."""
    if isinstance(resolutions, (str, bytes)) or not isinstance(resolutions, (list, tuple)) or len(resolutions) == 0:
        raise ValueError(f"resolutions must be a non-empty list of sizes (an int or [H, W] in pixels), got {resolutions!r}")
    out = []
    for r in resolutions:
        hw = (r, r) if isinstance(r, int) and not isinstance(r, bool) else r
        if (not isinstance(hw, (list, tuple)) or len(hw) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in hw)):
            raise ValueError(f"resolutions: entry {r!r} is not a size; give an int or [H, W] of positive ints (pixels)")
        if patch_size is not None and (hw[0] % patch_size or hw[1] % patch_size):
            raise ValueError(f"resolutions: {list(hw)} is not a multiple of patch_size={patch_size} on both sides")
        out.append((int(hw[0]), int(hw[1])))
    return tuple(out)


class TensorImageDataset(Dataset):
    """In-memory ``uint8`` images ``(N, C, H, W)`` with integer labels."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        if images.dtype != torch.uint8 or images.ndim != 4:
            raise ValueError(f"images must be uint8 (N, C, H, W), got {images.dtype} {tuple(images.shape)}")
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images = images
        self.labels = labels.long()

    def __len__(self) -> int:
        return len(self.images)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images, self.labels

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


class LazyImageDataset(Dataset):
    """Labelled images that are decoded on request: a source's split whose labels are known before its pixels (a
    zip's folder names). The data module decodes the subset it keeps (:meth:`select`), once, in the main process;
    reading items directly decodes the whole set on first use."""

    labels: torch.Tensor

    def select(self, index: torch.Tensor | None = None) -> "TensorImageDataset":
        """The images at ``index`` (all when ``None``), decoded, with their labels."""
        raise NotImplementedError

    @property
    def targets(self) -> list[int]:
        return self.labels.tolist()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if "_decoded" not in self.__dict__:
            self._decoded = self.select()
        return self._decoded[index]


def class_interleaved_order(labels: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A fixed, seeded permutation of ``range(len(labels))`` in which every prefix is a class-stratified sample.

    The ``j``-th item (in a seeded random order within its class) of a class of ``n_c`` items is placed at
    ``(j + 1/2) / n_c`` on ``[0, 1)`` and the items are read in that order (equal places in a seeded random
    order). The first ``k`` items then hold ``k * n_c / N`` of class ``c`` to within about one item, whatever
    the order of the set on disk (CIFAR-10's and Fashion-MNIST's test files are sorted by class).
    """
    labels = torch.as_tensor(labels).long().flatten()
    g = torch.Generator().manual_seed(int(seed))
    place = torch.empty(len(labels), dtype=torch.float64)
    for c in labels.unique().tolist():
        idx = (labels == c).nonzero().flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        place[idx] = (torch.arange(len(idx), dtype=torch.float64) + 0.5) / len(idx)
    tie = torch.randperm(len(labels), generator=g)  # equal places (equal class sizes): a seeded class order
    return tie[place[tie].argsort(stable=True)]


class ClassInterleavedSampler(Sampler[int]):
    """The evaluation order of :class:`ImageDataModule`: every index once per pass, in
    :func:`class_interleaved_order` (the same order every pass), so ``limit_val_batches`` /
    ``limit_test_batches`` evaluate a class-mixed sample instead of the first classes of a class-sorted set.
    Without labels (a dataset exposing neither ``labels`` nor ``targets``) a fixed seeded random order."""

    def __init__(self, data_source: Dataset, seed: int = 0) -> None:
        self.data_source = data_source
        self.seed = int(seed)
        labels = _labels_of(data_source)
        if labels is None:
            self.order = torch.randperm(len(data_source), generator=torch.Generator().manual_seed(self.seed))
        else:
            self.order = class_interleaved_order(labels, self.seed)

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self):
        return iter(self.order.tolist())


def random_crop_flip(x: torch.Tensor, pad: int, flip: bool = True, generator: torch.Generator | None = None) -> torch.Tensor:
    """Per-sample random crop (after zero padding by ``pad``) and random horizontal flip of a batch."""
    b, _, h, w = x.shape
    if pad > 0:
        xp = F.pad(x, (pad, pad, pad, pad))
        oy = torch.randint(0, 2 * pad + 1, (b,), generator=generator)
        ox = torch.randint(0, 2 * pad + 1, (b,), generator=generator)
        rows = (oy[:, None] + torch.arange(h)).to(x.device)  # (B, H)
        cols = (ox[:, None] + torch.arange(w)).to(x.device)  # (B, W)
        bi = torch.arange(b, device=x.device)[:, None, None]
        # advanced indexing: (B, H, W, C) -> back to (B, C, H, W)
        x = xp.permute(0, 2, 3, 1)[bi, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)
    if flip:
        mask = (torch.rand(b, generator=generator) < 0.5).to(x.device)[:, None, None, None]
        x = torch.where(mask, x.flip(-1), x)
    return x.contiguous()


def resize_images(x: torch.Tensor, size: int | tuple[int, int]) -> torch.Tensor:
    """Resize a float batch to ``size`` (whole image, no crop): bicubic with antialiasing.

    This is the fixed resize policy of the resolution sweep (crop ratio 1.0, as rope-vit evaluates).
    """
    size = (size, size) if isinstance(size, int) else tuple(size)
    if tuple(x.shape[-2:]) == size:
        return x
    return F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=True)


def normalize_images(x: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """A float batch ``(B, C, H, W)`` in [0, 1] normalised per channel (one value: every channel)."""
    m = torch.tensor(mean, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
    s = torch.tensor(std, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
    return (x - m) / s


class ImageSource:
    """An image classification data set as :class:`ImageDataModule` reads it.

    A subclass calls ``super().__init__(locals())`` first (its arguments become its :meth:`record`), checks its files
    in ``__init__`` (a run fails at configuration time), sets ``num_classes``, ``in_chans``, ``image_size``, ``mean``,
    ``std`` (and ``classes`` when the class names are known) and implements :meth:`build`.
    """

    num_classes: int
    in_chans: int
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    classes: tuple[str, ...] | None = None

    def __init__(self, arguments: Mapping[str, Any]) -> None:
        self.init_args = {k: v for k, v in arguments.items() if k not in ("self", "__class__")}

    def build(self, seed: int) -> tuple[Dataset, Dataset, Dataset]:
        """``(train, val, test)`` datasets of ``(uint8 (C, H, W), label)``; ``seed`` for generated or split sets."""
        raise NotImplementedError

    def prepare(self) -> None:
        """Download or write files (``LightningDataModule.prepare_data``: once per node); nothing by default."""

    def record(self) -> dict[str, Any]:
        """``{'class_path', 'init_args'}``: how configs and checkpoints name this source (:func:`source_from_record`)."""
        cls = type(self)
        return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": dict(self.init_args)}


def source_from_record(record: Mapping[str, Any]) -> ImageSource:
    """The :class:`ImageSource` of a record ``{'class_path': ..., 'init_args': {...}}`` (a config's or checkpoint's)."""
    import importlib

    class_path = str(record.get("class_path"))
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, ImageSource)):
        raise ValueError(f"dataset: class_path {class_path!r} is not an ImageSource; use one of {_source_names()}")
    return cls(**dict(record.get("init_args") or {}))


def _source_names() -> list[str]:
    from . import image  # noqa: F401  (defines the shipped sources)

    return sorted(c.__name__ for c in ImageSource.__subclasses__())


class ImageDataModule(pl.LightningDataModule):
    """Loaders over one image data set plus batch-level augmentation and normalisation.

    ``num_classes``, ``in_chans``, ``image_size``, ``mean``, ``std`` (and ``classes``) are the data set's; ``vispe
    fit`` links the first three into the model.

    Args:
        dataset: the data set, an :class:`ImageSource` (:mod:`vispe.data.image`: ``CIFAR10Images``,
            ``FashionMNISTImages``, ``DigitsImages``, ``FolderImages``, ``TorchvisionImages``, ``SyntheticImages``),
            or its record ``{'class_path': ..., 'init_args': {...}}``.
        batch_size: per-process batch size.
        eval_batch_size: batch size for validation/test (default: ``batch_size``).
        num_workers: DataLoader workers, or ``'auto'`` (:func:`vispe.data.loading.auto_num_workers`: this
            process's share of the cores less one, at most 4).
        augment: one of :data:`AUGMENTATIONS` (training only).
        train_subset: keep only this many training samples (a fixed, seeded, class-balanced choice).
        eval_subset: keep only this many validation/test samples (same rule).
        seed: seed of the subset choice, of the per-epoch shuffling and of the evaluation order: validation and
            test batches come in a fixed class-interleaved order (:class:`ClassInterleavedSampler`), so the first
            ``k`` batches (``limit_val_batches: k``) are a class-stratified sample; predictions keep the set's order.
        resolutions: training sizes in pixels (an int or ``[H, W]`` each; ``None``: ``image_size`` only). Each
            training batch is resized (after augmentation, bicubic antialiased) to sizes drawn from this list;
            validation and test stay at ``image_size``.
        resolution_sampling: ``'batch'`` -- one size per batch, a plain ``(B, C, H, W)`` tensor (the model needs
            ``dynamic_img_size=True``) -- or ``'sample'`` -- one size per sample: when the sizes differ the batch is a
            list of ``(C, H, W)`` images, which the model lays out as NaFlex patches (see docs/mixed-resolution.md).
        patch_size: the model's patch size; every resolution must be a multiple of it. Leave it out: the task hands the model's patch size over when training starts
            (:meth:`use_model_patch_size`); a value given here must equal the model's.
    """

    def __init__(
        self,
        dataset: ImageSource,
        batch_size: int = 128,
        eval_batch_size: int | None = None,
        num_workers: NumWorkers = 0,
        augment: str = "crop_flip",
        train_subset: int | None = None,
        eval_subset: int | None = None,
        seed: int = 0,
        *,
        resolutions: list[int | list[int]] | None = None,
        resolution_sampling: str = "batch",
        patch_size: int | None = None,
    ) -> None:
        super().__init__()
        if isinstance(dataset, Mapping) and "class_path" in dataset:
            dataset = source_from_record(dataset)
        if not isinstance(dataset, ImageSource):
            raise ValueError(f"dataset must be an ImageSource ({', '.join(_source_names())}), got {type(dataset).__name__} {dataset!r}")
        self.dataset = dataset
        dataset = dataset.record()  # hyper-parameters hold the record (plain data), never the object
        self.save_hyperparameters()
        if augment not in AUGMENTATIONS:
            raise ValueError(f"augment={augment!r} is not valid; choose one of {list(AUGMENTATIONS)}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if eval_batch_size is not None and eval_batch_size < 1:
            raise ValueError(f"eval_batch_size must be >= 1 (or None for batch_size), got {eval_batch_size}")
        for name, n in (("train_subset", train_subset), ("eval_subset", eval_subset)):
            if n is not None and n < 1:
                raise ValueError(f"{name}: subset size must be >= 1 (or None for the whole split), got {n}")
        self.batch_size = int(batch_size)
        self.eval_batch_size = int(eval_batch_size or batch_size)
        self.num_workers = resolve_num_workers(num_workers)
        self.augment = augment
        self.train_subset = train_subset
        self.eval_subset = eval_subset
        self.seed = int(seed)
        if resolution_sampling not in RESOLUTION_SAMPLING:
            raise ValueError(f"resolution_sampling={resolution_sampling!r} is not valid; choose one of {list(RESOLUTION_SAMPLING)}")
        if patch_size is not None and (isinstance(patch_size, bool) or not isinstance(patch_size, int) or patch_size < 1):
            raise ValueError(f"patch_size must be a positive int (the model's patch size) or None, got {patch_size!r}")
        self.resolutions = None if resolutions is None else parse_resolutions(resolutions, patch_size)
        self.resolution_sampling = resolution_sampling
        self.patch_size = patch_size
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None
        source = self.dataset
        self.num_classes, self.in_chans, self.image_size = source.num_classes, source.in_chans, source.image_size
        self.mean, self.std = tuple(source.mean), tuple(source.std)
        self.classes = source.classes

    def build_datasets(self) -> tuple[Dataset, Dataset, Dataset]:
        return self.dataset.build(self.seed)

    def prepare_data(self) -> None:
        self.dataset.prepare()

    # -- Lightning hooks --------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            train, val, test = self.build_datasets()
            self.train_set = self._subset(train, self.train_subset, salt=1)
            self.val_set = self._subset(val, self.eval_subset, salt=2)
            # one split serving both (CIFAR-10's test split): one subset, decoded once
            self.test_set = self.val_set if test is val else self._subset(test, self.eval_subset, salt=2)

    def _subset(self, ds: Dataset, n: int | None, salt: int) -> Dataset:
        if n is None or n >= len(ds):
            return ds.select() if isinstance(ds, LazyImageDataset) else ds
        if n < 1:
            raise ValueError(f"subset size must be >= 1, got {n}")
        labels = _labels_of(ds)
        g = torch.Generator().manual_seed(self.seed * 7919 + salt)
        perm = torch.randperm(len(ds), generator=g)
        if labels is None:
            keep = perm[:n]
        else:  # class-balanced: round-robin over classes in a seeded order
            labels = labels[perm]
            per_class = [perm[labels == c] for c in labels.unique().tolist()]
            order = torch.stack([
                torch.cat([pc, pc.new_full((max(map(len, per_class)) - len(pc),), -1)]) for pc in per_class
            ], dim=1).flatten()
            keep = order[order >= 0][:n]
        keep = keep.sort().values
        if isinstance(ds, LazyImageDataset):
            return ds.select(keep)
        if isinstance(ds, TensorImageDataset):
            return TensorImageDataset(ds.images[keep], ds.labels[keep])
        return torch.utils.data.Subset(ds, keep.tolist())

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "call setup() first"
        return ResumableDataLoader(
            self.train_set,
            batch_size=self.batch_size,
            sampler=EpochSeededRandomSampler(self.train_set, seed=self.seed),
            num_workers=self.num_workers,
            drop_last=len(self.train_set) > self.batch_size,
            persistent_workers=self.num_workers > 0,
        )

    def _eval_loader(self, ds: Dataset | None, interleave: bool = True) -> DataLoader:
        assert ds is not None, "call setup() first"
        # a class-interleaved order: any prefix (limit_val_batches) is class-stratified; the whole pass is every image once
        sampler = ClassInterleavedSampler(ds, seed=self.seed) if interleave else None
        return DataLoader(ds, batch_size=self.eval_batch_size, shuffle=False, sampler=sampler, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader(self.val_set)

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader(self.test_set)

    def predict_dataloader(self) -> DataLoader:
        # predictions stay in the dataset's order (row i is image i)
        return self._eval_loader(self.test_set, interleave=False)

    # -- batch transforms -------------------------------------------------------------------
    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """``uint8`` (or float in [0, 255]) batch -> float, resized to ``image_size``, normalised."""
        x = x.float().div_(255.0)
        if tuple(x.shape[-2:]) != (self.image_size, self.image_size):
            x = resize_images(x, self.image_size)
        return normalize_images(x, self.mean, self.std)

    def augment_batch(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        if self.augment == "crop_flip":
            return random_crop_flip(x, pad=max(1, x.shape[-1] // 8), flip=True, generator=generator)
        if self.augment == "flip":
            return random_crop_flip(x, pad=0, flip=True, generator=generator)
        return x

    def transform_batch(self, x: torch.Tensor, training: bool, generator: torch.Generator | None = None) -> torch.Tensor:
        x = self.normalize(x)
        return self.augment_batch(x, generator) if training else x

    def use_model_patch_size(self, patch_size: int, model_name: str = "the model") -> None:
        """Take the model's patch size (the task calls this when training starts): resolutions are checked against
        it. A different ``patch_size`` given to the data module is an error naming both."""
        if self.patch_size is not None and self.patch_size != patch_size:
            raise ValueError(f"data patch_size={self.patch_size} differs from {model_name}'s patch size {patch_size}; "
                             f"leave the data module's patch_size out (it takes the model's)")
        if self.resolutions is not None:
            try:
                parse_resolutions([list(r) for r in self.resolutions], patch_size)
            except ValueError as err:
                raise ValueError(f"{err} (the patch size of {model_name})") from None
        self.patch_size = int(patch_size)

    def sample_resolutions(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor | list[torch.Tensor]:
        """A normalised training batch resized to sizes drawn from :attr:`resolutions`: one for the batch
        (``'batch'``) or one per sample (``'sample'``; a list of ``(C, H, W)`` images when the sizes differ, which
        the model lays out as NaFlex patches itself)."""
        if not self.resolutions:
            return x
        b = x.shape[0]
        draws = torch.randint(len(self.resolutions), (1 if self.resolution_sampling == "batch" else b,), generator=generator)
        if bool((draws == draws[0]).all()):
            return resize_images(x, self.resolutions[int(draws[0])])
        images: list[torch.Tensor] = [x[0]] * b
        for r in draws.unique().tolist():
            rows = (draws == r).nonzero().flatten().tolist()
            resized = resize_images(x[rows], self.resolutions[r])
            for i, row in enumerate(rows):
                images[row] = resized[i]
        return images

    def _batch_generator(self) -> torch.Generator:
        """Augmentation RNG seeded by (seed, epoch, batch in epoch, rank): independent of the global RNG,
        so a resumed run draws exactly what an uninterrupted one would."""
        trainer = self.trainer
        progress = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        key = ((self.seed * 1_000_003 + trainer.current_epoch) * 1_000_003 + progress) * 1_009 + trainer.global_rank
        return torch.Generator().manual_seed(key % (2**63 - 1))

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y = batch
        training = self.trainer is not None and self.trainer.training
        generator = self._batch_generator() if training else None
        x = self.transform_batch(x, training, generator)
        return (self.sample_resolutions(x, generator) if training else x), y


def _labels_of(ds: Dataset) -> torch.Tensor | None:
    """The labels of a dataset without decoding it (``labels`` / ``targets``, through ``Subset``), or ``None``."""
    if isinstance(ds, (TensorImageDataset, LazyImageDataset)):
        return ds.labels
    if isinstance(ds, torch.utils.data.Subset):
        inner = _labels_of(ds.dataset)
        return None if inner is None else inner[torch.as_tensor(ds.indices, dtype=torch.long)]
    targets = getattr(ds, "targets", None)
    if targets is not None:
        return torch.as_tensor(targets)
    return None


def channel_fix(x: torch.Tensor, in_chans: int) -> torch.Tensor:
    """Make a ``(C, H, W)`` image have ``in_chans`` channels (grey -> RGB by repetition, RGBA -> RGB)."""
    c = x.shape[0]
    if c == in_chans:
        return x
    if c == 1:
        return x.expand(in_chans, -1, -1).contiguous()
    if in_chans == 1:
        return x[:3].float().mean(0, keepdim=True).round().to(x.dtype)
    return x[:in_chans]


def make_pil_to_uint8(image_size: int, in_chans: int) -> Callable[[Any, str], torch.Tensor]:
    """Per-sample transform for file datasets: the image (a PIL image, decoded by :func:`vispe.files.image_to_uint8`'s
    mode rules, or a uint8 ``(C, H, W)`` tensor from :func:`vispe.files.read_image`) -> resize (shorter side) + centre
    crop to ``image_size``, uint8 CHW with ``in_chans`` channels. ``name`` names the image in errors."""
    from torchvision.transforms import v2

    from ..files import image_to_uint8

    tf = v2.Compose([
        v2.Resize(image_size, interpolation=v2.InterpolationMode.BICUBIC, antialias=True),
        v2.CenterCrop(image_size),
    ])

    def apply(img: Any, name: str = "image") -> torch.Tensor:
        x = img if isinstance(img, torch.Tensor) else image_to_uint8(img, name)
        if x.dtype != torch.uint8 or x.ndim != 3:
            raise ValueError(f"{name}: a {x.dtype} tensor of shape {tuple(x.shape)}; file datasets give PIL images or uint8 (C, H, W)")
        return channel_fix(tf(x), in_chans)

    return apply
