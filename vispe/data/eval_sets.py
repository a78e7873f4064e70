"""Evaluation image sets for the resolution sweep: any folder, archive, list or dataset, checked against a model's head.

An :class:`EvalSet` is a list of labelled images that are read only when asked for (:meth:`EvalSet.load`), so
everything that can be wrong with a set -- a missing or empty folder, a class list that does not fit the model --
is found by listing it, before any image is decoded or any model runs. Sources (:func:`open_eval_set`):

* a folder of class sub-folders (``<root>/<class>/<image>``, ImageFolder's layout);
* a zip of class folders (``[split/]<class>/<image>``), e.g. ``cifar10_test_jpeg.zip`` on its own;
* a CSV (``path,label`` rows, an optional header) or JSON list (``[[path, label], ...]`` or
  ``[{"path": ..., "label": ...}, ...]``) of images; labels are class names or integer class indices and
  relative paths are read from the list's folder;
* ``torchvision:<Name>`` -- a ``torchvision.datasets`` class already on disk (never downloaded);
* ``cifar10-test`` / ``fashion-mnist-test`` -- the official test splits under ``$VISPE_DATA_ROOT``.

Subsets are a fixed, seeded, class-stratified sample (:func:`stratified_indices`), never the first ``n``.
"""
from __future__ import annotations

import csv
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .image import CIFAR10_CLASSES
from .image_datamodule import channel_fix
from ..files import image_to_uint8, read_image
from .loading import resolve_data_path

__all__ = [
    "FASHION_MNIST_CLASSES", "IMAGE_SUFFIXES", "NAMED_SETS", "EvalSet", "class_index_map", "open_eval_set",
    "stratified_indices",
]

#: Fashion-MNIST's label order (label i is ``FASHION_MNIST_CLASSES[i]``).
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
#: Named sets: name -> (folder under the data root, what it is)
NAMED_SETS = {"cifar10-test": ("cifar10-jpeg", "CIFAR-10 test split (cifar10_test_jpeg.zip alone)"),
              "fashion-mnist-test": ("fashion-mnist", "Fashion-MNIST test split (t10k IDX files)")}


@dataclass
class EvalSet:
    """Labelled images read on demand. ``classes[i]`` names label ``i`` (``None``: labels are bare indices)."""

    description: str
    labels: torch.Tensor
    read: Callable[[int], torch.Tensor] = field(repr=False)  # index -> uint8 (C, H, W)
    classes: tuple[str, ...] | None = None
    #: what identifies the images' content (file paths, sizes and modification times, or archive CRCs); a changed
    #: file changes :meth:`content_key` and so re-runs a sweep that reused results by key
    content: Callable[[], Any] | None = field(default=None, repr=False)

    def content_key(self) -> str:
        """SHA-256 of :attr:`content` (and of the labels and class names); computed once."""
        if not hasattr(self, "_content_key"):
            import hashlib
            import json

            payload = json.dumps([self.content() if self.content is not None else None, self.labels.tolist(),
                                  list(self.classes) if self.classes is not None else None], default=str)
            self._content_key = hashlib.sha256(payload.encode()).hexdigest()
        return self._content_key

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def num_classes(self) -> int:
        return len(self.classes) if self.classes is not None else int(self.labels.max()) + 1

    def load(self, indices: Sequence[int] | None = None) -> list[torch.Tensor]:
        """Decode the images at ``indices`` (all by default) -> list of uint8 ``(C, H, W)`` (sizes may differ)."""
        return [self.read(int(i)) for i in (range(len(self)) if indices is None else indices)]


def stratified_indices(labels: torch.Tensor, n: int | None, seed: int = 0) -> torch.Tensor:
    """A fixed, seeded, class-stratified choice of ``n`` indices (sorted): each class gets its share of ``n``
    in proportion to its size (largest remainders break ties), drawn at random within the class.
    ``n=None`` or ``n >= len(labels)``: every index."""
    labels = torch.as_tensor(labels).long()
    if n is None or n >= len(labels):
        return torch.arange(len(labels))
    if n < 1:
        raise ValueError(f"the number of evaluation images must be >= 1 (or None for all), got {n}")
    g = torch.Generator().manual_seed(int(seed))
    classes, counts = labels.unique(return_counts=True)
    share = counts.double() * n / len(labels)
    quota = share.floor().long()
    rest = n - int(quota.sum())
    if rest:  # largest remainders first; equal remainders in a seeded order
        order = torch.randperm(len(classes), generator=g)
        frac = (share - quota)[order]
        quota[order[frac.argsort(descending=True, stable=True)[:rest]]] += 1
    keep = []
    for c, q in zip(classes.tolist(), quota.tolist()):
        idx = (labels == c).nonzero().flatten()
        keep.append(idx[torch.randperm(len(idx), generator=g)[:q]])
    return torch.cat(keep).sort().values


def class_index_map(set_classes: Sequence[str] | None, set_num_classes: int, model_classes: Sequence[str] | None,
                    model_num_classes: int, *, allow_subset: bool = False, set_name: str = "the image set",
                    model_name: str = "the model") -> torch.Tensor:
    """``map[set_label] = model_output_index``, after checking that the set's classes fit the model's head.

    Names on both sides: matched by name (their order may differ); the sets of names must be equal (or, with
    ``allow_subset``, the set's a subset of the model's). Otherwise the counts must be equal and labels are
    taken as the model's indices. Every mismatch raises ``ValueError`` naming both sides.
    """
    def show(names: Sequence[str] | None, count: int) -> str:
        if names is None:
            return f"{count} classes (unnamed: indices 0..{count - 1})"
        listed = ", ".join(map(str, names[:12])) + (f", ... (+{len(names) - 12})" if len(names) > 12 else "")
        return f"{len(names)} classes ({listed})"

    both = f"{model_name} has {show(model_classes, model_num_classes)}; {set_name} has {show(set_classes, set_num_classes)}"
    if model_classes is not None and len(model_classes) != model_num_classes:
        raise ValueError(f"{len(model_classes)} class names given for a head of {model_num_classes} outputs: {both}")
    if set_classes is not None and model_classes is not None:
        missing = [c for c in set_classes if c not in model_classes]
        if missing:
            raise ValueError(f"class names do not match: {set_name}'s {missing} are not classes of {model_name}. {both}")
        if len(set_classes) != len(model_classes) and not allow_subset:
            raise ValueError(f"class counts do not match: {both}. Evaluate on a set with the model's classes, "
                             "or pass --allow-class-subset to score a subset of the classes")
        return torch.tensor([list(model_classes).index(c) for c in set_classes], dtype=torch.long)
    if set_num_classes > model_num_classes or (set_num_classes != model_num_classes and not allow_subset):
        # one message with everything the command needs: names to match by, and consent to score only some classes
        fix = "give the model's class names in head order (--classes FILE: a .txt with one name per line, or a .json list)"
        if set_classes is not None and set_num_classes < model_num_classes:
            fix += (f" so {set_name}'s classes are matched by name, plus --allow-class-subset since it holds "
                    f"{set_num_classes} of the model's {model_num_classes} classes")
        else:
            fix += " so labels are matched by name, or evaluate on a set with the model's classes"
        raise ValueError(f"class counts do not match: {both}. To fix, {fix}")
    return torch.arange(set_num_classes)


# ------------------------------------------------------------------------------------------
# sources
# ------------------------------------------------------------------------------------------
def file_stats(paths: Sequence[Path | str]) -> list[tuple[str, int, int]]:
    """``(path, size, mtime_ns)`` of each file: the content identity of a set of image files."""
    out = []
    for p in paths:
        st = Path(p).stat()
        out.append((str(Path(p).resolve()), st.st_size, st.st_mtime_ns))
    return out


def _from_names(description: str, items: list[tuple[Any, str]], read: Callable[[Any], torch.Tensor],
                classes: Sequence[str] | None = None, content: Callable[[], Any] | None = None) -> EvalSet:
    """Items labelled by class name -> an EvalSet whose classes are the names (sorted unless given)."""
    classes = tuple(classes) if classes is not None else tuple(sorted({c for _, c in items}))
    index = {c: i for i, c in enumerate(classes)}
    keys = [k for k, _ in items]
    labels = torch.tensor([index[c] for _, c in items], dtype=torch.long)
    return EvalSet(description, labels, lambda i: read(keys[i]), classes, content)


def image_folder(root: str | Path) -> EvalSet:
    """``<root>/<class>/<image>`` (ImageFolder's layout; classes sorted by name, files by name)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder not found: {str(root)!r}")
    class_dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not class_dirs:
        raise ValueError(f"image folder {str(root)!r} has no class sub-folders: expected {str(root)}/<class>/<image> "
                         f"(images ending in {', '.join(IMAGE_SUFFIXES)})")
    items, empty = [], []
    for d in class_dirs:
        files = sorted(p for p in d.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        if not files:
            empty.append(d.name)
        items += [(p, d.name) for p in files]
    if not items:
        raise ValueError(f"image folder {str(root)!r} holds no images: its {len(class_dirs)} class folders "
                         f"({', '.join(d.name for d in class_dirs[:10])}) contain no files ending in {', '.join(IMAGE_SUFFIXES)}")
    if empty:
        raise ValueError(f"class folders of {str(root)!r} with no images: {empty}; remove them or add images "
                         "(an empty class still counts towards the classes matched against the model's head)")
    return _from_names(f"image folder {root.name}/ ({len(items)} images)", items, read_image,
                       content=lambda: file_stats([p for p, _ in items]))


def image_zip(path: str | Path) -> EvalSet:
    """A zip whose image members sit in class folders: ``[split/]<class>/<image>`` (the class is the parent folder)."""
    from ..files import check_zip

    path = Path(path)
    names = [n for n in check_zip(path, "image archive") if n.lower().endswith(IMAGE_SUFFIXES) and "/" in n]
    if not names:
        raise ValueError(f"archive {str(path)!r} holds no images in class folders ([split/]<class>/<image>)")
    names.sort()
    items = [(n, n.rsplit("/", 2)[-2]) for n in names]
    holder: dict[str, zipfile.ZipFile] = {}

    def read(member: str) -> torch.Tensor:
        if "z" not in holder:
            holder["z"] = zipfile.ZipFile(path)
        try:
            data = holder["z"].read(member)
        except (OSError, zipfile.BadZipFile, EOFError) as err:  # CRC mismatch, cut member
            raise ValueError(f"member {member!r} of {str(path)!r} is damaged ({type(err).__name__}: {err})") from None
        return read_image(data, f"{path}:{member}")

    classes = CIFAR10_CLASSES if {c for _, c in items} == set(CIFAR10_CLASSES) else None
    def content() -> Any:  # the archive's member names, CRCs and sizes: a changed member changes its CRC
        with zipfile.ZipFile(path) as z:
            return [(i.filename, i.CRC, i.file_size) for i in z.infolist()]

    return _from_names(f"{path.name} ({len(items)} images)", items, read, classes, content)


def image_list(path: str | Path) -> EvalSet:
    """A CSV (``path,label`` rows, optional header) or JSON list of ``(path, label)``; labels are names or indices."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"image list not found: {str(path)!r}")
    if path.suffix.lower() == ".json":
        from ..files import read_json

        raw = read_json(path, "image list")
        if not isinstance(raw, list):
            raise ValueError(f"{str(path)!r}: an image list is a JSON list of [path, label] or {{'path', 'label'}} entries")
        rows = [(r.get("path"), r.get("label")) if isinstance(r, dict) else tuple(r) if isinstance(r, (list, tuple)) and len(r) == 2
                else (None, None) for r in raw]
    else:
        try:  # utf-8-sig: a byte-order mark (spreadsheet exports) is not part of the first path
            with open(path, newline="", encoding="utf-8-sig") as f:
                rows = [tuple(r[:2]) for r in csv.reader(f) if r and not r[0].startswith("#")]
        except UnicodeDecodeError as err:
            raise ValueError(f"{str(path)!r} is not UTF-8 text ({err.reason} at byte {err.start}); save the image list as UTF-8") from None
        except csv.Error as err:
            raise ValueError(f"{str(path)!r} is not a readable CSV image list ({err})") from None
        if rows and [c.strip().lower() for c in rows[0]] == ["path", "label"]:
            rows = rows[1:]
    bad = [i for i, r in enumerate(rows) if len(r) != 2 or r[0] in (None, "") or r[1] in (None, "")]
    if bad:
        raise ValueError(f"{str(path)!r}: entries {bad[:5]} are not (path, label) pairs")
    if not rows:
        raise ValueError(f"image list {str(path)!r} is empty")
    files = [(Path(p) if Path(p).is_absolute() else path.parent / p) for p, _ in rows]
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{len(missing)} images of {str(path)!r} not found, e.g. {missing[:3]}")
    labels = [str(lab).strip() for _, lab in rows]
    desc = f"image list {path.name} ({len(rows)} images)"
    if all(lab.lstrip("-").isdigit() for lab in labels):
        idx = torch.tensor([int(lab) for lab in labels], dtype=torch.long)
        if int(idx.min()) < 0:
            raise ValueError(f"{str(path)!r}: class indices must be >= 0, got {int(idx.min())}")
        return EvalSet(desc, idx, lambda i: read_image(files[i]), None, lambda: file_stats([path, *files]))
    return _from_names(desc, list(zip(files, labels)), read_image, content=lambda: file_stats([path, *files]))


def torchvision_set(name: str, root: str | None = None, split: str = "test") -> EvalSet:
    """A ``torchvision.datasets`` class already on disk (``download=False``), its ``split`` (``train=`` or ``split=``)."""
    import inspect

    import torchvision.datasets as tvd

    cls = getattr(tvd, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.utils.data.Dataset)):
        valid = sorted(n for n in dir(tvd) if n[0].isupper() and isinstance(getattr(tvd, n), type)
                       and issubclass(getattr(tvd, n), torch.utils.data.Dataset))
        raise ValueError(f"unknown torchvision dataset {name!r}; choose one of {valid}")
    params = inspect.signature(cls.__init__).parameters
    if "root" not in params:
        raise ValueError(f"torchvision:{name} is not a dataset read from disk (its constructor takes no root folder); "
                         "give a torchvision dataset stored under --data-root, a folder, a .zip or an image list")
    folder = resolve_data_path(root, name.lower(), f"torchvision dataset {name}", arg="root", flag="--data-root")
    kwargs: dict[str, Any] = {}
    if "train" in params:
        if split not in ("train", "test"):
            raise ValueError(f"torchvision {name} has train/test splits, got split={split!r}")
        kwargs["train"] = split == "train"
    elif "split" in params:
        kwargs["split"] = split
    if "download" in params:
        kwargs["download"] = False
    try:
        ds = cls(str(folder), **kwargs)
    except RuntimeError as err:  # torchvision's "Dataset not found or corrupted"
        raise FileNotFoundError(f"torchvision {name} not found under {str(folder)!r} (nothing is downloaded): {err}") from None
    except TypeError as err:  # a constructor that needs more than root / train / split
        raise ValueError(f"torchvision:{name} cannot be opened with root, train/split and download=False only ({err}); "
                         "evaluate it from a folder or an image list instead") from None
    targets = getattr(ds, "targets", None)
    if targets is None:
        targets = getattr(ds, "labels", None)
    if targets is None:
        targets = [ds[i][1] for i in range(len(ds))]
    labels = torch.as_tensor(np.asarray(targets)).long().flatten()
    if len(labels) == 0:
        raise ValueError(f"torchvision {name} ({split}) under {str(folder)!r} is empty")
    classes = tuple(ds.classes) if getattr(ds, "classes", None) else None
    return EvalSet(f"torchvision {name} {split} ({len(labels)} images)", labels, lambda i: _tv_image(ds, i, name), classes,
                   lambda: file_stats(sorted(p for p in Path(folder).rglob("*") if p.is_file())))


def _tv_image(ds: Any, i: int, name: str) -> torch.Tensor:
    """Item ``i`` of a torchvision dataset as uint8 through the one decoder (a PIL image, or a uint8 tensor as is)."""
    img = ds[i][0]
    if isinstance(img, torch.Tensor):
        if img.dtype != torch.uint8 or img.ndim != 3:
            raise ValueError(f"torchvision {name} item {i} is a {img.dtype} tensor of shape {tuple(img.shape)}; "
                             "vispe reads PIL images or uint8 (C, H, W) tensors")
        return img
    return image_to_uint8(img, f"torchvision {name} item {i}")


def cifar10_test(data_dir: str | None = None, flag: str = "--data-root") -> EvalSet:
    """The CIFAR-10 test split from ``cifar10_test_jpeg.zip`` alone (the train archive is not needed); ``flag`` is the
    option that gives ``data_dir`` in the command being run (named when the files are missing)."""
    folder = resolve_data_path(data_dir, NAMED_SETS["cifar10-test"][0], "CIFAR-10 JPEG data", flag=flag)
    zp = folder / "cifar10_test_jpeg.zip" if folder.is_dir() else folder
    if not zp.is_file():
        raise FileNotFoundError(f"CIFAR-10 test archive not found at {str(zp)!r}")
    out = image_zip(zp)
    out.description = f"CIFAR-10 test ({len(out)} images)"
    return out


def fashion_mnist_test(data_dir: str | None = None, flag: str = "--data-root") -> EvalSet:
    """The Fashion-MNIST test split (``t10k-*-idx*-ubyte[.gz]``); ``flag`` as in :func:`cifar10_test`."""
    from ..files import read_idx

    folder = resolve_data_path(data_dir, NAMED_SETS["fashion-mnist-test"][0], "Fashion-MNIST IDX files", flag=flag)

    def find(stem: str) -> Path:
        for name in (stem + ".gz", stem):
            if (folder / name).is_file():
                return folder / name
        raise FileNotFoundError(f"Fashion-MNIST file {stem}(.gz) not found in {str(folder)!r}")

    files = [find("t10k-images-idx3-ubyte"), find("t10k-labels-idx1-ubyte")]
    x = torch.from_numpy(read_idx(files[0]).copy())[:, None]
    y = torch.from_numpy(read_idx(files[1]).astype(np.int64))
    if len(x) != len(y):
        raise ValueError(f"Fashion-MNIST test files in {str(folder)!r} hold {len(x)} images but {len(y)} labels")
    return EvalSet(f"Fashion-MNIST test ({len(y)} images)", y, lambda i: x[i], FASHION_MNIST_CLASSES, lambda: file_stats(files))


def open_eval_set(spec: str, data_root: str | None = None, split: str = "test") -> EvalSet:
    """An evaluation set from a folder, ``.zip``, ``.csv``/``.json`` list, ``torchvision:<Name>`` or a named set
    (:data:`NAMED_SETS`; ``data_root`` overrides ``$VISPE_DATA_ROOT/<its folder>``). Lists it; decodes nothing."""
    if spec in NAMED_SETS:
        return cifar10_test(data_root) if spec == "cifar10-test" else fashion_mnist_test(data_root)
    if spec.startswith("torchvision:"):
        return torchvision_set(spec.split(":", 1)[1], data_root, split)
    path = Path(spec).expanduser()
    if path.is_dir():
        return image_folder(path)
    if path.suffix.lower() == ".zip":
        if not path.is_file():
            raise FileNotFoundError(f"image archive not found: {str(path)!r}")
        return image_zip(path)
    if path.suffix.lower() in (".csv", ".json"):
        return image_list(path)
    if not path.exists():
        raise FileNotFoundError(
            f"evaluation set {spec!r} not found; give a folder of class sub-folders, a .zip, a .csv/.json image list, "
            f"torchvision:<Name> or one of {sorted(NAMED_SETS)}")
    raise ValueError(f"evaluation set {spec!r} is a file vispe does not read as images; give a folder, .zip, .csv or .json")

