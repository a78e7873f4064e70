"""Resolution-generalization sweep: accuracy of trained classifiers across input sizes.

    vispe resolution runs/a/version_0/checkpoints/last.ckpt runs/b/version_0/checkpoints/last.ckpt \\
        --sizes 16,24,32,40,48,56,64 --extrapolation native --out outputs/resolution

Protocol (fixed, written into the JSON):

* Images come from the checkpoint's own evaluation split (the DataModule recorded in the
  checkpoint, rebuilt with ``--data-dir``/``--eval-subset`` overrides), normalised at the training
  resolution exactly as in validation, then resized **as a whole image** (crop ratio 1.0, no crop)
  to ``s x s`` with bicubic interpolation and antialiasing. Resizing is linear and so commutes with
  the per-channel normalisation.
* The model runs at ``s x s`` with its patch size unchanged (``s / patch`` tokens per side); no
  fine-tuning. Every size must be a multiple of the patch size (checked before anything runs).
* Positional encodings follow their own policy for a grid they were not trained on. Encodings
  with an ``extrapolation`` option (``'extend'``: evaluate the position function at the new
  integer positions; ``'interpolate'``: squeeze the new grid into the training range) are run with
  the trained setting (``--extrapolation native``), a forced one, ``both`` (extend and interpolate)
  or ``all`` (every policy the encoding has: the rotary lattice encodings add ``ntk`` and ``yarn``,
  frequency rescalings on a larger grid). Others (learned APE:
  bicubic resampling of the table; CPE/LOOPE/LFF/iRPE/ComRoPE: computed from the actual grid) have
  a single policy, recorded as such.

Outputs: ``resolution.json``, ``resolution.md`` (top-1 %, one row per model and policy) and
``resolution.png`` (top-1 vs input size, one line per encoding/policy).
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from vispe.files import read_json

__all__ = ["DEFAULT_SIZES", "RESIZE_POLICY", "evaluate_sizes", "load_classifier", "main", "run_sweep"]

DEFAULT_SIZES = (16, 24, 32, 40, 48, 56, 64)
EXTRAPOLATION_CHOICES = ("native", "extend", "interpolate", "ntk", "yarn", "both", "all")
RESIZE_POLICY = (
    "eval split normalised at the training resolution, whole image resized to s x s "
    "(bicubic, antialias, crop ratio 1.0), patch size unchanged, no fine-tuning"
)


def _parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in str(text).replace(" ", "").split(",") if s]
    except ValueError as err:
        raise ValueError(f"--sizes must be comma-separated integers, got {text!r}") from err
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError(f"--sizes must be positive integers, got {text!r}")
    return sorted(set(sizes))


def _checkpoint(path: str | Path) -> dict[str, Any]:
    from vispe.files import read_checkpoint

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {str(path)!r}")
    ckpt = read_checkpoint(path)  # weights_only: a checkpoint's pickle never runs code
    if not isinstance(ckpt, dict) or "hyper_parameters" not in ckpt or "state_dict" not in ckpt:
        raise ValueError(f"{str(path)!r} is not a Lightning checkpoint of vispe.tasks.ImageClassification (no hyper_parameters)")
    saved_class = ckpt["hyper_parameters"].get("_class_path")
    if saved_class not in (None, "vispe.tasks.ImageClassification", "vispe.tasks.classification.ImageClassification"):
        raise ValueError(f"{str(path)!r} is a checkpoint of {saved_class}; the resolution sweep takes vispe.tasks.ImageClassification checkpoints")
    return ckpt


def _encoding_spec(hp: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    from vispe.encodings.spec import parse_pos_encoding

    spec = hp.get("pos_encoding")
    if spec is None:
        spec = (hp.get("model_kwargs") or {}).get("pos_encoding")
    if spec is None:
        return None, {}
    return parse_pos_encoding(spec)


def extrapolation_modes(encoding: str | None) -> tuple[str, ...]:
    """The extrapolation policies an encoding (a registered name or spec) declares (empty: a single, fixed policy)."""
    from vispe.encodings import extrapolation_policies

    return extrapolation_policies(encoding)


def load_classifier(ckpt: dict[str, Any], extrapolation: str | None = None):
    """Rebuild the ``ImageClassification`` of a checkpoint, optionally switching its PE's extrapolation policy
    (:func:`vispe.encodings.set_extrapolation`, on the loaded model: no other module is rebuilt)."""
    from vispe.encodings import set_extrapolation
    from vispe.tasks import ImageClassification

    hp = dict(ckpt["hyper_parameters"])
    hp.pop("_instantiator", None)
    valid = set(inspect.signature(ImageClassification.__init__).parameters) - {"self"}
    module = ImageClassification(**{k: v for k, v in hp.items() if k in valid})
    module.load_state_dict(ckpt["state_dict"], strict=True)
    if extrapolation is not None:
        set_extrapolation(module.model, extrapolation)
    return module.eval()


def _build_datamodule(info: dict[str, Any], overrides: dict[str, Any]):
    import importlib

    module, _, name = info["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    init = dict(info.get("init_args") or {})
    accepted = inspect.signature(cls.__init__).parameters
    for k, v in overrides.items():
        if v is not None and k in accepted:
            init[k] = v
    return cls(**{k: v for k, v in init.items() if k in accepted})


@torch.inference_mode()
def evaluate_sizes(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, sizes: Sequence[int],
                   batch_size: int = 256) -> dict[int, dict[str, float]]:
    """Top-1 / top-5 accuracy (%) of ``model`` on normalised ``images`` resized to each size."""
    from vispe.data import resize_images

    out: dict[int, dict[str, float]] = {}
    k5 = None
    for s in sizes:
        top1 = top5 = 0
        for i in range(0, len(images), batch_size):
            x = resize_images(images[i:i + batch_size], s)
            y = labels[i:i + batch_size]
            logits = model(x)
            k5 = min(5, logits.shape[-1])
            pred = logits.topk(k5, dim=-1).indices
            top1 += (pred[:, 0] == y).sum().item()
            top5 += (pred == y[:, None]).any(-1).sum().item()
        n = len(images)
        out[s] = {"top1": 100.0 * top1 / n, f"top{k5}": 100.0 * top5 / n}
    return out


def run_sweep(
    checkpoints: Sequence[str | Path],
    sizes: Sequence[int] | None = None,
    extrapolation: str = "native",
    out_dir: str | Path = "outputs/resolution",
    labels: Sequence[str] | None = None,
    eval_subset: int | None = None,
    data_dir: str | None = None,
    batch_size: int = 256,
    title: str | None = None,
    reuse: bool = True,
) -> dict[str, Any]:
    """Run the sweep and write ``resolution.{json,md,png}`` into ``out_dir``; returns the JSON dict."""
    if extrapolation not in EXTRAPOLATION_CHOICES:
        raise ValueError(f"extrapolation={extrapolation!r} is not valid; choose one of {list(EXTRAPOLATION_CHOICES)}")
    if not checkpoints:
        raise ValueError("give at least one checkpoint")
    if labels is not None and len(labels) != len(checkpoints):
        raise ValueError(f"{len(labels)} labels for {len(checkpoints)} checkpoints")

    # 1) validate everything before evaluating anything
    jobs = []
    for i, path in enumerate(checkpoints):
        ckpt = _checkpoint(path)
        if "vispe_datamodule" not in ckpt:
            raise ValueError(f"{str(path)!r} records no DataModule (train it with 'vispe fit' / vispe.tasks.ImageClassification)")
        try:
            probe = load_classifier(ckpt)
        except (RuntimeError, TypeError, KeyError) as err:  # weights that do not fit the recorded hyper-parameters
            raise ValueError(f"{str(path)!r}: its weights do not rebuild its recorded model ({type(err).__name__}: {' '.join(str(err).split())[:400]})") from None
        ph, pw = probe.model.patch_embed.patch_size
        dm_info = ckpt["vispe_datamodule"]
        train_size = int(dm_info["init_args"].get("image_size") or probe.hparams.get("img_size") or 0)
        run_sizes = list(sizes) if sizes is not None else (
            list(DEFAULT_SIZES) if train_size == 32 else [int(round(train_size * f / ph)) * ph for f in (0.5, 0.75, 1, 1.25, 1.5, 1.75, 2)]
        )
        bad = [s for s in run_sizes if s % ph or s % pw or s < ph]
        if bad and not getattr(probe.model.patch_embed, "dynamic_img_pad", False):
            raise ValueError(
                f"sizes {bad} cannot be tiled by the patch size {ph}x{pw} of {str(path)!r}; use multiples of {ph} "
                f"(e.g. {[ph * max(1, round(s / ph)) for s in bad]})"
            )
        from vispe.encodings import extrapolation_policies, get_extrapolation

        name, _ = _encoding_spec(dict(ckpt["hyper_parameters"]))
        modes = extrapolation_policies(probe.model)
        if not modes:
            policies: list[str | None] = [None]
        elif extrapolation == "native":
            policies = [get_extrapolation(probe.model)]
        elif extrapolation == "both":
            policies = [m for m in modes if m in ("extend", "interpolate")]
        elif extrapolation == "all":
            policies = list(modes)
        elif extrapolation not in modes:
            raise ValueError(f"{str(path)!r}: encoding {name!r} has no extrapolation={extrapolation!r}; it takes {list(modes)} "
                             "(or use --extrapolation native / both / all)")
        else:
            policies = [extrapolation]
        label = labels[i] if labels is not None else (name or probe.hparams.get("model"))
        jobs.append(dict(path=str(path), ckpt=ckpt, encoding=name, label=label, policies=policies,
                         sizes=sorted(run_sizes), train_size=train_size, dm_info=dm_info))
    base_labels = [j["label"] for j in jobs]
    for j in jobs:  # disambiguate identical labels with the run folder and file name
        if base_labels.count(j["label"]) > 1:
            p = Path(j["path"])
            j["label"] = f"{j['label']} [{p.parent.parent.name}/{p.stem}]"

    # 2) evaluate (results of an earlier call into the same out_dir are reused when the checkpoint
    #    file, policy, sizes and evaluation subset are unchanged)
    out = Path(out_dir)
    previous: dict[str, dict[str, Any]] = {}
    if reuse and (out / "resolution.json").is_file():
        saved = read_json(out / "resolution.json", "earlier sweep results")
        for r in saved.get("results", []) + saved.get("other_results", []):
            if "key" in r:
                previous[r["key"]] = r
    data_cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    results = []
    for j in jobs:
        stat = Path(j["path"]).stat()
        job_keys = {
            policy: json.dumps([str(Path(j["path"]).resolve()), stat.st_size, stat.st_mtime_ns, policy,
                                j["sizes"], eval_subset, j["label"]])
            for policy in j["policies"]
        }
        todo = [p for p in j["policies"] if job_keys[p] not in previous]
        if not todo:
            results.extend(previous[k] for k in job_keys.values())
            continue
        key = json.dumps(j["dm_info"], sort_keys=True, default=str)
        if key not in data_cache:
            dm = _build_datamodule(j["dm_info"], {"eval_subset": eval_subset, "data_dir": data_dir})
            dm.setup("test")
            xs, ys = zip(*[(dm.normalize(x), y) for x, y in dm.test_dataloader()])
            data_cache[key] = (torch.cat(xs), torch.cat(ys))
        images, targets = data_cache[key]
        for policy in j["policies"]:
            if policy not in todo:
                results.append(previous[job_keys[policy]])
                continue
            t0 = time.perf_counter()
            model = load_classifier(j["ckpt"], extrapolation=policy if (policy and extrapolation != "native") else None)
            acc = evaluate_sizes(model, images, targets, j["sizes"], batch_size=batch_size)
            label = j["label"] if policy is None else f"{j['label']} ({policy})"
            results.append({
                "label": label,
                "checkpoint": j["path"],
                "encoding": j["encoding"],
                "extrapolation": policy if policy is not None else "own (no option)",
                "train_size": j["train_size"],
                "num_samples": len(targets),
                "accuracy": {str(s): v for s, v in acc.items()},
                "seconds": round(time.perf_counter() - t0, 1),
                "key": job_keys[policy],
            })
            print(f"{label:32s} " + " ".join(f"{s}:{v['top1']:.1f}" for s, v in acc.items()), flush=True)
            _write_partial(out, results, previous)

    report = {
        "protocol": {"resize": RESIZE_POLICY, "extrapolation": extrapolation, "metric": "top-1 accuracy (%), micro"},
        "sizes": sorted({s for j in jobs for s in j["sizes"]}),
        "results": results,
    }
    # evaluations of checkpoints / policies this call did not ask for stay reusable by a later call
    used = {r.get("key") for r in results}
    others = [r for k, r in previous.items() if k not in used]
    if others:
        report["other_results"] = others
    write_json_atomic(out / "resolution.json", report)
    (out / "resolution.md").write_text(markdown_table(report))
    plot(report, out / "resolution.png", title=title)
    return report


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON through a temporary file and a rename: a killed call leaves the previous file, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    tmp.replace(path)


def _write_partial(out: Path, results: list[dict[str, Any]], previous: dict[str, dict[str, Any]]) -> None:
    """Save finished evaluations so an interrupted sweep can be resumed (they are reused by key)."""
    done = {r["key"]: r for r in list(previous.values()) + results}
    write_json_atomic(out / "resolution.json", {"partial": True, "results": list(done.values())})


def markdown_table(report: dict[str, Any]) -> str:
    sizes = report["sizes"]
    train_sizes = {r["train_size"] for r in report["results"]}
    head = "| encoding (extrapolation) | " + " | ".join(f"{s}{'*' if s in train_sizes else ''}" for s in sizes) + " |"
    rows = [head, "|---|" + "---:|" * len(sizes)]
    for r in report["results"]:
        cells = [f"{r['accuracy'][str(s)]['top1']:.1f}" if str(s) in r["accuracy"] else "" for s in sizes]
        rows.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    n = sorted({r["num_samples"] for r in report["results"]})
    rows.append("")
    rows.append(f"Top-1 accuracy (%) on {', '.join(map(str, n))} evaluation images; * = training resolution. "
                f"Resize policy: {report['protocol']['resize']}.")
    return "\n".join(rows) + "\n"


def plot(report: dict[str, Any], path: str | Path, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.2))
    # one colour per checkpoint, line style per extrapolation policy
    ckpt_index = {c: i for i, c in enumerate(dict.fromkeys(r["checkpoint"] for r in report["results"]))}
    colours = plt.get_cmap("tab10" if len(ckpt_index) <= 10 else "tab20").colors
    styles = {"interpolate": "--"}
    for r in report["results"]:
        xs = sorted(int(s) for s in r["accuracy"])
        ax.plot(xs, [r["accuracy"][str(s)]["top1"] for s in xs], marker="o", ms=3.5,
                color=colours[ckpt_index[r["checkpoint"]] % len(colours)],
                linestyle=styles.get(r["extrapolation"], "-"), label=r["label"])
    for ts in {r["train_size"] for r in report["results"]}:
        ax.axvline(ts, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("input resolution (px)")
    ax.set_ylabel("top-1 accuracy (%)")
    ax.set_title(title or "Resolution generalization (dashed: training resolution)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vispe resolution", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+", help="Lightning checkpoints of vispe.tasks.ImageClassification")
    p.add_argument("--sizes", default=None,
                   help="comma-separated input sizes (default 16,24,32,40,48,56,64 for 32-px models, 0.5x..2x otherwise)")
    p.add_argument("--extrapolation", default="native", choices=EXTRAPOLATION_CHOICES,
                   help="PE policy where the encoding has an extrapolation option: as trained, forced, both (extend + interpolate) or all")
    p.add_argument("--labels", default=None, help="comma-separated legend labels, one per checkpoint")
    p.add_argument("--out", default="outputs/resolution", help="output folder for resolution.{json,md,png}")
    p.add_argument("--eval-subset", type=int, default=None, help="evaluate on this many (class-balanced) images")
    p.add_argument("--data-dir", default=None, help="override the data location recorded in the checkpoints")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--title", default=None)
    p.add_argument("--no-reuse", action="store_true", help="re-evaluate even results already in --out/resolution.json")
    args = p.parse_args(list(argv) if argv is not None else None)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        sizes = _parse_sizes(args.sizes) if args.sizes else None
        report = run_sweep(
            args.checkpoints, sizes, args.extrapolation, args.out,
            labels=args.labels.split(",") if args.labels else None,
            eval_subset=args.eval_subset, data_dir=args.data_dir, batch_size=args.batch_size, title=args.title,
            reuse=not args.no_reuse,
        )
    except (ValueError, FileNotFoundError) as err:
        print(f"vispe resolution: error: {err}", file=sys.stderr)
        return 2
    print(markdown_table(report))
    print(f"wrote {Path(args.out) / 'resolution.json'}, resolution.md, resolution.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
