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

import argparse
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
import torch.nn.functional as F

from vispe.files import read_json, write_json_atomic

__all__ = [
    "DEFAULT_SIZES", "EXTRAPOLATION_CHOICES", "RESIZE_POLICIES", "ModelSource", "aspect_shapes", "checkpoint_source",
    "evaluate_shapes", "load_classifier", "main", "parse_shapes", "policy_hooks", "prepare_batch", "run_sweep",
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
# extrapolation policies: the one place that finds and sets them
# ------------------------------------------------------------------------------------------
def policy_hooks() -> tuple[Callable[[nn.Module], tuple[str, ...]], Callable[[nn.Module, str], None], Callable[[nn.Module], str | None]]:
    """``(policies(model), set_policy(model, policy), active_policy(model))``: the encodings' resolution-options
    contract (:func:`vispe.encodings.extrapolation_policies`, :func:`~vispe.encodings.set_extrapolation`,
    :func:`~vispe.encodings.get_extrapolation`), applied to a loaded model without rebuilding it."""
    from vispe.encodings import extrapolation_policies, get_extrapolation, set_extrapolation

    return (lambda model: tuple(extrapolation_policies(model))), set_extrapolation, get_extrapolation


def extrapolation_modes(encoding: str | None) -> tuple[str, ...]:
    """The extrapolation policies a registered encoding (name or spec) declares (empty: a single, fixed policy)."""
    from vispe.encodings import extrapolation_policies

    return () if encoding is None else tuple(extrapolation_policies(encoding))


# ------------------------------------------------------------------------------------------
# shapes
# ------------------------------------------------------------------------------------------
def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"16,24,32x48"`` -> ``[(16, 16), (24, 24), (32, 48)]`` (``HxW`` or a square side), in the order given."""
    out = []
    for item in filter(None, str(text).replace(" ", "").split(",")):
        parts = item.lower().split("x")
        try:
            hw = (int(parts[0]), int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1])) if len(parts) == 2 else None
        except ValueError:
            hw = None
        if hw is None or min(hw) <= 0:
            raise ValueError(f"--sizes takes positive sizes or HxW shapes separated by commas (e.g. 16,32,24x48), got {item!r} in {text!r}")
        if hw not in out:
            out.append(hw)
    if not out:
        raise ValueError(f"--sizes is empty: {text!r}")
    return out


def _parse_floats(text: str, what: str) -> list[float]:
    try:
        vals = [float(s) for s in str(text).replace(" ", "").split(",") if s]
    except ValueError:
        vals = []
    if not vals or any(not (v > 0 and math.isfinite(v)) for v in vals):
        raise ValueError(f"{what} takes positive numbers separated by commas, got {text!r}")
    return vals


def parse_aspect_ratios(text: str) -> list[tuple[float, str]]:
    """``"1:2,1:1,2:1"`` (width:height) or decimals -> ``[(width / height, label), ...]``."""
    out = []
    for item in filter(None, str(text).replace(" ", "").split(",")):
        try:
            w, h = (float(t) for t in item.split(":")) if ":" in item else (float(item), 1.0)
        except ValueError:
            w = h = -1.0
        if not (w > 0 and h > 0):
            raise ValueError(f"--aspect-ratios takes width:height ratios (e.g. 1:2,1:1,2:1), got {item!r}")
        out.append((w / h, item))
    return out


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
def _resample(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    return F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=True)


def prepare_batch(images: Sequence[torch.Tensor], shape: tuple[int, int], policy: str, mean: Sequence[float],
                  std: Sequence[float], in_chans: int) -> torch.Tensor:
    """uint8 images (any sizes) -> a normalised float batch ``(B, in_chans, H, W)`` under the resize ``policy``."""
    from vispe.data.image_datamodule import channel_fix

    H, W = shape
    m = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
    out = torch.zeros(len(images), in_chans, H, W)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, im in enumerate(images):  # resize images of one size together
        groups.setdefault(tuple(im.shape[-2:]), []).append(i)
    for (h, w), idx in groups.items():
        x = torch.stack([channel_fix(images[i], in_chans) for i in idx]).float().div_(255.0)
        if policy == "resize":
            y = _resample(x, (H, W))
        elif policy == "crop":
            k = max(H / h, W / w)
            y = _resample(x, (max(H, round(h * k)), max(W, round(w * k))))
            top, left = (y.shape[-2] - H) // 2, (y.shape[-1] - W) // 2
            y = y[..., top:top + H, left:left + W]
        elif policy == "pad":
            k = min(H / h, W / w)
            y = _resample(x, (min(H, max(1, round(h * k))), min(W, max(1, round(w * k)))))
        else:
            raise ValueError(f"resize policy {policy!r} is not valid; choose one of {list(RESIZE_POLICIES)}")
        y = (y - m) / s  # padding below is 0 = the mean colour
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
                    device: str | torch.device = "cpu", on_batch: Callable[[int], None] | None = None) -> dict[tuple[int, int], dict[str, Any]]:
    """Top-1 / top-5 accuracy (%) and peak memory of ``model`` on ``images`` brought to each ``H x W``
    (``on_batch(H * W)`` is called after every batch: progress, weighted by the batch's pixels)."""
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
    p = Path(path)
    st = p.stat()
    return json.dumps([str(p.resolve()), st.st_size, st.st_mtime_ns, *extra], default=str)


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
        policies, set_policy, _ = policy_hooks()
        if extrapolation not in policies(module):
            raise ValueError(f"encoding {_encoding_spec(hp)[0]!r} has no extrapolation={extrapolation!r}; "
                             f"it declares {list(policies(module))}")
        set_policy(module, extrapolation)
    return module


def _recorded(dm_info: dict[str, Any], data_dir: str | None) -> tuple[Callable[[], Any], tuple[str, ...] | None, tuple, tuple]:
    """(the recorded DataModule's test split as an EvalSet, its class names, mean, std), reading only test files."""
    import importlib

    from vispe.data import eval_sets
    from vispe.data.loading import locate_recorded_paths
    from vispe.data.image import CIFAR_MEAN, CIFAR_STD, FASHION_MNIST_MEAN, FASHION_MNIST_STD

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
        return eval_sets.EvalSet(f"{name} test split ({len(ds)} images)", labels.long(), lambda i: ds[i][0], classes)

    return own_set, classes, mean, std


def checkpoint_source(path: str | Path, data_dir: str | None = None, label: str | None = None) -> ModelSource:
    """A vispe Lightning checkpoint as a :class:`ModelSource` (its recorded test split as the default set)."""
    ckpt = _checkpoint(path)
    if "vispe_datamodule" not in ckpt:
        raise ValueError(f"{str(path)!r} records no DataModule (train it with 'vispe fit' / vispe.tasks.ImageClassification)")
    try:
        module = load_classifier(ckpt)
    except (RuntimeError, TypeError, KeyError) as err:  # weights that do not fit the recorded hyper-parameters
        raise ValueError(f"{str(path)!r}: its weights do not rebuild its recorded model ({type(err).__name__}: {' '.join(str(err).split())[:400]})") from None
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
                    std: Sequence[float] | None = None, classes: Sequence[str] | None = None, init_seed: int = 0) -> list[ModelSource]:
    """One :class:`ModelSource` per encoding: the weights of ``weights`` (a timm ViT state dict, ``.pth`` /
    ``.safetensors``) in the vispe model of ``model_name`` (a timm ViT name or a ``vispe_*`` model) with that
    encoding, loaded through :func:`vispe.models.checkpoint.load_timm_checkpoint`. ``learned`` keeps timm's APE;
    other encodings are a zero-shot swap (the APE table is dropped, the encoding's own parameters are new, drawn
    from ``init_seed`` so that the same command gives the same numbers)."""
    import timm

    from vispe.models import VispeVisionTransformer
    from vispe.models.checkpoint import _as_state_dict, _unwrap, load_timm_checkpoint

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
        out.append(ModelSource(
            enc, model, _file_key(weights, model_name, enc, sorted((model_kwargs or {}).items())), model.pos_encoding_name,
            tuple(model.patch_embed.img_size), tuple(model.patch_embed.patch_size), int(model.num_classes),
            tuple(classes) if classes is not None else None, mean, std,
            f"{model_name} + {Path(weights).name} ({len(report.kept)} kept, {len(report.resampled)} resampled, "
            f"{len(report.new)} new (seed {init_seed}), {len(report.dropped)} dropped)", None, bool(model.patch_embed.dynamic_img_pad)))
    return out


# ------------------------------------------------------------------------------------------
# the sweep
# ------------------------------------------------------------------------------------------
def _policies_for(source: ModelSource, extrapolation: str) -> list[str | None]:
    policies, _, active = policy_hooks()
    declared = policies(source.model)
    if not declared:
        return [None]
    if extrapolation == "native":
        return [active(source.model)]
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

    if extrapolation not in EXTRAPOLATION_CHOICES:
        raise ValueError(f"extrapolation={extrapolation!r} is not valid; choose one of {list(EXTRAPOLATION_CHOICES)}")
    bad_resize = [r for r in resize if r not in RESIZE_POLICIES]
    if bad_resize or not resize:
        raise ValueError(f"resize policies {bad_resize or list(resize)} are not valid; choose from {list(RESIZE_POLICIES)}")
    if not checkpoints and not sources:
        raise ValueError("give at least one checkpoint or --model NAME --weights FILE")
    if labels is not None and len(labels) != len(checkpoints):
        raise ValueError(f"{len(labels)} labels for {len(checkpoints)} checkpoints")
    if eval_subset is not None and eval_subset < 1:
        raise ValueError(f"--num-images must be >= 1, got {eval_subset}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available; use --device cpu")

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
    previous: dict[str, dict[str, Any]] = {}
    if reuse and (out / "resolution.json").is_file():
        saved = read_json(out / "resolution.json", "earlier sweep results")
        for r in saved.get("results", []) + saved.get("other_results", []):
            if "key" in r:
                previous[r["key"]] = r
    decoded: dict[int, tuple[list[torch.Tensor], torch.Tensor]] = {}
    _, set_policy, active = policy_hooks()
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
                key = json.dumps([s.key, policy, rp, [(k, list(sh)) for k, sh, _ in j["points"]], es.description, eval_subset, seed,
                                  s.label, j["label_map"].tolist()])
                if key in previous:
                    results.append(previous[key])
                    progress.skip_row()
                    continue
                if id(es) not in decoded:
                    decoded[id(es)] = (es.load(keep.tolist()), es.labels[keep])
                images, targets = decoded[id(es)]
                if policy is not None:
                    set_policy(s.model, policy)
                model = s.model.to(device)
                label = s.label + ("" if policy is None else f" ({policy})") + ("" if len(resize) == 1 else f" [{rp}]")
                progress.start_row(label)
                acc = evaluate_shapes(model, images, j["label_map"][targets], [sh for _, sh, _ in j["points"]], s.mean, s.std,
                                      rp, batch_size, device, on_batch=progress.step)
                progress.end_row()
                evaluations = [{"sweep": kind, "shape": _shape_name(sh), "height": sh[0], "width": sh[1],
                                "tokens": (sh[0] // s.patch[0]) * (sh[1] // s.patch[1]), "aspect": sh[1] / sh[0],
                                **({"aspect_label": name} if name else {}), **acc[tuple(sh)]} for kind, sh, name in j["points"]]
                squares = {str(e["height"]): {k: v for k, v in e.items() if k.startswith("top")}
                           for e in evaluations if e["sweep"] == "size" and e["height"] == e["width"]}
                results.append({
                    "label": label, "source": s.origin, "checkpoint": s.checkpoint, "encoding": s.encoding,
                    "extrapolation": policy if policy is not None else "own (no option)",
                    "active_policy": active(s.model), "resize": rp,
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
    write_json_atomic(out / "resolution.json", report)
    (out / "resolution.md").write_text(markdown_table(report))
    plot(report, out / "resolution.png", title=title)
    return report


def _write_partial(out: Path, results: list[dict[str, Any]], previous: dict[str, dict[str, Any]]) -> None:
    """Save finished evaluations so an interrupted sweep can be resumed (they are reused by key)."""
    done = {r["key"]: r for r in list(previous.values()) + results}
    write_json_atomic(out / "resolution.json", {"partial": True, "results": list(done.values())})


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
    p = argparse.ArgumentParser(prog="vispe resolution", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="*", help="Lightning checkpoints of vispe.tasks.ImageClassification")
    g = p.add_argument_group("timm / vispe model from a local weights file")
    g.add_argument("--model", default=None, help="timm ViT name (vit_small_patch16_224, deit_*) or vispe_* model")
    g.add_argument("--weights", default=None, help="local .pth / .safetensors state dict of --model (nothing downloads)")
    g.add_argument("--pos-encoding", default=None,
                   help="comma-separated encodings to load the weights under (default learned = timm's APE); others are a zero-shot swap")
    g.add_argument("--model-kwargs", default=None, help="JSON of extra model arguments (e.g. '{\"depth\": 2, \"img_size\": 64}')")
    d = p.add_argument_group("image set")
    d.add_argument("--data", default=None,
                   help="folder of class sub-folders, .zip, .csv/.json list, torchvision:<Name>, cifar10-test or fashion-mnist-test "
                        "(default: each checkpoint's recorded test split)")
    d.add_argument("--data-root", default=None, help="root of --data for torchvision/named sets (default $VISPE_DATA_ROOT/<folder>)")
    d.add_argument("--data-dir", default=None, help="override the data location recorded in the checkpoints")
    d.add_argument("--split", default="test", help="split of a torchvision dataset")
    d.add_argument("--classes", default=None, help="the model's class names in head order: comma-separated, or a .txt/.json file")
    d.add_argument("--allow-class-subset", action="store_true", help="score a set holding only some of the model's classes")
    d.add_argument("--num-images", "--eval-subset", dest="num_images", type=int, default=None,
                   help="evaluate a fixed class-stratified sample of this many images (seeded by --seed)")
    d.add_argument("--seed", type=int, default=0, help="seed of the image sample and of a swapped encoding's new parameters")
    d.add_argument("--mean", default=None, help="normalisation mean for --model (default: timm's pretrained_cfg)")
    d.add_argument("--std", default=None, help="normalisation std for --model")
    s = p.add_argument_group("sizes, shapes, policies")
    s.add_argument("--sizes", default=None, help="sizes and HxW shapes, e.g. 16,32,24x48 (default 0.5x..2x the training size)")
    s.add_argument("--scales", default=None, help="sizes as multiples of each model's training size, e.g. 1,2,3,4 (4 = 16x the area)")
    s.add_argument("--aspect-ratios", default=None, help="width:height ratios at a fixed token budget, e.g. 1:2,2:3,1:1,3:2,2:1")
    s.add_argument("--token-budget", type=int, default=None, help="tokens of the aspect-ratio shapes (default: the training grid's)")
    s.add_argument("--resize", default="resize", help=f"comma-separated resize policies from {list(RESIZE_POLICIES)}")
    s.add_argument("--extrapolation", default="native", choices=EXTRAPOLATION_CHOICES,
                   help="PE policy where the encoding declares policies: as built, forced, both (extend + interpolate) or all")
    o = p.add_argument_group("run and output")
    o.add_argument("--labels", default=None, help="comma-separated legend labels, one per checkpoint")
    o.add_argument("--out", default="outputs/resolution", help="output folder for resolution.{json,md,png}")
    o.add_argument("--batch-size", type=int, default=256)
    o.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    o.add_argument("--quiet", action="store_true", help="no progress on stderr (a line per row when stderr is not a terminal)")
    o.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    o.add_argument("--title", default=None)
    o.add_argument("--no-reuse", action="store_true", help="re-evaluate even results already in --out/resolution.json")
    args = p.parse_args(list(argv) if argv is not None else None)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if (args.model is None) != (args.weights is None):
            raise ValueError("--model and --weights go together (a model name and its local weights file)")
        if args.pos_encoding and args.model is None:
            raise ValueError("--pos-encoding applies to --model/--weights; a checkpoint keeps the encoding it was trained with")
        classes = _read_classes(args.classes)
        sources = []
        if args.model is not None:
            from vispe.encodings.spec import parse_encoding_list

            kwargs = json.loads(args.model_kwargs) if args.model_kwargs else None
            if kwargs is not None and not isinstance(kwargs, dict):
                raise ValueError(f"--model-kwargs must be a JSON object, got {args.model_kwargs!r}")
            encs = [label for label, _, _ in parse_encoding_list(args.pos_encoding)] if args.pos_encoding else ["learned"]
            sources = weights_sources(args.model, args.weights, encs, kwargs,
                                      _parse_floats(args.mean, "--mean") if args.mean else None,
                                      _parse_floats(args.std, "--std") if args.std else None, classes, init_seed=args.seed)
        report = run_sweep(
            args.checkpoints, parse_shapes(args.sizes) if args.sizes else None, args.extrapolation, args.out,
            labels=args.labels.split(",") if args.labels else None, eval_subset=args.num_images, data_dir=args.data_dir,
            batch_size=args.batch_size, title=args.title, reuse=not args.no_reuse, sources=sources, data=args.data,
            data_root=args.data_root, split=args.split, classes=classes, allow_class_subset=args.allow_class_subset,
            seed=args.seed, scales=_parse_floats(args.scales, "--scales") if args.scales else None,
            aspect_ratios=parse_aspect_ratios(args.aspect_ratios) if args.aspect_ratios else None,
            token_budget=args.token_budget, resize=[r.strip() for r in args.resize.split(",") if r.strip()], device=args.device, quiet=args.quiet,
        )
    except (ValueError, FileNotFoundError) as err:
        print(f"vispe resolution: error: {err}", file=sys.stderr)
        return 2
    print(markdown_table(report))
    print(f"wrote {Path(args.out) / 'resolution.json'}, resolution.md, resolution.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
