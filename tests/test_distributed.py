"""Distributed training on CPU (gloo, 2 processes): a DDP step and an FSDP2 step (:func:`vispe.distributed.shard_model`)
give the single-process step's loss and gradients of the same global batch, for every registered 2D encoding; ranks
may see different grids under DDP."""
from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.multiprocessing as mp

import vispe  # noqa: F401
from vispe.encodings import list_encodings

pytestmark = pytest.mark.slow

ENCODINGS = list_encodings(grid_ndim=2)
GLOBAL_BATCH = 4
#: known failures, asserted to fail so a fix is noticed: SeqPE's contrastive loss under FSDP2 (its second pass through
#: the position encoder, outside the blocks' graph) reads a root parameter whose storage FSDP2 has already freed in
#: backward ("setStorage ... storage of size 0"); with contrastive_weight=0 it trains and matches.
KNOWN_FAILURES = {("fsdp2", "seqpe"): "setStorage"}


def _model(name):
    """The tiny model in training mode, except BatchNorm (LOOPE's context network): it normalises by each process's
    own batch, and PyTorch's SyncBatchNorm (:func:`vispe.distributed.sync_batchnorm`) runs on CUDA only, so on CPU
    the check holds its statistics fixed."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding=name, depth=2, num_classes=5, img_size=16,
                              embed_dim=32, num_heads=2).train()
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.eval()
    return model


def _batch(size=16):
    g = torch.Generator().manual_seed(1)
    return torch.randn(GLOBAL_BATCH, 3, size, size, generator=g), torch.randint(0, 5, (GLOBAL_BATCH,), generator=g)


def _loss(model, x, y, runner=None):
    """Cross-entropy of ``runner`` (the model, or its DDP wrapper) plus the model's auxiliary loss, as the tasks add it."""
    loss = torch.nn.functional.cross_entropy((model if runner is None else runner)(x), y)
    extra = model.auxiliary_loss()
    return loss if extra is None else loss + extra


def _single_process_grads(name):
    model = _model(name)
    x, y = _batch()
    loss = _loss(model, x, y)
    loss.backward()
    return loss.item(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _worker(rank, world, init_file, names, out_dir, mode):
    import torch.distributed as dist

    torch.set_num_threads(1)
    # a file rendezvous: no TCP port to race for with other jobs on the machine
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        x, y = _batch()
        part = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        results = {}
        for name in names:
            try:
                results[name] = _distributed_step(name, mode, x[part], y[part], world)
            except Exception as err:  # reported per encoding by the test
                results[name] = f"{type(err).__name__}: {str(err)[:300]}"
        if rank == 0:
            torch.save(results, os.path.join(out_dir, f"{mode}.pt"))
    finally:
        dist.destroy_process_group()


def _distributed_step(name, mode, x, y, world):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from vispe.distributed import shard_model

    model = _model(name)
    if mode == "ddp":
        wrapped = DDP(model)  # kept alive through backward: its reducer all-reduces the gradients there
        loss = _loss(model, x, y, runner=wrapped)
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    else:
        from torch.distributed.device_mesh import init_device_mesh

        shard_model(model, mesh=init_device_mesh("cpu", (world,)))
        loss = _loss(model, x, y)
        loss.backward()
        grads = {k: p.grad.full_tensor() for k, p in model.named_parameters() if p.grad is not None}
    losses = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(losses, loss.detach().reshape(()))
    return sum(v.item() for v in losses) / world, grads



@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_process_step_equals_one_process_step(tmp_path, mode):
    mp.spawn(_worker, args=(2, str(tmp_path / "rendezvous"), ENCODINGS, str(tmp_path), mode), nprocs=2, join=True)
    got = torch.load(tmp_path / f"{mode}.pt", weights_only=False)
    mismatched = []
    for name in ENCODINGS:
        known = KNOWN_FAILURES.get((mode, name))
        if known is not None:
            assert isinstance(got[name], str) and known in got[name], f"{name} under {mode} no longer fails as recorded: {got[name]!r:.200}"
            continue
        loss, ref = _single_process_grads(name)
        if isinstance(got[name], str):
            mismatched.append((name, got[name]))
            continue
        dist_loss, grads = got[name]
        if abs(dist_loss - loss) > 1e-5 * max(1.0, abs(loss)) or set(grads) != set(ref):
            mismatched.append((name, "loss or parameter set", dist_loss, loss))
            continue
        for k, g in ref.items():
            if not torch.allclose(grads[k], g, rtol=1e-4, atol=1e-6):
                mismatched.append((name, k, (grads[k] - g).abs().max().item()))
                break
    assert not mismatched, mismatched


def test_vispe_fit_under_model_parallel_strategy_resumes_and_is_swept(tmp_path):
    """`vispe fit` under Lightning's ModelParallelStrategy (FSDP2 via the task's configure_model, 2 CPU processes):
    a sharded checkpoint folder is written, `--ckpt_path last` resumes it into the same version folder, and
    `vispe resolution` evaluates it (the shards read whole in one process)."""
    import subprocess
    import sys

    base = [sys.executable, "-m", "vispe.cli", "fit", "--recipe", "smoke", "--trainer.accelerator", "cpu",
            "--trainer.devices", "2", "--trainer.strategy", "ModelParallelStrategy",
            "--trainer.strategy.data_parallel_size", "2", "--trainer.strategy.tensor_parallel_size", "1",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(args):
        done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    run(base + ["--trainer.max_epochs", "1"])
    last = tmp_path / "runs/smoke/rope_mixed/version_0/checkpoints/last.ckpt"
    assert last.is_dir() and (last / ".metadata").is_file()  # one shard per rank, not a single file
    assert len(list(last.glob("*.distcp"))) == 2
    run(base + ["--trainer.max_epochs", "2", "--ckpt_path", "last"])
    from vispe.files import read_checkpoint

    ckpt = read_checkpoint(last)
    assert ckpt["epoch"] == 1 and not (tmp_path / "runs/smoke/rope_mixed/version_1").exists()
    assert any(k.startswith("model.pos_encoding.freqs") for k in ckpt["state_dict"])
    run([sys.executable, "-m", "vispe.cli", "resolution", str(last), "--sizes", "8,16", "--out", str(tmp_path / "res"),
         "--quiet"])
    import json

    report = json.loads((tmp_path / "res" / "resolution.json").read_text())
    assert report["results"], report


def test_scaling_benchmark_command_runs_each_strategy(tmp_path, capsys):
    """`vispe bench scaling` on a tiny setting: one row per encoding and strategy, efficiencies and memory ratios
    against the single process; bad options fail before any process starts."""
    import json

    from vispe.cli import main as cli_main

    rc = cli_main(["bench", "scaling", "--encodings", "rope_mixed", "--depth", "1", "--steps", "1", "--warmup", "0",
                   "--global-batch", "4", "--out-dir", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "scaling.json").read_text())["rows"]
    assert [(r["strategy"], r["processes"]) for r in rows] == [("single", 1), ("ddp", 2), ("fsdp2", 2)]
    for r in rows:
        assert "error" not in r and r["samples_per_s"] > 0 and r["peak_bytes"] > 0
    assert rows[0]["efficiency"] == 1.0
    # an FSDP2 rank keeps half of the parameters, gradients and AdamW state that a DDP rank keeps in full
    assert rows[2]["peak_bytes"] < rows[1]["peak_bytes"]
    assert "| rope_mixed | fsdp2 | 2 |" in capsys.readouterr().out
    from vispe.benchmarks.scaling import main as scaling_main

    for argv, match in ((["--strategies", "dpp"], "unknown strategy 'dpp'.*did you mean 'ddp'"),
                        (["--global-batch", "3"], "multiple of --nproc 2"), (["--encodings", "ropee"], "ropee")):
        with pytest.raises(ValueError, match=match):
            scaling_main(argv)
