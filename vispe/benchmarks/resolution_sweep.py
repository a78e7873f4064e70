"""Resolution generalisation of any classifier on any image set: sizes, shapes, aspect ratios, policies, memory.

    # a vispe checkpoint on its own test split, then on a folder of JPEGs in class sub-folders
    vispe resolution runs/a/version_0/checkpoints/last.ckpt --sizes 16,24,32,48,64 --extrapolation both
    vispe resolution runs/a/.../last.ckpt --data my_images/ --num-images 500 --aspect-ratios 1:2,1:1,2:1
    # timm weights from a local file, as they are (learned APE) and swapped zero-shot to other encodings
    vispe resolution --model vit_small_patch16_224 --weights vit_s16.pth --pos-encoding learned,rope_axial,cpe \\
        --extrapolation both --data my_images/ --sizes 112,224,448

Model sources: Lightning checkpoints of ``vispe.tasks.ImageClassification`` (positional arguments), and/or
``--model NAME --weights FILE``: a timm ``VisionTransformer`` name (``vit_*``, ``deit_*``) or a ``vispe_*`` model,
rebuilt as a vispe ViT with each ``--pos-encoding`` (default ``learned``, which reproduces timm's APE) and loaded
through :func:`vispe.models.checkpoint.load_timm_checkpoint` (nothing is downloaded).

Image sets (``--data``, see :mod:`vispe.data.eval_sets`): a folder of class sub-folders, a zip of class folders,
a CSV/JSON list of ``(path, label)``, ``torchvision:<Name>``, ``cifar10-test`` / ``fashion-mnist-test``; without
``--data`` a checkpoint is evaluated on the test split of the DataModule it recorded. The set's classes are matched
against the model's head (by name where both are named) before any image is decoded; ``--num-images`` keeps a
fixed, seeded, class-stratified sample.

Protocol (fixed, written into the JSON): each image (uint8, its own size) is scaled to [0, 1], brought to the
evaluated ``H x W`` by the resize policy -- ``resize`` (the whole image, aspect not kept), ``crop`` (shorter side
resized to cover, centre crop) or ``pad`` (longer side resized to fit, centred, padded with the mean colour) --
with bicubic, antialiased interpolation, then normalised with the model's mean / std. The patch size is unchanged
(``H/p x W/p`` tokens); nothing is fine-tuned. Encodings with extrapolation policies run with the one they have
(``native``), a forced one, ``both`` (extend + interpolate) or ``all`` (every policy the encoding declares);
encodings without policies run their single behaviour. Peak memory is measured per evaluated shape: on CUDA
``torch.cuda.max_memory_allocated``; on CPU the peak of live tensor storage during the first batch (PyTorch's
``MemTracker``; ``tracemalloc`` does not see tensor memory) and the process's peak resident set (Linux ``VmHWM``,
reset per shape).

Outputs in ``--out``: ``resolution.json``, ``resolution.md`` (accuracy and peak-memory tables) and
``resolution.png`` (top-1 vs size; top-1 vs aspect ratio when one was swept).
"""
from __future__ import annotations

import inspect
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from vispe._checks import AnyOf, Choice, Int, Real, Satisfies, Seq, Str
from vispe.cli_options import Conflict, Option, Options, TextError, device_rule, floats_text, int_text, json_object_text, strings_text
from vispe.encodings import extrapolation_policies, get_extrapolation, set_extrapolation
from vispe.files import read_json, write_json_atomic

__all__ = [
    "DEFAULT_SIZES", "EXTRAPOLATION_CHOICES", "RESIZE_POLICIES", "ModelSource", "aspect_shapes", "checkpoint_source",
    "evaluate_shapes", "load_classifier", "main", "parse_shapes", "prepare_batch", "run_sweep",
    "weights_sources",
]

DEFAULT_SIZES = (16, 24, 32, 40, 48, 56, 64)
EXTRAPOLATION_CHOICES = ("native", "extend", "interpolate", "ntk", "yarn", "both", "all")
#: How an image meets an ``H x W`` it does not have (see the module docstring).
RESIZE_POLICIES = ("resize", "crop", "pad")
RESIZE_TEXT = {
    "resize": "whole image resized to H x W (aspect ratio not kept)",
    "crop": "shorter side resized to cover H x W, centre crop",
    "pad": "longer side resized to fit H x W, centred, padded with the mean colour",
}


# ------------------------------------------------------------------------------------------
# extrapolation policies: the encodings' declared resolution contract (vispe.encodings.resolution), read and set
# on a loaded model without rebuilding it
# ------------------------------------------------------------------------------------------
def extrapolation_modes(encoding: str | None) -> tuple[str, ...]:
    """The extrapolation policies a registered encoding (name or spec) declares (empty: a single, fixed policy)."""
    return () if encoding is None else tuple(extrapolation_policies(encoding))


# ------------------------------------------------------------------------------------------
# shapes
# ------------------------------------------------------------------------------------------
#: Largest side (pixels) and token budget the sweep evaluates: far beyond any ViT's memory on one device, and a
#: clear refusal instead of an allocator failure deep in the model.
MAX_SIDE = 16384
MAX_TOKEN_BUDGET = 65536
#: Aspect ratios (width / height) between 1/MAX_ASPECT and MAX_ASPECT.
MAX_ASPECT = 256.0


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"16,24,32x48"`` -> ``[(16, 16), (24, 24), (32, 48)]`` (``HxW`` or a square side), in the order given."""
    out = []
    for item in filter(None, str(text).replace(" ", "").split(",")):
        parts = item.lower().split("x")
        try:
            hw = (int(parts[0]), int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1])) if len(parts) == 2 else None
        except ValueError:
            hw = None
        if hw is None or min(hw) <= 0 or max(hw) > MAX_SIDE:
            expected = f"sizes from 1 to {MAX_SIDE} px or HxW shapes separated by commas (e.g. 16,32,24x48); {item!r} is not one"
            raise TextError(f"--sizes takes positive {expected}", expected)
        if hw not in out:
            out.append(hw)
    if not out:
        raise TextError(f"--sizes is empty: {text!r}", "sizes or HxW shapes separated by commas (e.g. 16,32,24x48)")
    return out


def _ratio(item: str) -> float:
    """``"w:h"`` or a decimal -> ``w / h``; ``ValueError`` unless both are finite and > 0 and the ratio is in range."""
    try:
        w, h = (float(t) for t in item.split(":")) if ":" in item else (float(item), 1.0)
    except ValueError:
        w = h = -1.0
    if not (math.isfinite(w) and math.isfinite(h) and w > 0 and h > 0) or not 1 / MAX_ASPECT <= w / h <= MAX_ASPECT:
        expected = (f"width:height ratios of finite positive numbers between 1:{MAX_ASPECT:g} and {MAX_ASPECT:g}:1 "
                    f"(e.g. 1:2,1:1,2:1); {item!r} is not one")
        raise TextError(f"--aspect-ratios takes {expected}", expected)
    return w / h


def parse_aspect_ratios(text: str) -> list[tuple[float, str]]:
    """``"1:2,1:1,2:1"`` (width:height) or decimals -> ``[(width / height, label), ...]``."""
    out = [(_ratio(item), item) for item in filter(None, str(text).replace(" ", "").split(","))]
    if not out:
        raise TextError(f"--aspect-ratios is empty: {text!r}", "width:height ratios separated by commas (e.g. 1:2,1:1,2:1)")
    return out


def _is_ratio_pair(v: Any) -> bool:
    return (isinstance(v, (list, tuple)) and len(v) == 2 and Real(1 / MAX_ASPECT, MAX_ASPECT).is_valid(v[0])
            and isinstance(v[1], str))


_SIDE = Int(1, MAX_SIDE)
#: The sweep's options, declared once: ``vispe resolution``'s flags and :func:`run_sweep` / :func:`weights_sources`'s
#: keywords are checked by the same rules (see :mod:`vispe.cli_options`).
OPTIONS = Options("vispe resolution", [
    Option("checkpoints", positional=True, help="Lightning checkpoints of vispe.tasks.ImageClassification"),
    Option("model", cli_only=True, help="timm ViT name (vit_small_patch16_224, deit_*) or vispe_* model"),
    Option("weights", cli_only=True, help="local .pth / .safetensors state dict of --model (nothing downloads)"),
    Option("pos_encoding", cli_only=True,
           help="comma-separated encodings to load the weights under (default learned = timm's APE); others are a zero-shot swap"),
    Option("model_kwargs", Satisfies(lambda v: isinstance(v, dict), "a dict of model arguments"), json_object_text,
           help="JSON of extra model arguments (e.g. '{\"depth\": 2, \"img_size\": 64}')"),
    Option("allow_partial", switch=True, default=False,
           help="score --model weights that leave model tensors newly initialised or drop some of the file's "
                "(other than a swapped encoding's own); refused by default"),
    Option("data", help="folder of class sub-folders, .zip, .csv/.json list, torchvision:<Name>, cifar10-test or "
                        "fashion-mnist-test (default: each checkpoint's recorded test split)"),
    Option("data_root", help="root of --data for torchvision/named sets (default $VISPE_DATA_ROOT/<folder>)"),
    Option("data_dir", help="override the data location recorded in the checkpoints"),
    Option("split", Str(), default="test", help="split of a torchvision dataset"),
    Option("classes", cli_only=True, help="the model's class names in head order: comma-separated, or a .txt/.json file"),
    Option("allow_class_subset", switch=True, default=False, help="score a set holding only some of the model's classes"),
    Option("eval_subset", Int(1), int_text, flag="--num-images", aliases=("--eval-subset",), metavar="N",
           help="evaluate a fixed class-stratified sample of this many images (seeded by --seed)"),
    Option("seed", Int(0, 2**63 - 1), int_text, default=0,
           help="seed of the image sample and of a swapped encoding's new parameters"),
    Option("mean", Seq(Real(-1e3, 1e3), min_length=1), floats_text,
           help="normalisation mean for --model, one value or one per input channel (default: timm's pretrained_cfg)"),
    Option("std", Seq(Real(1e-6, 1e3), min_length=1), floats_text,
           help="normalisation std for --model, one value or one per input channel"),
    # empty from Python: no size sweep, only the aspect-ratio one (the command line's parser refuses empty text)
    Option("sizes", Seq(AnyOf(_SIDE, Seq(_SIDE, length=2))), parse_shapes,
           help="sizes and HxW shapes, e.g. 16,32,24x48 (default 0.5x..2x the training size)"),
    Option("scales", Seq(Real(0, 64, low_open=True), min_length=1), floats_text,
           help="sizes as multiples of each model's training size, e.g. 1,2,3,4 (4 = 16x the area)"),
    Option("aspect_ratios", Seq(Satisfies(_is_ratio_pair, f"a (width/height in [1/{MAX_ASPECT:g}, {MAX_ASPECT:g}], label) pair"),
                                min_length=1), parse_aspect_ratios,
           help="width:height ratios at a fixed token budget, e.g. 1:2,2:3,1:1,3:2,2:1"),
    Option("token_budget", Int(1, MAX_TOKEN_BUDGET), int_text,
           help="tokens of the aspect-ratio shapes (default: the training grid's)"),
    Option("resize", Seq(Choice(RESIZE_POLICIES), min_length=1, distinct=True), strings_text, default=("resize",),
           help=f"comma-separated resize policies from {list(RESIZE_POLICIES)}"),
    Option("extrapolation", Choice(EXTRAPOLATION_CHOICES), default="native",
           help="PE policy where the encoding declares policies: as built, forced, both (extend + interpolate) or all"),
    Option("labels", Seq(Str(), min_length=1), strings_text, help="comma-separated legend labels, one per checkpoint"),
    Option("out_dir", flag="--out", default="outputs/resolution", help="output folder for resolution.{json,md,png}"),
    Option("batch_size", Int(1, 2**20), int_text, default=256, help="images per forward pass"),
    Option("device", device_rule(), default="cpu", help="cpu or cuda[:i]"),
    Option("threads", Int(1, 4096), int_text, cli_only=True, help="torch CPU threads"),
    Option("title", Str()),
    Option("no_reuse", switch=True, default=False, cli_only=True,
           help="re-evaluate even results already in --out/resolution.json"),
    Option("quiet", switch=True, default=False,
           help="no progress on stderr (a line per row when stderr is not a terminal)"),
], conflicts=[
    Conflict("sizes", "scales", "--sizes gives the shapes themselves, --scales multiples of each model's training size; pass one"),
    Conflict("token_budget", "aspect_ratios", "the token budget sets the size of the aspect-ratio shapes", "requires"),
    Conflict("model", "weights", "a model name and its local weights file go together", "requires"),
    Conflict("weights", "model", "a model name and its local weights file go together", "requires"),
    Conflict("pos_encoding", "model", "a checkpoint keeps the encoding it was trained with; --pos-encoding applies to --model/--weights", "requires"),
    Conflict("model_kwargs", "model", "a checkpoint rebuilds the model it recorded; --model-kwargs applies to --model/--weights", "requires"),
    Conflict("mean", "model", "a checkpoint keeps the normalisation its data module recorded; --mean applies to --model/--weights", "requires"),
    Conflict("std", "model", "a checkpoint keeps the normalisation its data module recorded; --std applies to --model/--weights", "requires"),
    Conflict("allow_partial", "model", "checkpoints always load strictly; --allow-partial applies to --model/--weights", "requires"),
    Conflict("labels", "checkpoints", "--labels names the checkpoints, one label each", "requires"),
    Conflict("split", "data", "--split picks the split of a --data torchvision:<Name> set", "requires"),
])


def aspect_shapes(ratios: Sequence[float], tokens: int, patch: tuple[int, int]) -> list[tuple[int, int]]:
    """For each width/height ratio, the ``H x W`` (multiples of the patch) whose token grid is closest to the ratio
    and to ``tokens`` tokens (both on a log scale, the ratio counted twice)."""
    ph, pw = patch
    out = []
    for r in ratios:
        # the grids next to the ratio line from both axes (floor and ceil), so that a ratio and its inverse get
        # transposed grids (rounding one axis only gave 2:3 -> 5x3 but 3:2 -> 4x6, 15 vs 24 tokens)
        grids = set()
        for n in range(1, 4 * tokens + 1):
            for m in (math.floor(n * r), math.ceil(n * r)):
                grids.add((n, max(1, m)))
            for m in (math.floor(n / r), math.ceil(n / r)):
                grids.add((max(1, m), n))
        best = min(sorted(grids), key=lambda g: (2 * abs(math.log(g[1] / g[0] / r)) + abs(math.log(g[0] * g[1] / tokens)),
                                                 g[0] * g[1]))
        out.append((best[0] * ph, best[1] * pw))
    return out


# ------------------------------------------------------------------------------------------
# images -> model input
# ------------------------------------------------------------------------------------------
def prepare_batch(images: Sequence[torch.Tensor], shape: tuple[int, int], policy: str, mean: Sequence[float],
                  std: Sequence[float], in_chans: int) -> torch.Tensor:
    """uint8 images (any sizes) -> a normalised float batch ``(B, in_chans, H, W)`` under the resize ``policy``."""
    from vispe.data.image_datamodule import channel_fix, normalize_images, resize_images

    H, W = shape
    out = torch.zeros(len(images), in_chans, H, W)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, im in enumerate(images):  # resize images of one size together
        groups.setdefault(tuple(im.shape[-2:]), []).append(i)
    for (h, w), idx in groups.items():
        x = torch.stack([channel_fix(images[i], in_chans) for i in idx]).float().div_(255.0)
        if policy == "resize":
            y = resize_images(x, (H, W))
        elif policy == "crop":
            k = max(H / h, W / w)
            y = resize_images(x, (max(H, round(h * k)), max(W, round(w * k))))
            top, left = (y.shape[-2] - H) // 2, (y.shape[-1] - W) // 2
            y = y[..., top:top + H, left:left + W]
        elif policy == "pad":
            k = min(H / h, W / w)
            y = resize_images(x, (min(H, max(1, round(h * k))), min(W, max(1, round(w * k)))))
        else:
            raise ValueError(f"resize policy {policy!r} is not valid; choose one of {list(RESIZE_POLICIES)}")
        y = normalize_images(y, tuple(mean), tuple(std))  # the data module's; padding below is 0 = the mean colour
        top, left = (H - y.shape[-2]) // 2, (W - y.shape[-1]) // 2
        out[idx, :, top:top + y.shape[-2], left:left + y.shape[-1]] = y
    return out


# ------------------------------------------------------------------------------------------
# peak memory
# ------------------------------------------------------------------------------------------
def _reset_rss_peak() -> bool:
    try:  # Linux: writing 5 resets VmHWM, the peak resident set size
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _rss_peak_mib() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def _tensor_peak(fn: Callable[[], torch.Tensor], model: nn.Module) -> tuple[torch.Tensor, float | None]:
    """Run ``fn`` and return its output and the peak of live CPU tensor storage (MiB; weights included)."""
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError:  # a build without it: no tensor-level number
        return fn(), None
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        out = fn()
    peak = tracker.get_tracker_snapshot("peak")
    total = sum(v.get("Total", 0) for k, v in peak.items() if str(k).startswith("cpu"))
    return out, round(total / 2**20, 1)


# ------------------------------------------------------------------------------------------
# evaluation
# ------------------------------------------------------------------------------------------
@torch.inference_mode()
def evaluate_shapes(model: nn.Module, images: Sequence[torch.Tensor], labels: torch.Tensor, shapes: Sequence[tuple[int, int]],
                    mean: Sequence[float], std: Sequence[float], resize: str = "resize", batch_size: int = 256,
                    device: str | torch.device = "cpu", name: str = "the model",
                    on_batch: Callable[[int], None] | None = None) -> dict[tuple[int, int], dict[str, Any]]:
    """Top-1 / top-5 accuracy (%) and peak memory of ``model`` on ``images`` brought to each ``H x W``
    (``on_batch(H * W)`` is called after every batch: progress, weighted by the batch's pixels).

    Non-finite logits stop the evaluation (``ValueError`` naming ``name``, the shape and the batch): an accuracy
    computed from NaN scores is not a measurement."""
    device = torch.device(device)
    in_chans = model_in_chans(model)
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for shape in shapes:
        t0 = time.perf_counter()
        top1 = topk = 0
        k = 1
        memory: dict[str, Any] = {}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        rss = _reset_rss_peak() if device.type == "cpu" else False
        for i in range(0, len(images), batch_size):
            x = prepare_batch(images[i:i + batch_size], shape, resize, mean, std, in_chans).to(device)
            y = labels[i:i + batch_size].to(device)
            if i == 0 and device.type == "cpu":
                logits, memory["tensor_peak_mib"] = _tensor_peak(lambda x=x: model(x), model)
            else:
                logits = model(x)
            bad = ~torch.isfinite(logits).all(-1)
            if bool(bad.any()):
                raise ValueError(f"{name} gives non-finite logits (NaN/inf) for {int(bad.sum())} of {len(bad)} images at "
                                 f"{shape[0]}x{shape[1]} (images {i}..{i + len(bad) - 1}); its accuracy would be meaningless")
            k = min(5, logits.shape[-1])
            pred = logits.topk(k, dim=-1).indices
            top1 += int((pred[:, 0] == y).sum())
            topk += int((pred == y[:, None]).any(-1).sum())
            if on_batch is not None:
                on_batch(shape[0] * shape[1])
        if device.type == "cuda":
            memory["cuda_max_allocated_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
        if rss:
            memory["rss_peak_mib"] = _rss_peak_mib()
        n = len(images)
        out[tuple(shape)] = {"top1": 100.0 * top1 / n, f"top{k}": 100.0 * topk / n, "peak_memory": memory,
                             "seconds": round(time.perf_counter() - t0, 2)}
    return out


def model_in_chans(model: nn.Module) -> int:
    inner = getattr(model, "model", model)
    return int(inner.patch_embed.proj.in_channels)


# ------------------------------------------------------------------------------------------
# model sources
# ------------------------------------------------------------------------------------------
@dataclass
class ModelSource:
    """A classifier to sweep and what is known about it (built once; policies are switched in place)."""

    label: str
    model: nn.Module
    key: str  # identity for reusing earlier results (file, size, mtime, encoding)
    encoding: str | None
    train_shape: tuple[int, int]
    patch: tuple[int, int]
    num_classes: int
    classes: tuple[str, ...] | None
    mean: tuple[float, ...]
    std: tuple[float, ...]
    origin: str
    own_set: Callable[[], Any] | None = field(default=None, repr=False)  # the checkpoint's recorded test split
    dynamic_pad: bool = False
    checkpoint: str | None = None  # the Lightning checkpoint's path, when it is one


def _vit(model: nn.Module) -> nn.Module:
    return getattr(model, "model", model)


def _file_key(path: str | Path, *extra: Any) -> str:
    """A model's identity for reusing results: its file's SHA-256 (not its name or time) and how it was built."""
    from vispe.files import file_digest

    return json.dumps([file_digest(path), *extra], default=str)


def check_finite_model(model: nn.Module, where: str) -> None:
    """Refuse a model with a non-finite parameter or buffer (naming the first such tensor): it cannot be scored."""
    for kind, tensors in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in tensors:
            if t.is_floating_point() or t.is_complex():
                bad = ~torch.isfinite(t)
                if bool(bad.any()):
                    raise ValueError(f"{where}: {kind} {name} {tuple(t.shape)} holds {int(bad.sum())} non-finite values (NaN/inf); "
                                     "a model with non-finite weights cannot be scored (a damaged file or a diverged run)")


def _checkpoint(path: str | Path) -> dict[str, Any]:
    from vispe.files import read_checkpoint

    from vispe.runs import is_distributed_checkpoint

    path = Path(path)
    if not path.is_file() and not is_distributed_checkpoint(path):  # a sharded run's checkpoint is a folder
        raise FileNotFoundError(f"checkpoint not found: {str(path)!r}")
    ckpt = read_checkpoint(path)  # weights_only: a checkpoint's pickle never runs code
    if not isinstance(ckpt, dict) or "hyper_parameters" not in ckpt or "state_dict" not in ckpt:
        raise ValueError(f"{str(path)!r} is not a Lightning checkpoint of vispe.tasks.ImageClassification (no hyper_parameters); "
                         "for timm weights use --model NAME --weights FILE")
    saved_class = ckpt["hyper_parameters"].get("_class_path")
    if saved_class not in (None, "vispe.tasks.ImageClassification", "vispe.tasks.classification.ImageClassification"):
        raise ValueError(f"{str(path)!r} is a checkpoint of {saved_class}; the resolution sweep takes vispe.tasks.ImageClassification checkpoints")
    return ckpt


def _encoding_spec(hp: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    from vispe.encodings.spec import parse_pos_encoding

    spec = hp.get("pos_encoding")
    if spec is None:
        spec = (hp.get("model_kwargs") or {}).get("pos_encoding")
    return (None, {}) if spec is None else parse_pos_encoding(spec)


def load_classifier(ckpt: dict[str, Any], extrapolation: str | None = None) -> nn.Module:
    """Rebuild the ``ImageClassification`` of a checkpoint (eval mode), optionally switching its extrapolation policy."""
    from vispe.tasks import ImageClassification

    hp = dict(ckpt["hyper_parameters"])
    hp.pop("_instantiator", None)
    valid = set(inspect.signature(ImageClassification.__init__).parameters) - {"self"}
    module = ImageClassification(**{k: v for k, v in hp.items() if k in valid})
    module.load_state_dict(ckpt["state_dict"], strict=True)
    module.eval()
    if extrapolation is not None:
        if extrapolation not in extrapolation_policies(module):
            raise ValueError(f"encoding {_encoding_spec(hp)[0]!r} has no extrapolation={extrapolation!r}; "
                             f"it declares {list(extrapolation_policies(module))}")
        set_extrapolation(module, extrapolation)
    return module


def _recorded(dm_info: dict[str, Any], data_dir: str | None) -> tuple[Callable[[], Any], tuple[str, ...] | None, tuple, tuple]:
    """(the recorded DataModule's test split as an EvalSet, its class names, mean, std), reading only test files."""
    import importlib

    from vispe.data import eval_sets
    from vispe.data.loading import locate_recorded_paths
    from vispe.data.image import CIFAR_MEAN, CIFAR_STD, FASHION_MNIST_MEAN, FASHION_MNIST_STD, former_record

    dm_info = former_record(dm_info)  # an ImageDataModule record in its data set's flat, former form
    class_path = str(dm_info.get("class_path", ""))
    short = class_path.rsplit(".", 1)[-1]
    init = locate_recorded_paths(dict(dm_info.get("init_args") or {}), dm_info.get("cwd"), f"the checkpoint's {short}",
                                 "pass --data with the images to evaluate on (or --data-dir for a data set that moved)")
    recorded_dir = init.get("data_dir")
    where = data_dir if data_dir else (recorded_dir if recorded_dir and Path(recorded_dir).exists() else None)
    if short == "CIFAR10JpegDataModule":
        return (lambda: eval_sets.cifar10_test(where, flag="--data-dir")), eval_sets.CIFAR10_CLASSES, CIFAR_MEAN, CIFAR_STD
    if short == "FashionMNISTDataModule":
        return (lambda: eval_sets.fashion_mnist_test(where, flag="--data-dir")), eval_sets.FASHION_MNIST_CLASSES, FASHION_MNIST_MEAN, FASHION_MNIST_STD
    module, _, name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    accepted = inspect.signature(cls.__init__).parameters
    if data_dir is not None and "data_dir" in accepted:
        init["data_dir"] = data_dir
    init["eval_subset"] = None  # the sweep draws its own stratified sample
    built: list[Any] = []

    def datamodule() -> Any:  # built when needed: with --data and a recorded mean/std, its files are never read
        if not built:
            built.append(cls(**{k: v for k, v in init.items() if k in accepted}))
        return built[0]

    if "mean" in init and "std" in init and short != "ImageFolderDataModule":
        classes, mean, std = None, tuple(init["mean"]), tuple(init["std"])
    else:
        dm = datamodule()
        classes = tuple(dm.classes) if getattr(dm, "classes", None) else None
        mean, std = tuple(dm.mean), tuple(dm.std)

    def own_set():
        from vispe.data.image_datamodule import _labels_of

        dm = datamodule()
        dm.setup("test")
        ds = dm.test_set
        labels = _labels_of(ds)
        if labels is None:
            labels = torch.tensor([int(ds[i][1]) for i in range(len(ds))])
        return eval_sets.EvalSet(f"{name} test split ({len(ds)} images)", labels.long(), lambda i: ds[i][0], classes,
                                 lambda: _recorded_content(class_path, init))

    return own_set, classes, mean, std


def _recorded_content(class_path: str, init: dict[str, Any]) -> Any:
    """A recorded DataModule's content identity: its arguments and the files under the paths among them."""
    from vispe.data.eval_sets import file_stats

    files = []
    for v in init.values():
        if isinstance(v, (str, Path)) and str(v) and Path(v).exists():
            p = Path(v)
            files += [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    return [class_path, init, file_stats(files)]


def checkpoint_source(path: str | Path, data_dir: str | None = None, label: str | None = None) -> ModelSource:
    """A vispe Lightning checkpoint as a :class:`ModelSource` (its recorded test split as the default set)."""
    ckpt = _checkpoint(path)
    if "vispe_datamodule" not in ckpt:
        raise ValueError(f"{str(path)!r} records no DataModule (train it with 'vispe fit' / vispe.tasks.ImageClassification)")
    try:
        module = load_classifier(ckpt)
    except (RuntimeError, TypeError, KeyError) as err:  # weights that do not fit the recorded hyper-parameters
        raise ValueError(f"{str(path)!r}: its weights do not rebuild its recorded model ({type(err).__name__}: {' '.join(str(err).split())[:400]})") from None
    except ValueError as err:  # a recorded option vispe refuses (an unknown encoding, ...): say which file records it
        raise ValueError(f"{str(path)!r} records a model vispe cannot build: {err}") from None
    check_finite_model(module, f"checkpoint {str(path)!r}")
    own_set, classes, mean, std = _recorded(ckpt["vispe_datamodule"], data_dir)
    vit = _vit(module)
    name, _ = _encoding_spec(dict(ckpt["hyper_parameters"]))
    return ModelSource(label or name or str(ckpt["hyper_parameters"].get("model")), module, _file_key(path), name,
                       tuple(vit.patch_embed.img_size), tuple(vit.patch_embed.patch_size), int(vit.num_classes), classes,
                       tuple(mean), tuple(std), f"checkpoint {path}", own_set, bool(vit.patch_embed.dynamic_img_pad), str(path))


def _timm_vit_args(name: str, kwargs: dict[str, Any]) -> tuple[dict[str, Any], nn.Module]:
    """The ``VisionTransformer`` arguments of timm model ``name`` (built without weights), to rebuild it in vispe."""
    import timm
    from timm.layers import LayerScale
    from timm.models.vision_transformer import VisionTransformer

    try:
        ref = timm.create_model(name, pretrained=False, **kwargs)
    except RuntimeError as err:  # timm: "Unknown model"
        raise ValueError(f"--model {name!r}: {err}") from None
    if not isinstance(ref, VisionTransformer):
        raise ValueError(f"--model {name!r} is a timm {type(ref).__name__}; vispe rebuilds timm VisionTransformer models "
                         "(vit_*, deit_*) and its own vispe_* models" + _rope_vit_hint(name, ref))
    blk = ref.blocks[0]
    args = dict(
        img_size=tuple(ref.patch_embed.img_size), patch_size=tuple(ref.patch_embed.patch_size),
        in_chans=ref.patch_embed.proj.in_channels, num_classes=ref.num_classes, global_pool=ref.global_pool,
        embed_dim=ref.embed_dim, depth=len(ref.blocks), num_heads=blk.attn.num_heads,
        mlp_ratio=blk.mlp.fc1.out_features / ref.embed_dim, qkv_bias=blk.attn.qkv.bias is not None,
        class_token=ref.cls_token is not None, reg_tokens=ref.num_reg_tokens, no_embed_class=ref.no_embed_class,
        pre_norm=not isinstance(ref.norm_pre, nn.Identity), fc_norm=not isinstance(ref.fc_norm, nn.Identity),
        init_values=1e-5 if isinstance(blk.ls1, LayerScale) else None, dynamic_img_pad=ref.patch_embed.dynamic_img_pad,
        dynamic_img_size=True,
    )
    return args, ref


def _rope_vit_hint(name: str, ref: nn.Module) -> str:
    """For timm's RoPE ViTs (``vit_*_patch16_rope[_mixed]_224``, timm's ``Eva`` class): the vispe command that loads
    their weights (the block weights map one to one; the rotary frequencies of ``rope_mixed`` are kept)."""
    if getattr(ref, "rope", None) is None or "_rope" not in name:
        return ""
    pe = "rope_mixed" if "rope_mixed" in name else "rope_axial"
    sizes = {192: "tiny", 384: "small", 768: "base"}
    size = sizes.get(int(getattr(ref, "embed_dim", 0)))
    patch = tuple(ref.patch_embed.patch_size)
    img = tuple(ref.patch_embed.img_size)
    vispe_name = f"vispe_vit_{size}_patch16_224" if size else "vispe_vit_base_patch16_224"
    extra = {}
    if size is None:
        extra.update(embed_dim=int(ref.embed_dim), depth=len(ref.blocks), num_heads=int(ref.blocks[0].attn.num_heads))
    if patch != (16, 16):
        extra["patch_size"] = patch[0]
    if img != (224, 224):
        extra["img_size"] = img[0]
    kw = f" --model-kwargs '{json.dumps(extra)}'" if extra else ""
    return (f". Its weights are a RoPE ViT's: load them into the vispe model with the same encoding, "
            f"--model {vispe_name} --pos-encoding {pe}{kw} --weights FILE (several --pos-encoding values compare encodings "
            "on the same block weights)")


def weights_sources(model_name: str, weights: str | Path, encodings: Sequence[str] = ("learned",),
                    model_kwargs: dict[str, Any] | None = None, mean: Sequence[float] | None = None,
                    std: Sequence[float] | None = None, classes: Sequence[str] | None = None, init_seed: int = 0,
                    allow_partial: bool = False) -> list[ModelSource]:
    """One :class:`ModelSource` per encoding: the weights of ``weights`` (a timm ViT state dict, ``.pth`` /
    ``.safetensors``) in the vispe model of ``model_name`` (a timm ViT name or a ``vispe_*`` model) with that
    encoding, loaded through :func:`vispe.models.checkpoint.load_timm_checkpoint`. ``learned`` keeps timm's APE;
    other encodings are a zero-shot swap (the APE table is dropped, the encoding's own parameters are new, drawn
    from ``init_seed`` so that the same command gives the same numbers).

    The model must be the file's: a load that leaves any tensor outside a swapped encoding newly initialised (a
    deeper model than the file's), or drops any of the file's tensors other than its position table, is refused
    unless ``allow_partial``; non-finite weights are refused always."""
    import timm

    from vispe.models import VispeVisionTransformer
    from vispe.models.checkpoint import _as_state_dict, _unwrap, load_timm_checkpoint

    OPTIONS.check(dict(model_kwargs=model_kwargs, mean=list(mean) if mean is not None else None,
                       std=list(std) if std is not None else None, seed=init_seed))
    state = _unwrap(_as_state_dict(weights))
    head = state.get("head.weight")
    if head is None or head.ndim != 2:
        raise ValueError(f"{str(weights)!r} has no classifier head (head.weight); the sweep scores a classifier's predictions")
    kwargs = dict(model_kwargs or {}, num_classes=int(head.shape[0]))
    if model_name.startswith("vispe_"):
        cfg = timm.models.get_pretrained_cfg(model_name) or {}

        def build(enc: str) -> nn.Module:
            return timm.create_model(model_name, pretrained=False, pos_encoding=enc, **kwargs)
    else:
        args, ref = _timm_vit_args(model_name, kwargs)
        cfg = ref.pretrained_cfg or {}
        reference = {k: tuple(v.shape) for k, v in ref.state_dict().items() if k != "pos_embed"}

        def build(enc: str) -> nn.Module:
            m = VispeVisionTransformer(pos_encoding=enc, **args)
            mine = {k: tuple(v.shape) for k, v in m.state_dict().items() if not k.startswith("pos_encoding.")}
            if mine != reference:
                diff = sorted(set(mine.items()) ^ set(reference.items()))[:4]
                raise ValueError(f"--model {model_name!r}: vispe's rebuild differs from timm's ({diff}); this timm ViT variant "
                                 "is not supported (use a vispe_* model with --model-kwargs)")
            return m
    cfg = cfg if isinstance(cfg, dict) else cfg.to_dict()
    mean = tuple(mean) if mean is not None else tuple(cfg.get("mean", (0.485, 0.456, 0.406)))
    std = tuple(std) if std is not None else tuple(cfg.get("std", (0.229, 0.224, 0.225)))
    out = []
    for enc in encodings:
        with torch.random.fork_rng(devices=[]):  # the new parameters of a swapped encoding: seeded, the caller's RNG untouched
            torch.manual_seed(init_seed)
            model = build(enc)
        report = load_timm_checkpoint(model, state)
        model.eval()
        _check_complete_load(report, enc, model_name, weights, allow_partial)
        check_finite_model(model, f"--weights {str(weights)!r} in --model {model_name!r} ({enc})")
        chans = model_in_chans(model)
        for what, values in (("mean", mean), ("std", std)):
            if len(values) not in (1, chans):
                raise ValueError(f"--{what} has {len(values)} values ({', '.join(f'{v:g}' for v in values)}) but --model "
                                 f"{model_name!r} takes {chans} input channels; give {chans} values (or one for all channels)")
        out.append(ModelSource(
            enc, model, _file_key(weights, model_name, enc, sorted((model_kwargs or {}).items()), init_seed, allow_partial),
            model.pos_encoding_name,
            tuple(model.patch_embed.img_size), tuple(model.patch_embed.patch_size), int(model.num_classes),
            tuple(classes) if classes is not None else None, mean, std,
            f"{model_name} + {Path(weights).name} ({len(report.kept)} kept, {len(report.resampled)} resampled, "
            f"{len(report.new)} new (seed {init_seed}), {len(report.dropped)} dropped)", None, bool(model.patch_embed.dynamic_img_pad)))
    return out


#: What a zero-shot encoding swap drops from a timm file by design: its position table and rotary frequencies.
_POSITION_KEYS = ("pos_embed", "rope.freqs", "dist_token")


def _check_complete_load(report: Any, encoding: str, model_name: str, weights: str | Path, allow_partial: bool) -> None:
    """Refuse a load that leaves the evaluated model partly random: a new tensor outside the encoding (or inside it when
    the encoding is ``learned``, timm's own), or a dropped file tensor other than the position table."""
    swapped = encoding != "learned"
    new = [k for k in report.new if not (swapped and k.startswith("pos_encoding."))]
    dropped = [k for k in report.dropped if not k.startswith(_POSITION_KEYS)]
    if (new or dropped) and not allow_partial:
        parts = []
        if new:
            parts.append(f"leaves {len(new)} model tensors newly initialised ({', '.join(new[:3])}{', ...' if len(new) > 3 else ''})")
        if dropped:
            parts.append(f"drops {len(dropped)} of the file's tensors ({', '.join(dropped[:3])}{', ...' if len(dropped) > 3 else ''})")
        raise ValueError(f"--weights {str(weights)!r} in --model {model_name!r} ({encoding}) {' and '.join(parts)}: the scored "
                         "model would be partly random; give the model the file's architecture (--model-kwargs), "
                         "or pass --allow-partial to score it anyway")


# ------------------------------------------------------------------------------------------
# the sweep
# ------------------------------------------------------------------------------------------
def _policies_for(source: ModelSource, extrapolation: str) -> list[str | None]:
    declared = extrapolation_policies(source.model)
    if not declared:
        return [None]
    if extrapolation == "native":
        return [get_extrapolation(source.model)]
    if extrapolation == "both":
        return [p for p in declared if p in ("extend", "interpolate")]
    if extrapolation == "all":
        return list(declared)
    if extrapolation not in declared:
        raise ValueError(f"{source.label}: encoding {source.encoding!r} has no extrapolation={extrapolation!r}; it declares "
                         f"{list(declared)} (or use --extrapolation native / both / all)")
    return [extrapolation]


def _default_shapes(source: ModelSource, scales: Sequence[float] | None) -> list[tuple[int, int]]:
    (h, w), (ph, pw) = source.train_shape, source.patch
    if scales is None and (h, w) == (32, 32) and (ph, pw) in ((4, 4), (8, 8)):
        return [(s, s) for s in DEFAULT_SIZES]
    scales = scales or (0.5, 0.75, 1, 1.25, 1.5, 1.75, 2)
    return list(dict.fromkeys((max(1, round(h * f / ph)) * ph, max(1, round(w * f / pw)) * pw) for f in scales))


def _shape_name(shape: Sequence[int]) -> str:
    return f"{shape[0]}x{shape[1]}"


def _result_key(source: ModelSource, eval_set: Any, **evaluation: Any) -> str:
    """What produced a result: the model (its file's SHA-256 and how it was built), the image set's content, every
    evaluation option, and the vispe / torch versions. A result is reused only when all of them are equal."""
    import vispe

    return json.dumps({"model": source.key, "label": source.label, "mean": list(source.mean), "std": list(source.std),
                       "images": eval_set.description, "images_content": eval_set.content_key(), **evaluation,
                       "vispe": vispe.__version__, "torch": torch.__version__}, sort_keys=True, default=str)


def _previous_results(path: Path) -> dict[str, dict[str, Any]]:
    """Earlier results in ``resolution.json`` by key; the file must be a sweep's (an object with a results list)."""
    if not path.is_file():
        return {}
    from vispe.files import DamagedFileError

    saved = read_json(path, "earlier sweep results")
    lists = [saved.get("results"), saved.get("other_results", [])] if isinstance(saved, dict) else None
    if lists is None or not all(isinstance(x, list) and all(isinstance(r, dict) for r in x) for x in lists):
        raise DamagedFileError(path, f"is not a resolution sweep's results (a JSON object with a 'results' list; "
                                     f"this holds a {type(saved).__name__})",
                               "choose another --out folder, or move the file away (or pass --no-reuse to overwrite it)")
    return {r["key"]: r for r in lists[0] + lists[1] if "key" in r}


def _remove_stale_temp(path: Path) -> None:
    """Temporary files of ``resolution.json`` left by a sweep that died while writing (a kill, a full disk)."""
    from vispe.files import remove_stale_temp_files

    remove_stale_temp_files(path.parent, path.name)
    legacy = path.with_name(path.name + ".tmp")  # the fixed name earlier versions wrote through
    if legacy.is_file():
        legacy.unlink()


def run_sweep(
    checkpoints: Sequence[str | Path] = (),
    sizes: Sequence[int | tuple[int, int]] | None = None,
    extrapolation: str = "native",
    out_dir: str | Path = "outputs/resolution",
    labels: Sequence[str] | None = None,
    eval_subset: int | None = None,
    data_dir: str | None = None,
    batch_size: int = 256,
    title: str | None = None,
    reuse: bool = True,
    *,
    sources: Sequence[ModelSource] = (),
    data: str | None = None,
    data_root: str | None = None,
    split: str = "test",
    classes: Sequence[str] | None = None,
    allow_class_subset: bool = False,
    seed: int = 0,
    scales: Sequence[float] | None = None,
    aspect_ratios: Sequence[tuple[float, str]] | None = None,
    token_budget: int | None = None,
    resize: Sequence[str] = ("resize",),
    device: str = "cpu",
    quiet: bool = False,
) -> dict[str, Any]:
    """Run the sweep and write ``resolution.{json,md,png}`` into ``out_dir``; returns the JSON dict.

    Everything is checked (sources, sizes, policies, the image set and its classes against every model's head)
    before any image is decoded or any model evaluated.
    """
    from vispe.data.eval_sets import class_index_map, open_eval_set, stratified_indices

    OPTIONS.check(dict(checkpoints=list(checkpoints), sizes=sizes, extrapolation=extrapolation, labels=labels,
                       eval_subset=eval_subset, batch_size=batch_size, title=title, split=split, seed=seed, scales=scales,
                       aspect_ratios=aspect_ratios, token_budget=token_budget, resize=list(resize), device=device, data=data))
    if not checkpoints and not sources:
        raise ValueError("give at least one checkpoint or --model NAME --weights FILE")
    if labels is not None and len(labels) != len(checkpoints):
        raise ValueError(f"{len(labels)} labels for {len(checkpoints)} checkpoints")
    if sizes is not None and len(sizes) == 0 and not aspect_ratios:
        raise ValueError("nothing to evaluate: sizes is empty and no aspect_ratios are given")

    # 1) sources, shapes, policies, the image set and its class mapping: all before any compute
    srcs = [checkpoint_source(p, data_dir, labels[i] if labels is not None else None) for i, p in enumerate(checkpoints)]
    if classes is not None:
        for s in srcs:
            s.classes = tuple(classes)
    srcs += list(sources)
    base = [s.label for s in srcs]
    for s in srcs:  # disambiguate identical labels with the checkpoint's run folder
        if base.count(s.label) > 1 and s.checkpoint is not None:
            p = Path(s.checkpoint)
            s.label = f"{s.label} [{p.parent.parent.name}/{p.stem}]"
    shared_set = open_eval_set(data, data_root, split) if data is not None else None
    jobs = []
    for s in srcs:
        ph, pw = s.patch
        size_shapes = [(v, v) if isinstance(v, int) else tuple(v) for v in sizes] if sizes is not None else _default_shapes(s, scales)
        aspect = []
        if aspect_ratios:
            budget = token_budget or (s.train_shape[0] // ph) * (s.train_shape[1] // pw)
            aspect = aspect_shapes([r for r, _ in aspect_ratios], budget, s.patch)
        points = [("size", sh, None) for sh in size_shapes] + [("aspect", sh, name) for sh, (_, name) in zip(aspect, aspect_ratios or [])]
        bad = sorted({_shape_name(sh) for _, sh, _ in points if sh[0] % ph or sh[1] % pw})
        if bad and not s.dynamic_pad:
            raise ValueError(f"shapes {bad} cannot be tiled by the patch size {ph}x{pw} of {s.label}; use multiples of {ph}x{pw}")
        eval_set = shared_set if shared_set is not None else (s.own_set() if s.own_set is not None else None)
        if eval_set is None:
            raise ValueError(f"{s.label} ({s.origin}) records no image set; give one with --data")
        label_map = class_index_map(eval_set.classes, eval_set.num_classes, s.classes, s.num_classes,
                                    allow_subset=allow_class_subset, set_name=eval_set.description, model_name=s.label)
        jobs.append(dict(source=s, policies=_policies_for(s, extrapolation), points=points, set=eval_set, label_map=label_map))

    # 2) decode the stratified sample of each set once
    out = Path(out_dir)
    previous = _previous_results(out / "resolution.json") if reuse else {}
    _remove_stale_temp(out / "resolution.json")
    decoded: dict[int, tuple[list[torch.Tensor], torch.Tensor]] = {}
    results = []
    from vispe.progress import RowProgress

    batches = max((-(-min(len(j["set"].labels), eval_subset or len(j["set"].labels)) // batch_size) for j in jobs), default=1)
    points = max(jobs, key=lambda j: len(j["points"]))["points"] if jobs else []
    progress = RowProgress(sum(len(j["policies"]) * len(resize) for j in jobs), batches * max(1, len(points)), quiet=quiet,
                           work_per_row=batches * sum(sh[0] * sh[1] for _, sh, _ in points) or None)  # work: pixels
    for j in jobs:
        s, es = j["source"], j["set"]
        keep = stratified_indices(es.labels, eval_subset, seed)
        for policy in j["policies"]:
            for rp in resize:
                key = _result_key(s, es, policy=policy, resize=rp, points=[(k, list(sh)) for k, sh, _ in j["points"]],
                                  eval_subset=eval_subset, seed=seed, label_map=j["label_map"].tolist(), device=str(device),
                                  batch_size=batch_size)
                if key in previous:
                    results.append(previous[key])
                    progress.skip_row()
                    continue
                if id(es) not in decoded:
                    decoded[id(es)] = (es.load(keep.tolist()), es.labels[keep])
                images, targets = decoded[id(es)]
                if policy is not None:
                    set_extrapolation(s.model, policy)
                model = s.model.to(device)
                label = s.label + ("" if policy is None else f" ({policy})") + ("" if len(resize) == 1 else f" [{rp}]")
                progress.start_row(label)
                acc = evaluate_shapes(model, images, j["label_map"][targets], [sh for _, sh, _ in j["points"]], s.mean, s.std,
                                      rp, batch_size, device, name=label, on_batch=progress.step)
                progress.end_row()
                evaluations = [{"sweep": kind, "shape": _shape_name(sh), "height": sh[0], "width": sh[1],
                                "tokens": (sh[0] // s.patch[0]) * (sh[1] // s.patch[1]), "aspect": sh[1] / sh[0],
                                **({"aspect_label": name} if name else {}), **acc[tuple(sh)]} for kind, sh, name in j["points"]]
                squares = {str(e["height"]): {k: v for k, v in e.items() if k.startswith("top")}
                           for e in evaluations if e["sweep"] == "size" and e["height"] == e["width"]}
                results.append({
                    "label": label, "source": s.origin, "checkpoint": s.checkpoint, "encoding": s.encoding,
                    "extrapolation": policy if policy is not None else "own (no option)",
                    "active_policy": get_extrapolation(s.model), "resize": rp,
                    "train_shape": _shape_name(s.train_shape), "patch": _shape_name(s.patch),
                    "data": es.description, "num_samples": len(targets), "seed": seed, "device": str(device),
                    "evaluations": evaluations, "key": key,
                    # square sizes by side, and the training side: what vispe.benchmarks.resolution_benchmark reads
                    "accuracy": squares, "train_size": s.train_shape[0] if s.train_shape[0] == s.train_shape[1] else None,
                })
                print(f"{label:36s} " + " ".join(f"{e['shape']}:{e['top1']:.1f}" for e in evaluations), flush=True)
                _write_partial(out, results, previous)

    report = {
        "protocol": {
            "resize": {rp: RESIZE_TEXT[rp] for rp in resize}, "interpolation": "bicubic, antialias",
            "extrapolation": extrapolation, "metric": "top-1 accuracy (%), micro",
            "subset": f"{eval_subset} images, class-stratified, seed {seed}" if eval_subset else "every image",
            "peak_memory": "CUDA: max_memory_allocated over the shape's batches; CPU: tensor_peak_mib = peak live tensor "
                           "storage during the first batch (weights included), rss_peak_mib = process peak RSS during the shape",
        },
        "results": results,
    }
    used = {r.get("key") for r in results}
    others = [r for k, r in previous.items() if k not in used]
    if others:
        report["other_results"] = others
    write_json_atomic(out / "resolution.json", report, "sweep results")
    (out / "resolution.md").write_text(markdown_table(report))
    plot(report, out / "resolution.png", title=title)
    return report


def _write_partial(out: Path, results: list[dict[str, Any]], previous: dict[str, dict[str, Any]]) -> None:
    """Save finished evaluations so an interrupted sweep can be resumed (they are reused by key)."""
    done = {r["key"]: r for r in list(previous.values()) + results}
    write_json_atomic(out / "resolution.json", {"partial": True, "results": list(done.values())}, "sweep results")


# ------------------------------------------------------------------------------------------
# table and plot
# ------------------------------------------------------------------------------------------
def _columns(results: list[dict[str, Any]], sweep: str) -> list[str]:
    cols = {}
    for r in results:
        for e in r["evaluations"]:
            if e["sweep"] == sweep:
                cols[e["shape"]] = (e["aspect"], e["height"] * e["width"]) if sweep == "aspect" else (e["height"] * e["width"], e["aspect"])
    return sorted(cols, key=cols.get)


def _memory_mib(e: dict[str, Any]) -> float | None:
    m = e.get("peak_memory") or {}
    return m.get("cuda_max_allocated_mib", m.get("tensor_peak_mib"))


def markdown_table(report: dict[str, Any]) -> str:
    results = report["results"]
    lines = []
    for sweep, title in (("size", "by input shape H x W"), ("aspect", "by aspect ratio width:height at a fixed token budget")):
        cols = _columns(results, sweep)
        if not cols:
            continue
        heads = []
        for c in cols:
            e = next(e for r in results for e in r["evaluations"] if e["shape"] == c and e["sweep"] == sweep)
            train = any(r["train_shape"] == c for r in results)
            heads.append((f"{e.get('aspect_label', '')} " if sweep == "aspect" else "") + c + (f" ({e['tokens']} tok)" if sweep == "aspect" else "") + ("*" if train else ""))
        for what, cell in (("top-1 accuracy (%)", lambda e: f"{e['top1']:.1f}"),
                           ("peak memory (MiB)", lambda e: "" if _memory_mib(e) is None else f"{_memory_mib(e):.1f}")):
            lines += [f"**{what} {title}**", "", "| model (policy) | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(cols)]
            for r in results:
                by = {e["shape"]: e for e in r["evaluations"] if e["sweep"] == sweep}
                lines.append(f"| {r['label']} | " + " | ".join(cell(by[c]) if c in by else "" for c in cols) + " |")
            lines.append("")
    sets = sorted({f"{r['data']}: {r['num_samples']} evaluated" for r in results})
    p = report["protocol"]
    lines.append(f"Images: {'; '.join(sets)} ({p['subset']}). * = a model's training shape. Resize: "
                 + "; ".join(f"{k}: {v}" for k, v in p["resize"].items()) + f" ({p['interpolation']}). "
                 f"Peak memory: {p['peak_memory']}.")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: str | Path, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    has_aspect = any(e["sweep"] == "aspect" for r in results for e in r["evaluations"])
    entries = len(results) + len({r["train_shape"] for r in results})
    ncol = 1 if entries <= 4 else 2 if entries <= 12 else 3
    legend_in = 0.2 * math.ceil(entries / ncol) + 0.75  # inches below the axes for the legend (and its 3-line title)
    fig, axes = plt.subplots(1, 2 if has_aspect else 1, figsize=(15 if has_aspect else 10, 5.0 + legend_in), squeeze=False)
    sources = list(dict.fromkeys(r["source"] for r in results))
    colours = plt.get_cmap("tab10" if len(sources) <= 10 else "tab20").colors
    from vispe.benchmarks.grid import POLICY_LINE_NOTE, POLICY_STYLES as styles, accuracy_axes
    markers = {"resize": "o", "crop": "s", "pad": "^"}
    for sweep, ax in zip(("size", "aspect"), axes[0]):
        ticks: dict[float, str] = {}
        for r in results:
            pts = sorted((math.sqrt(e["height"] * e["width"]) if sweep == "size" else math.log2(e["aspect"]), e)
                         for e in r["evaluations"] if e["sweep"] == sweep)
            if not pts:
                continue
            for x, e in pts:
                ticks[x] = (e["shape"] if e["height"] != e["width"] else str(e["height"])) if sweep == "size" else f"{e['aspect_label']}\n{e['shape']}"
            ax.plot([x for x, _ in pts], [e["top1"] for _, e in pts], marker=markers.get(r["resize"], "o"), ms=4,
                    color=colours[sources.index(r["source"]) % len(colours)],
                    linestyle=styles.get(r["extrapolation"], "-"), label=r["label"])
        if sweep == "size":
            for ts in sorted({r["train_shape"] for r in results}):
                h, w = (int(t) for t in ts.split("x"))
                ax.axvline(math.sqrt(h * w), color="grey", lw=1.0, ls=":", label=f"training shape {ts} (grey dotted)")
            ax.set_xlabel("evaluated input (side in px; H x W where not square; x = sqrt(H*W))")
            ax.set_title(title or "Top-1 accuracy vs input size")
        else:
            ax.set_xlabel("aspect ratio width:height (evaluated H x W)")
            ax.set_title("Top-1 accuracy vs aspect ratio at a fixed token budget")
        xs = sorted(ticks)
        ax.set_xticks(xs)
        crowded = sweep == "size" and any(b - a < 0.04 * (xs[-1] - xs[0] or 1) for a, b in zip(xs, xs[1:]))
        ax.set_xticklabels([ticks[x] for x in xs], fontsize=7, rotation=45 if crowded or len(xs) > 10 else 0)
        ax.minorticks_off()
        accuracy_axes(ax)
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, fontsize=8, loc="lower center", ncol=ncol, frameon=False,
               title=f"model (extrapolation policy); marker: o resize, s crop, ^ pad\n{POLICY_LINE_NOTE}", title_fontsize=8)
    fig.tight_layout(rect=(0, legend_in / (5.0 + legend_in), 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------
def _read_classes(text: str | None) -> list[str] | None:
    if text is None:
        return None
    p = Path(text)
    if p.is_file():
        if p.suffix.lower() == ".json":
            names = read_json(p, "class names")
            if not isinstance(names, list):
                raise ValueError(f"{text!r}: a JSON class list is a list of names")
            return [str(n) for n in names]
        return [line.strip() for line in p.read_text().splitlines() if line.strip()]
    return [c.strip() for c in text.split(",") if c.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    from vispe.benchmarks.grid import benchmark_parser

    p = benchmark_parser("vispe resolution", __doc__, "raw")
    OPTIONS.add_to(p, {
        "timm / vispe model from a local weights file": ["model", "weights", "pos_encoding", "model_kwargs", "allow_partial"],
        "image set": ["data", "data_root", "data_dir", "split", "classes", "allow_class_subset", "eval_subset", "seed", "mean", "std"],
        "sizes, shapes, policies": ["sizes", "scales", "aspect_ratios", "token_budget", "resize", "extrapolation"],
        "run and output": ["labels", "out_dir", "batch_size", "device", "quiet", "threads", "title", "no_reuse"],
    })
    ns = p.parse_args(list(argv) if argv is not None else None)
    try:
        a = OPTIONS.from_namespace(ns)  # every value and every pair checked before anything is read or built
        if a["threads"] is not None:
            torch.set_num_threads(a["threads"])
        classes = _read_classes(ns.classes)
        sources = []
        if a["model"] is not None:
            from vispe.encodings.spec import parse_encoding_list

            encs = [label for label, _, _ in parse_encoding_list(a["pos_encoding"])] if a["pos_encoding"] else ["learned"]
            sources = weights_sources(a["model"], a["weights"], encs, a["model_kwargs"], a["mean"], a["std"], classes,
                                      init_seed=a["seed"], allow_partial=a["allow_partial"])
        report = run_sweep(
            a["checkpoints"], a["sizes"], a["extrapolation"], a["out_dir"], labels=a["labels"], eval_subset=a["eval_subset"],
            data_dir=a["data_dir"], batch_size=a["batch_size"], title=a["title"], reuse=not a["no_reuse"], sources=sources,
            data=a["data"], data_root=a["data_root"], split=a["split"], classes=classes,
            allow_class_subset=a["allow_class_subset"], seed=a["seed"], scales=a["scales"], aspect_ratios=a["aspect_ratios"],
            token_budget=a["token_budget"], resize=list(a["resize"]), device=a["device"], quiet=a["quiet"],
        )
    except (ValueError, FileNotFoundError) as err:
        print(f"vispe resolution: error: {err}", file=sys.stderr)
        return 2
    print(markdown_table(report))
    print(f"wrote {Path(a['out_dir']) / 'resolution.json'}, resolution.md, resolution.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
