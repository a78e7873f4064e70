"""Training CLI: plain python / vispe / fabric run (one DDP job), SIGKILL + resume, config errors, task pieces."""
from __future__ import annotations

import csv
import os
import pickle
import signal
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from vispe.recipes import recipe_path
from vispe.runs import find_last_checkpoint
from vispe.tasks import ImageClassification, param_groups_no_decay, warmup_cosine
from vispe.train_cli import AtomicCheckpointIO, launcher_trainer_settings, main

REPO = Path(__file__).resolve().parents[1]
SMOKE = recipe_path("smoke")
BIN = Path(sys.executable).parent


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for k in [k for k in env if k.startswith(("LT_", "PL_")) or k in ("WORLD_SIZE", "RANK", "LOCAL_RANK")]:
        env.pop(k)
    return env


def _run(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)


def _vispe(args: list[str], capsys) -> tuple[int, str]:
    """``vispe ARGS`` in this process (no interpreter and Lightning import per run): its exit code and stderr. The
    console script's wiring and real processes are checked by the runs above that start ``vispe`` / ``train/fit.py``."""
    from vispe.cli import main as vispe_main

    threads = torch.get_num_threads()  # the recipe's `threads: 1` pins this process's torch threads
    capsys.readouterr()
    try:
        rc = vispe_main(args)
    finally:
        torch.set_num_threads(threads)
    return rc, capsys.readouterr().err


def _ckpt(save_dir: Path, name: str = "rope_mixed") -> dict:
    path = find_last_checkpoint(save_dir / name)
    assert path is not None, f"no last.ckpt under {save_dir / name}"
    return torch.load(path, map_location="cpu", weights_only=False)


def _last_val(save_dir: Path, version: str) -> dict[str, float]:
    rows = list(csv.DictReader(open(save_dir / "rope_mixed" / version / "metrics.csv")))
    val = [r for r in rows if r.get("val/acc")]
    return {k: float(val[-1][k]) for k in ("epoch", "val/acc", "val/loss")}


def _logged(save_dir: Path, version: str = "version_0") -> dict[tuple[int, str], float]:
    """Every value the run's CSV logger wrote: ``{(step, key): value}`` (one file per run, resumes included)."""
    rows = list(csv.DictReader(open(save_dir / "rope_mixed" / version / "metrics.csv")))
    out: dict[tuple[int, str], float] = {}
    for r in rows:
        for k, v in r.items():
            if k not in ("step", "epoch") and v not in ("", None):
                assert (int(r["step"]), k) not in out, f"{k} logged twice at step {r['step']}"
                out[(int(r["step"]), k)] = float(v)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- end-to-end runs ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """`python train/fit.py -c smoke` for 3 epochs."""
    out = tmp_path_factory.mktemp("plain")
    r = _run([sys.executable, "train/fit.py", "-c", str(SMOKE), "--trainer.max_epochs", "3",
              "--trainer.logger.init_args.save_dir", str(out), "--trainer.enable_progress_bar", "false"])
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.slow
def test_plain_python_fit_trains_and_checkpoints(uninterrupted):
    ck = _ckpt(uninterrupted)
    assert ck["epoch"] == 2 and ck["global_step"] == 3 * 4  # 128 samples / batch 32 = 4 steps per epoch
    record = ck["vispe_datamodule"]  # the one image DataModule and its data set: enough to build the test split again
    assert record["class_path"] == "vispe.data.image_datamodule.ImageDataModule"
    assert record["init_args"]["dataset"]["init_args"]["train_size"] == 128
    assert 0.0 <= _last_val(uninterrupted, "version_0")["val/acc"] <= 1.0


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted(uninterrupted, tmp_path, capsys):
    """`vispe fit` killed by SIGKILL at the start of epoch 3, then `--ckpt_path last` -> identical result."""
    (tmp_path / "killer.py").write_text(textwrap.dedent("""
        import os, signal
        from lightning.pytorch.callbacks import Callback
        class KillAtEpoch(Callback):
            def __init__(self, epoch: int = 2):
                self.epoch = epoch
            def on_train_epoch_start(self, trainer, pl_module):
                if trainer.current_epoch == self.epoch:
                    os.kill(os.getpid(), signal.SIGKILL)
    """))
    (tmp_path / "kill.yaml").write_text("trainer:\n  callbacks:\n    - class_path: killer.KillAtEpoch\n      init_args: {epoch: 2}\n")
    out = tmp_path / "runs"
    common = ["-c", str(SMOKE), "--trainer.max_epochs", "3", "--trainer.logger.init_args.save_dir", str(out),
              "--trainer.enable_progress_bar", "false"]
    env = _env()
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"
    killed = subprocess.run([str(BIN / "vispe"), "fit", *common, "-c", str(tmp_path / "kill.yaml")],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    partial = _ckpt(out)
    assert partial["epoch"] == 1 and partial["global_step"] == 8  # the checkpoint written before the kill
    assert not [p for p in (out / "rope_mixed" / "version_0" / "checkpoints").iterdir() if p.name.endswith(".tmp")]

    rc, err = _vispe(["fit", *common, "--ckpt_path", "last"], capsys)  # the resume: a new Trainer from the checkpoint
    assert rc == 0, err[-3000:]
    a, b = _ckpt(uninterrupted), _ckpt(out)
    assert b["global_step"] == a["global_step"] == 12
    for k, v in a["state_dict"].items():
        torch.testing.assert_close(b["state_dict"][k], v, rtol=0, atol=1e-6, msg=f"weights differ at {k}")
    # one run, one folder: the resumed run continues version_0's metrics, which equal the uninterrupted run's
    assert sorted(p.name for p in (out / "rope_mixed").iterdir()) == ["version_0"]
    logged, expected = _logged(out), _logged(uninterrupted)
    assert logged.keys() == expected.keys() and logged == pytest.approx(expected, abs=1e-6)


@pytest.mark.slow  # needs the uninterrupted training run (the fixture) like the other resume tests
def test_resuming_a_finished_run_says_so_and_writes_nothing(uninterrupted, tmp_path, capsys):
    out = tmp_path / "runs"
    shutil.copytree(uninterrupted, out)
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}
    rc, err = _vispe(["fit", "-c", str(SMOKE), "--trainer.max_epochs", "3", "--trainer.logger.init_args.save_dir", str(out),
                      "--trainer.enable_progress_bar", "false", "--ckpt_path", "last"], capsys)
    assert rc == 0, err[-3000:]
    assert "is a finished run (epoch 3 of max_epochs=3); nothing to resume and nothing written" in err
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}
    assert after == before


_KILLER = """
import os, signal
from lightning.pytorch.callbacks import Callback
class KillAtStep(Callback):
    def __init__(self, step: int):
        self.step = step
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_matches_uninterrupted(tmp_path, capsys):
    """Killed mid-epoch between two checkpoints (validation + last.ckpt every 2 of the epoch's 4 steps; killed as
    step 8 starts, after the step-6 checkpoint and one more step), resumed with `--ckpt_path last`: the same
    weights and validation metrics as the uninterrupted run -- data order, sampler position, RNG streams,
    optimiser and schedule all continue where the checkpoint left them."""
    (tmp_path / "killer.py").write_text(_KILLER)
    (tmp_path / "kill.yaml").write_text("trainer:\n  callbacks:\n    - class_path: killer.KillAtStep\n      init_args: {step: 7}\n")
    common = ["-c", str(SMOKE), "--trainer.max_epochs", "3", "--trainer.val_check_interval", "2",
              "--trainer.enable_progress_bar", "false"]
    straight, out = tmp_path / "straight", tmp_path / "runs"
    rc, err = _vispe(["fit", *common, "--trainer.logger.init_args.save_dir", str(straight)], capsys)
    assert rc == 0, err[-3000:]
    env = _env()
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"
    killed = subprocess.run([str(BIN / "vispe"), "fit", *common, "--trainer.logger.init_args.save_dir", str(out),
                             "-c", str(tmp_path / "kill.yaml")], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    partial = _ckpt(out)
    assert partial["epoch"] == 1 and partial["global_step"] == 6  # mid-epoch: 2 of epoch 1's 4 steps done
    rc, err = _vispe(["fit", *common, "--trainer.logger.init_args.save_dir", str(out), "--ckpt_path", "last"], capsys)
    assert rc == 0, err[-3000:]
    a, b = _ckpt(straight), _ckpt(out)
    assert b["global_step"] == a["global_step"] == 12
    for k, v in a["state_dict"].items():
        torch.testing.assert_close(b["state_dict"][k], v, rtol=0, atol=1e-6, msg=f"weights differ at {k}")
    for (sa, sb) in zip(a["optimizer_states"][0]["state"].values(), b["optimizer_states"][0]["state"].values()):
        torch.testing.assert_close(sb["exp_avg"], sa["exp_avg"], rtol=0, atol=1e-6)
    assert a["lr_schedulers"] == b["lr_schedulers"]
    logged, expected = _logged(out), _logged(straight)  # the killed run's rows after step 6 are replaced, not doubled
    assert logged.keys() == expected.keys()
    # epoch-level training aggregates of the interrupted epoch cover only the batches after the resume (Lightning
    # does not checkpoint a metric's running state mid-epoch); every other value is the uninterrupted run's
    partial_epoch = {(7, "train/acc"), (7, "train/loss_epoch")}
    assert {k: v for k, v in logged.items() if k not in partial_epoch} == pytest.approx(
        {k: v for k, v in expected.items() if k not in partial_epoch}, abs=1e-6)


@pytest.mark.slow
def test_last_ckpt_is_the_final_step_and_reruns_get_their_own_version(tmp_path, capsys):
    """`max_steps: 7` with validation every 2 steps: Lightning's own last save is step 6; ours is step 7. A second
    run into the same folder writes version_1 and leaves version_0's checkpoint as it was."""
    common = ["fit", "-c", str(SMOKE), "--trainer.max_epochs", "10", "--trainer.val_check_interval", "2",
              "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(tmp_path)]
    rc, err = _vispe([*common, "--trainer.max_steps", "7"], capsys)
    assert rc == 0, err[-3000:]
    first = tmp_path / "rope_mixed" / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(first, map_location="cpu", weights_only=False)["global_step"] == 7
    before = first.read_bytes()
    rc, err = _vispe([*common, "--trainer.max_steps", "5"], capsys)
    assert rc == 0, err[-3000:]
    second = tmp_path / "rope_mixed" / "version_1" / "checkpoints" / "last.ckpt"
    assert torch.load(second, map_location="cpu", weights_only=False)["global_step"] == 5
    assert first.read_bytes() == before
    assert find_last_checkpoint(tmp_path / "rope_mixed") == second


@pytest.mark.slow
def test_ckpt_path_last_without_a_checkpoint_is_a_clear_error(tmp_path, capsys):
    rc, err = _vispe(["fit", "-c", str(SMOKE), "--trainer.logger.init_args.save_dir", str(tmp_path), "--ckpt_path", "last"], capsys)
    assert rc == 2
    assert "--ckpt_path last: no last.ckpt under" in err and "Traceback" not in err, err[-2000:]


@pytest.mark.parametrize("how", ["yaml", "flag"])
@pytest.mark.slow
def test_config_error_is_one_sentence_without_traceback(tmp_path, how, capsys):
    """A misspelled encoding (in YAML or on the command line): exit 2, the sentence naming it, no traceback;
    `--debug` lets the error through, so the interpreter prints its traceback (checked once: the flag's handling does
    not depend on where the typo is)."""
    if how == "yaml":
        (tmp_path / "typo.yaml").write_text("model:\n  init_args:\n    pos_encoding: rope_axail\n")
        extra = ["-c", str(tmp_path / "typo.yaml")]
    else:
        extra = ["--model.init_args.pos_encoding", "rope_axail"]
    cmd = ["fit", "-c", str(SMOKE), "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), *extra]
    rc, err = _vispe(cmd, capsys)
    assert rc == 2, err[-2000:]
    assert "unknown positional encoding 'rope_axail'; choose one of" in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if "rope_axail" in line]) == 1
    if how == "flag":
        with pytest.raises(ValueError, match="unknown positional encoding 'rope_axail'"):
            _vispe([*cmd, "--debug"], capsys)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_checkpoint_follows_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        AtomicCheckpointIO().save_checkpoint({"a": torch.ones(2)}, tmp_path / "last.ckpt")
    finally:
        os.umask(old)
    assert (tmp_path / "last.ckpt").stat().st_mode & 0o777 == mode


@pytest.mark.skipif(not (BIN / "fabric").exists(), reason="lightning's fabric launcher not installed")
@pytest.mark.slow
def test_fabric_run_is_one_ddp_job_with_world_size_2(tmp_path):
    r = _run([str(BIN / "fabric"), "run", "--accelerator", "cpu", "--devices", "2", "--main-port", str(_free_port()),
              "train/fit.py", "-c", str(SMOKE), "--trainer.logger.init_args.save_dir", str(tmp_path),
              "--trainer.enable_progress_bar", "false"])
    assert r.returncode == 0, r.stderr[-3000:]
    versions = sorted(p.name for p in (tmp_path / "rope_mixed").iterdir() if p.name.startswith("version_"))
    assert versions == ["version_0"], versions  # one job, not two independent ones
    hparams = (tmp_path / "rope_mixed" / "version_0" / "hparams.yaml").read_text()
    assert "world_size: 2" in hparams
    # each rank sees half of the 128 samples: 2 steps per epoch instead of 4
    assert _ckpt(tmp_path)["global_step"] == 2 * 2


# -- launcher mapping and guards (in-process, nothing trains) ----------------------------------
def test_launcher_settings_from_fabric_and_torchrun_env():
    fab = launcher_trainer_settings({"LT_CLI_USED": "1", "LT_DEVICES": "2", "LT_NUM_NODES": "1", "LT_ACCELERATOR": "cpu", "WORLD_SIZE": "2"})
    assert {k: v for k, (v, _) in fab.items()} == {"devices": 2, "num_nodes": 1, "accelerator": "cpu", "strategy": "ddp"}
    tr = launcher_trainer_settings({"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"})
    assert {k: v for k, (v, _) in tr.items()} == {"devices": 2, "num_nodes": 2, "strategy": "ddp"}
    assert launcher_trainer_settings({}) == {}


def test_config_conflicting_with_fabric_run_fails_before_training(monkeypatch, tmp_path):
    for k, v in {"LT_CLI_USED": "1", "LT_DEVICES": "2", "LT_NUM_NODES": "1", "LT_ACCELERATOR": "cpu"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=r"trainer.devices='?1'? conflicts with the process launcher \(LT_DEVICES=2\)"):
        main(["fit", "-c", str(SMOKE), "--trainer.devices", "1", "--trainer.logger.init_args.save_dir", str(tmp_path)])
    assert not any(tmp_path.iterdir())


def test_world_size_guard_catches_duplicated_training(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as if a launcher had started 2 processes
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2 .* world size is 1"):
        main(["fit", "-c", str(SMOKE), "--trainer.devices", "1", "--trainer.logger.init_args.save_dir", str(tmp_path)])


@pytest.mark.parametrize(
    "args, error, message",
    [
        (["--model.init_args.pos_encoding", "no_such_pe"], ValueError, "unknown positional encoding 'no_such_pe'; choose one of"),
        (["--model.init_args.model", "vispe_vit_no_such"], ValueError, "unknown model 'vispe_vit_no_such'"),
        (["--data.init_args.dataset", "vispe.data.CIFAR10Images", "--data.init_args.dataset.init_args.data_dir", "/no/such/cifar10-jpeg"],
         FileNotFoundError, "not found at '/no/such/cifar10-jpeg'"),
    ],
)
def test_config_errors_fail_before_training(tmp_path, args, error, message):
    with pytest.raises(error, match=message):
        main(["fit", "-c", str(SMOKE), "--trainer.logger.init_args.save_dir", str(tmp_path), *args])
    assert not any(tmp_path.iterdir())  # no log dir, no checkpoint: nothing started


# -- task pieces -------------------------------------------------------------------------------
def test_atomic_checkpoint_io_leaves_old_file_on_failure(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "ck" / "last.ckpt"
    io.save_checkpoint({"a": torch.ones(3)}, path)
    assert torch.equal(torch.load(path)["a"], torch.ones(3))

    class Unpicklable:
        def __reduce__(self):
            raise pickle.PicklingError("boom")

    with pytest.raises(pickle.PicklingError):
        io.save_checkpoint({"a": torch.zeros(3), "b": Unpicklable()}, path)
    assert torch.equal(torch.load(path)["a"], torch.ones(3))  # previous checkpoint intact
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]  # no temp file left


def test_warmup_cosine_shape():
    total, warm = 100, 10
    lr = [warmup_cosine(s, total, warm, 0.01) for s in range(total + 1)]
    assert lr[0] == pytest.approx(0.1) and lr[warm - 1] == pytest.approx(1.0) and lr[warm] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lr[warm:], lr[warm + 1:]))
    assert lr[-1] == pytest.approx(0.01)


def test_no_weight_decay_groups():
    task = ImageClassification("vispe_vit_tiny_patch4_32", {"embed_dim": 32, "depth": 2, "num_heads": 2}, "rope_mixed", num_classes=4)
    decay, no_decay = param_groups_no_decay(task.model, 0.05)
    names = {id(p): n for n, p in task.model.named_parameters()}
    nd = {names[id(p)] for p in no_decay["params"]}
    d = {names[id(p)] for p in decay["params"]}
    assert {"pos_encoding.freqs", "cls_token", "blocks.0.norm1.weight", "blocks.0.attn.qkv.bias"} <= nd
    assert {"blocks.0.attn.qkv.weight", "head.weight"} <= d
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.05


@pytest.mark.parametrize("backend", ["timm", "torchvision"])
def test_mixing_gives_soft_labels(backend):
    task = ImageClassification("vispe_vit_tiny_patch4_32", {"embed_dim": 32, "depth": 1, "num_heads": 2}, "learned",
                               num_classes=4, img_size=16, mixup_alpha=0.8, cutmix_alpha=1.0, mix_backend=backend)
    x, y = torch.randn(6, 3, 16, 16), torch.tensor([0, 1, 2, 3, 0, 1])
    xm, soft = task._mix(x, y)
    assert xm.shape == x.shape and soft.shape == (6, 4)
    torch.testing.assert_close(soft.sum(-1), torch.ones(6))


def test_pos_encoding_on_plain_timm_model_is_rejected():
    with pytest.raises(ValueError, match="pos_encoding is an option of vispe_\\* models"):
        ImageClassification("vit_tiny_patch16_224", pos_encoding="rope_axial")


# -- Lightning composition: data sizes linked into the model, the backbone as an argument ----------------------------
TINY_VIT = dict(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2)


def _cli(*args: str):
    """The classes ``vispe fit -c smoke ARGS`` would train, built and not run."""
    import warnings

    from vispe.train_cli import VispeCLI

    with warnings.catch_warnings():  # the arguments are given explicitly, as `vispe fit` gives them
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        return VispeCLI(args=["-c", str(SMOKE), "--trainer.logger", "false", "--trainer.enable_checkpointing", "false", *args],
                        run=False)


def test_data_sizes_are_linked_into_the_model_once_the_data_is_built():
    cli = _cli("--data.init_args.dataset.init_args.num_classes", "3", "--data.init_args.dataset.init_args.image_size", "8")
    assert (cli.datamodule.num_classes, cli.datamodule.image_size) == (3, 8)
    _check_linked(cli)


def test_a_config_of_a_former_datamodule_name_still_builds_and_links():
    cli = _cli("--data", "vispe.data.SyntheticDataModule", "--data.init_args.num_classes", "3", "--data.init_args.image_size", "8")
    assert type(cli.datamodule).__name__ == "SyntheticDataModule" and cli.datamodule.augment == "flip"  # its former default
    _check_linked(cli)


def test_links_skip_arguments_the_model_does_not_take():
    """Image data (num_classes, in_chans, image_size) under a task that takes only img_size: the others are neither
    passed nor recorded, so the checkpoint's hyper-parameters build the task again."""
    cli = _cli("--model", "vispe.tasks.ThreeCellTask", "--model.init_args.model", "vispe_vit_tiny_patch4_32",
               "--model.init_args.model_kwargs", "{embed_dim: 32, depth: 1, num_heads: 2}")
    hp = cli.model.hparams
    assert hp.img_size == 16 and "num_classes" not in hp and "in_chans" not in hp


def _check_linked(cli) -> None:
    hp = cli.model.hparams
    assert (hp.num_classes, hp.in_chans, hp.img_size) == (3, 3, 8)  # recorded as the model's hyper-parameters
    assert cli.model.model.head.out_features == 3 and cli.model.model.patch_embed.img_size == (8, 8)
    assert "visual_dim" not in hp  # a link whose attribute the data lacks is skipped


def test_module_backbone_from_python():
    import timm

    vit = timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding="rope_axial", num_classes=4, **TINY_VIT)
    task = ImageClassification(model=vit, num_classes=4, img_size=16)
    assert task.model is vit and task.hparams.model is None  # its weights are in the state dict, not the hyper-parameters
    with pytest.raises(ValueError, match=r"pass it again \(load_from_checkpoint\(path, model=<the module>\)\)"):
        ImageClassification(**{k: v for k, v in task.hparams.items() if k != "model"}, model=task.hparams.model)
    assert task(torch.randn(2, 3, 16, 16)).shape == (2, 4)
    with pytest.raises(ValueError, match="has num_classes=4 but the task needs num_classes=10"):
        ImageClassification(model=vit, num_classes=10)
    with pytest.raises(ValueError, match="pos_encoding configure a model built from its name"):
        ImageClassification(model=vit, num_classes=4, pos_encoding="rope_mixed")


def test_module_backbone_from_a_config_class_path():
    """Any nn.Module class with its arguments (here timm's plain ViT) is the backbone; the record builds it again."""
    import yaml

    from timm.models.vision_transformer import VisionTransformer

    from vispe.train_cli import run_name

    spec = {"class_path": "timm.models.vision_transformer.VisionTransformer", "init_args": {"num_classes": 4, **TINY_VIT}}
    cli = _cli("--model.init_args.model", yaml.safe_dump(spec, default_flow_style=True).strip(),
               "--model.init_args.model_kwargs", "null", "--model.init_args.pos_encoding", "null")
    assert type(cli.model.model) is VisionTransformer and cli.model.model.embed_dim == 32
    assert cli.model(torch.randn(2, 3, 16, 16)).shape == (2, 4)
    assert cli.model.hparams.model["class_path"] == spec["class_path"]  # a checkpoint can build it again
    rebuilt = ImageClassification(**{k: v for k, v in cli.model.hparams.items() if not k.startswith("_")})
    assert type(rebuilt.model) is VisionTransformer and rebuilt(torch.randn(1, 3, 16, 16)).shape == (1, 4)
    # a module config's own encoding names the run
    assert run_name({"init_args": {"model": {"init_args": {"pos_encoding": "rope_axial[coord_shift=1.0]"}}}}) == "rope_axial"
