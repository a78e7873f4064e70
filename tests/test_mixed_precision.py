"""Mixed precision: the attention encodings train a step under float16 autocast where the device runs it (bf16
autocast for every registered encoding is in tests/test_encoding_contracts.py), with finite gradients that reach the
encoding's parameters; the CLI trains with ``--trainer.precision bf16-mixed`` (each task: one encoding per mechanism).

Users train with Lightning's ``bf16-mixed``: forward under autocast, backward outside it. Some call
``backward()`` inside the autocast block too; both are exercised, since custom autograd functions
see a different autocast state in each.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from encoding_hosts import MULTIMODAL, check_grads, step_loss
from lightning.pytorch.callbacks import Callback

from vispe import list_encodings


def _float16_autocast_runs(device: str) -> bool:
    try:
        with torch.autocast(device, dtype=torch.float16):
            a = torch.randn(4, 4, device=device, requires_grad=True)
            (a @ a).sum().backward()
        return True
    except (RuntimeError, AssertionError):
        return False


@pytest.mark.skipif(not _float16_autocast_runs("cpu"), reason="this PyTorch build has no float16 autocast on CPU")
@pytest.mark.parametrize("name", ["rope_axial", "rope_mixed", "comrope_ap", "comrope_ld", "irpe", "comrope_ld_3d", "mrope_interleave",
                                  "rope_dinov3", "alibi_2d", "fire", "liere", "videorope", "qwen3vl"])
def test_attention_encodings_train_a_step_under_float16_autocast(name):
    model, loss_fn = step_loss(name)
    model.train()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_fn()
    loss.backward()
    assert torch.isfinite(loss)
    check_grads(model, "under autocast")


# -- through the CLI: Lightning's bf16-mixed precision plugin, one task per encoding family ------------------
# What an encoding does under bf16 autocast (forward inside, backward outside, as the plugin runs them) is checked for
# every registered encoding in tests/test_encoding_contracts.py; what the CLI adds is the plugin and the task's wiring,
# the same for every encoding of a mechanism. So each task trains one encoding per mechanism (the first registered),
# plus every encoding with its own auxiliary loss, which the task adds to the loss under autocast, and every
# multimodal scheme that draws its positions while training (per batch, in the task's step).
REPO = Path(__file__).resolve().parents[1]


def _per_mechanism(names: list[str]) -> list[str]:
    from vispe.encodings import get_encoding_class
    from vispe.encodings.base import PositionalEncoding, get_record

    seen: set[str] = set()
    out = []
    for name in names:
        record = get_record(name)
        own_aux = record.mechanism != "composed" and \
            getattr(get_encoding_class(name), "auxiliary_loss", None) is not PositionalEncoding.auxiliary_loss
        draws = getattr(record.scheme, "train_draws", False)
        if record.mechanism not in seen or own_aux or draws:
            out.append(name)
            seen.add(record.mechanism)
    return out


IMAGE_2D = _per_mechanism([n for n in list_encodings(grid_ndim=2) if n not in MULTIMODAL])
VIDEO_3D = _per_mechanism([n for n in list_encodings(grid_ndim=3) if n not in MULTIMODAL and n not in list_encodings(grid_ndim=2)])
SCHEMES = _per_mechanism(list(MULTIMODAL))
STEPS = 2


class RecordTraining(Callback):
    """Records what the precision plugin did: forward dtype, losses, gradients, weights before/after."""

    last: dict[str, Any] = {}

    def on_train_start(self, trainer, pl_module):
        rec = RecordTraining.last = {"dtypes": set(), "losses": [], "pe_grads": set(), "finite_grads": True}
        rec["before"] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        first_linear = next(m for m in pl_module.modules() if isinstance(m, torch.nn.Linear))
        first_linear.register_forward_hook(lambda mod, inp, out: rec["dtypes"].add(out.dtype))

    def on_before_backward(self, trainer, pl_module, loss):
        RecordTraining.last["losses"].append(loss.detach().float().item())

    def on_after_backward(self, trainer, pl_module):
        rec = RecordTraining.last
        for n, p in pl_module.named_parameters():
            if p.grad is not None:
                rec["finite_grads"] &= bool(torch.isfinite(p.grad).all())
                if "pos_encoding" in n:
                    rec["pe_grads"].add(n)

    def on_train_end(self, trainer, pl_module):
        rec = RecordTraining.last
        rec["after"] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        rec["pe_params"] = {n for n, p in pl_module.named_parameters() if "pos_encoding" in n and p.requires_grad}


def _fit_bf16(tmp_path: Path, config: str | Path, *args: str) -> dict[str, Any]:
    from vispe.recipes import list_recipes, recipe_path
    from vispe.train_cli import main

    path = recipe_path(config) if config in list_recipes() else REPO / "configs" / config  # a shipped recipe or an example config
    main(["fit", "-c", str(path), "--trainer.logger.init_args.save_dir", str(tmp_path),
          "--trainer.max_steps", str(STEPS), "--trainer.max_epochs", "-1", "--trainer.enable_progress_bar", "false",
          "--trainer.enable_model_summary", "false", "--trainer.limit_val_batches", "0", "--trainer.precision", "bf16-mixed",
          "--trainer.callbacks+=test_mixed_precision.RecordTraining", *args])
    rec = RecordTraining.last
    assert rec["dtypes"] == {torch.bfloat16}, f"forward ran in {rec['dtypes']}, not under bf16 autocast"
    assert len(rec["losses"]) == STEPS and all(math.isfinite(v) for v in rec["losses"]), rec["losses"]
    assert rec["finite_grads"]
    assert rec["pe_grads"] == rec["pe_params"], f"encoding parameters without gradient: {rec['pe_params'] - rec['pe_grads']}"
    changed = [n for n in rec["before"] if not torch.equal(rec["before"][n], rec["after"][n])]
    assert changed, "no parameter changed in two optimizer steps"
    assert all(torch.isfinite(v).all() for v in rec["after"].values())
    return rec


@pytest.mark.parametrize("name", IMAGE_2D)
@pytest.mark.slow
def test_cli_bf16_mixed_image_classification(tmp_path, name):
    _fit_bf16(tmp_path, "smoke", "--model.init_args.pos_encoding", name)


@pytest.mark.parametrize("name", VIDEO_3D)
@pytest.mark.slow
def test_cli_bf16_mixed_video_retrieval(tmp_path, name):
    from vispe.recipes import recipe_path

    _fit_bf16(tmp_path, recipe_path("retrieval_smoke"), "--model.init_args.pos_encoding", name)  # an absolute path: configs/ is not prefixed


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.slow
def test_cli_bf16_mixed_video_llm_niah(tmp_path, name):
    _fit_bf16(
        tmp_path, "smoke",
        "--model", "vispe.tasks.niah.VideoNIAH", "--model.init_args.pos_scheme", name, "--model.init_args.dim", "64",
        "--model.init_args.depth", "1", "--model.init_args.num_heads", "4", "--model.init_args.warmup_steps", "1",
        "--model.init_args.warmup_epochs", "null",  # smoke.yaml warms up in epochs; one of the two is set
        "--data", "vispe.data.niah.NIAHDataModule", "--data.init_args.train_frames", "4", "--data.init_args.train_episodes", "8",
        "--data.init_args.eval_lengths", "[4]", "--data.init_args.episodes_per_cell", "1", "--data.init_args.batch_size", "4",
    )
