"""Loaders, resume, file faults and the remaining constructors refuse bad input naming it: the LOOPE released-weights
loader, the runner's resume, checkpoint writes that fail (disk full, permission) and the temp files they leave,
empty / list-shaped recipes, an HF scheme record, video ViT / video-LLM sizes, a huge visual block, the options layer."""
from __future__ import annotations

import errno
import types

import lightning.pytorch as pl
import pytest
import timm
import torch
from bad_input import full_disk

import vispe  # noqa: F401  (registers models)
import vispe.files as files
from vispe.cli_options import Conflict, Option, Options, check_device, int_text
from vispe.files import FileWriteError
from vispe.models.checkpoint import load_released_loope, released_loope_options
from vispe.train_cli import AtomicCheckpointIO, FinalLastCheckpoint


def _loope_model(spec="loope"):
    return timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding=spec, embed_dim=32, depth=1, num_heads=2, img_size=16)


# ------------------------------------------------------------------------------------------
# LOOPE released weights: as strict as load_timm_checkpoint
# ------------------------------------------------------------------------------------------
def test_loaders_loope_refuses_a_dict_that_keeps_nothing():
    model = _loope_model()
    before = {k: v.clone() for k, v in model.pos_encoding.state_dict().items()}
    with pytest.raises(ValueError, match=r"keeps nothing of the loope encoding: 0 of \d+ encoding tensors"):
        load_released_loope(model, {})
    with pytest.raises(ValueError, match=r"keeps nothing.*not a released LOOPE"):
        load_released_loope(model, {"blocks.0.norm1.weight": torch.ones(32)})
    assert all(torch.equal(v, model.pos_encoding.state_dict()[k]) for k, v in before.items())


def test_loaders_loope_refuses_a_timm_vit_state_dict_and_a_mix():
    ref = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=2, depth=1, embed_dim=32, num_heads=2,
                            img_size=16, patch_size=4)
    with pytest.raises(ValueError, match=r"fits the loope encoding only in part: 1[0-9] encoding tensors would stay newly initialised"):
        load_released_loope(_loope_model(), ref.state_dict())
    # released-layout weights of the right sizes but the default (size-agnostic) head: refused with the options they need
    linear = _loope_model("loope[head=linear,order_scale=index]")
    from vispe.models.checkpoint import _ARTPE_MODULES

    inv = {v: k for k, v in _ARTPE_MODULES.items()}
    released = {"cls_token": torch.zeros(1, 32)}
    for k, v in linear.pos_encoding.state_dict().items():
        mod, _, param = k.rpartition(".")
        if mod in inv:
            released[f"art_conv.{inv[mod]}.{param}"] = v
    needs = released_loope_options(released)
    assert needs["head"] == "linear" and needs["order_scale"] == "index" and needs["num_patches"] == 16
    assert needs["embed_dim"] == 32 and needs["in_chans"] == 3 and needs["patch_size"] == (4, 4)
    with pytest.raises(ValueError, match=r"need order_scale='index', head='linear'.*this encoding has order_scale='normalized', head='local'"):
        load_released_loope(_loope_model(), released)
    report = load_released_loope(linear, released)  # the options they need: loads completely
    assert report.new == []


# ------------------------------------------------------------------------------------------
# resume: the runner refuses another model's checkpoint, as `vispe fit` does
# ------------------------------------------------------------------------------------------
def test_resume_runner_refuses_a_checkpoint_of_another_encoding(tmp_path):
    from vispe.runner import run

    quiet = {"trainer.max_steps": 1, "trainer.enable_progress_bar": False, "trainer.logger": False,
             "trainer.enable_checkpointing": False, "trainer.enable_model_summary": False, "trainer.limit_val_batches": 0}
    first = run("synthetic_tiny", {**quiet, "model.init_args.pos_encoding": "none"}, seed=0)
    first.trainer.save_checkpoint(tmp_path / "none.ckpt")
    with pytest.raises(ValueError, match=r"none.ckpt' was saved from a model with other hyper-parameters.*pos_encoding: "
                                         r"config 'rope_axial', checkpoint 'none'"):
        run("synthetic_tiny", {**quiet, "trainer.max_steps": 2, "model.init_args.pos_encoding": "rope_axial"}, seed=0,
            ckpt_path=str(tmp_path / "none.ckpt"))
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        run("synthetic_tiny", quiet, seed=0, ckpt_path=str(tmp_path / "missing.ckpt"))
    resumed = run("synthetic_tiny", {**quiet, "trainer.max_steps": 2, "model.init_args.pos_encoding": "none"}, seed=0,
                  ckpt_path=str(tmp_path / "none.ckpt"))  # the same model resumes
    assert resumed.trainer.ckpt_path == str(tmp_path / "none.ckpt") and resumed.trainer.global_step >= 1


# ------------------------------------------------------------------------------------------
# file faults: failed checkpoint writes name the file and the cause; temp files never stay
# ------------------------------------------------------------------------------------------
def test_faults_checkpoint_write_on_a_full_disk(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"w": torch.ones(4)}, path)
    full_disk(monkeypatch, after=4096)
    with pytest.raises(FileWriteError, match=r"could not write the checkpoint '.*last.ckpt': the disk is full") as info:
        AtomicCheckpointIO().save_checkpoint({"w": torch.zeros(100_000)}, path)
    assert info.value.errno == errno.ENOSPC and "unexpected pos" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temp file left
    assert torch.equal(files.read_checkpoint(path)["w"], torch.ones(4))  # the previous checkpoint is intact


def test_faults_checkpoint_write_without_permission(tmp_path, monkeypatch):
    import tempfile

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    with pytest.raises(FileWriteError, match=r"could not write the checkpoint '.*x.ckpt': permission denied"):
        AtomicCheckpointIO().save_checkpoint({"w": torch.ones(2)}, tmp_path / "x.ckpt")


def test_faults_stale_temp_files_removed_when_the_run_starts_again(tmp_path):
    from vispe.data import SyntheticDataModule
    from vispe.tasks import ImageClassification

    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    stale_old, stale_new = old / ".last.ckpt.k1ll3d.tmp", new / ".epoch000.ckpt.x9.tmp"
    keep = new / "notes.tmp"  # not a checkpoint's temp file
    for p in (stale_old, stale_new, keep):
        p.write_bytes(b"\0" * 128)

    def fit(ckpt_path=None, steps=1):
        pl.seed_everything(0, verbose=False)
        dm = SyntheticDataModule(num_classes=2, image_size=16, train_size=32, val_size=16, batch_size=16)
        task = ImageClassification("vispe_vit_tiny_patch4_32", {"embed_dim": 32, "depth": 1, "num_heads": 2}, "none",
                                   num_classes=2, img_size=16)
        cb = FinalLastCheckpoint(dirpath=str(new), save_last=True)
        trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, callbacks=[cb], enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
        trainer.fit(task, datamodule=dm, ckpt_path=ckpt_path)

    fit()
    assert not stale_new.exists() and keep.exists() and stale_old.exists()
    (new / "last.ckpt").replace(old / "last.ckpt")
    fit(ckpt_path=str(old / "last.ckpt"), steps=2)  # resuming the old run cleans its folder too
    assert not stale_old.exists()


# ------------------------------------------------------------------------------------------
# recipes, HF records, model sizes, sequence sizes
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,what", [("", "is empty"), ("- a\n- b\n", "is a YAML list"), ("42\n", "is a YAML int")])
def test_cli_recipe_that_is_not_a_mapping_is_named(tmp_path, text, what):
    from vispe.runner import load_recipe
    from vispe.train_cli import main

    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"config file '.*r.yaml' {what}, not a LightningCLI config"):
        main(["fit", "--recipe", str(path)])
    with pytest.raises(ValueError, match=rf"recipe '.*r.yaml' {what}"):
        load_recipe(path)


@pytest.mark.parametrize("record,needle", [
    ({"scheme": "mrope", "options": ["fps", 2]}, r"\['options'\]=\['fps', 2\] is not a mapping"),
    ({"scheme": "mrope", "options": {}, "unrecorded_options": "rng"}, r"\['unrecorded_options'\]='rng' is not a list"),
    ({"scheme": "nope"}, "is not a vispe record"),
])
def test_checkpoints_hf_scheme_record_checked(record, needle):
    from vispe.integrations.hf import CONFIG_KEY, restore_position_scheme

    model = types.SimpleNamespace(config=types.SimpleNamespace(**{CONFIG_KEY: record}))
    with pytest.raises(ValueError, match=needle):
        restore_position_scheme(model)


def test_options_video_models_name_their_sizes():
    from vispe.models.video_llm import VideoLLM
    from vispe.models.video_vit import VispeVideoViT

    kw = dict(pos_encoding="rope_axial_3d", img_size=32, tubelet_size=2, patch_size=8, embed_dim=32, depth=1, num_heads=2)
    with pytest.raises(ValueError, match=r"VispeVideoViT: num_frames=-2 is not valid; it must be an int >= 1"):
        VispeVideoViT(num_frames=-2, **kw)
    with pytest.raises(ValueError, match=r"img_size=0 is not valid"):
        VispeVideoViT(num_frames=4, **{**kw, "img_size": 0})
    vit = VispeVideoViT(num_frames=4, **kw)
    with pytest.raises(ValueError, match=r"set_input_size: num_frames=0 is not valid"):
        vit.set_input_size(num_frames=0)
    with pytest.raises(ValueError, match=r"VideoLLM: num_heads=0 is not valid"):
        VideoLLM(vocab_size=32, dim=32, depth=1, num_heads=0)
    with pytest.raises(ValueError, match=r"VideoLLM: vocab_size=0 is not valid"):
        VideoLLM(vocab_size=0, dim=32, depth=1, num_heads=2)


def test_positions_huge_visual_block_refused_before_allocating():
    from vispe.positions import MAX_SEQUENCE_TOKENS, Text, Visual, build_positions

    with pytest.raises(ValueError, match=r"1,000,000,000,000 tokens.*Visual\(T=10000, H=10000, W=10000.*at most 1,073,741,824"):
        build_positions("mrope", [Visual(10**4, 10**4, 10**4)])
    with pytest.raises(ValueError, match="at most"):
        build_positions("rope_1d", [Text(MAX_SEQUENCE_TOKENS), Text(1)])


def test_options_layer_rules_and_conflicts():
    opts = Options("tool", [Option("a", None, int_text), Option("b", None, int_text), Option("c", switch=True, default=False)],
                   conflicts=[Conflict("a", "b", "pick one"), Conflict("c", "a", "c refines a", "requires")])
    with pytest.raises(ValueError, match=r"^--a and --b cannot be used together: pick one$"):
        opts.check({"a": 1, "b": 2}, style="cli")
    with pytest.raises(ValueError, match=r"^c needs a: c refines a$"):
        opts.check({"c": True})
    with pytest.raises(ValueError, match=r"--a='x' is not valid; it must be an integer"):
        opts["a"].value_from_text("x")
    with pytest.raises(KeyError, match="undeclared option 'z'"):
        Options("tool", [Option("a")], conflicts=[Conflict("a", "z", "-")])
    assert check_device("--device", "cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"--device='gpu' is not valid"):
        check_device("--device", "gpu")
