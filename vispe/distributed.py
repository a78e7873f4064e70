"""vispe under data-parallel and sharded training: FSDP2 sharding of a vispe model, and the rules that keep
position state correct when it is distributed.

* Derived position tables (rotary frequencies and angles, lattice codes, cached rotations, bias tables) are never
  module state: they are rebuilt from parameters and the grid inside the forward and cached per grid as plain
  attributes, so DDP has nothing to broadcast for them (its buffer broadcast sees only FIRE's constant
  ``threshold_init``), ranks may run different grids (NaFlex, mixed resolutions), and a meta-device build needs no
  special care (:mod:`vispe.models.materialize`).
* :func:`shard_model` (FSDP2, ``fully_shard``): one FSDP group per transformer block, then the root. The encoding's
  parameters (tables, generators, frequencies) join the root group with the patch embedding and the head: they are a
  few kilobytes, read by every block, and FSDP2 can only shard or ignore a parameter -- an ignored one would need its
  own gradient all-reduce -- so sharding them in the root group (one all-gather per step, issued with the
  embedding's) is the cheapest correct choice.
* BatchNorm (LOOPE's context network) normalises by each process's batch; on CUDA :func:`sync_batchnorm` converts it
  to ``SyncBatchNorm`` so a distributed step equals the single-process step of the same global batch. PyTorch's
  ``SyncBatchNorm`` runs on CUDA only: on CPU, LOOPE's statistics are per process.

``tests/test_distributed.py`` checks DDP and FSDP2 steps against one process for every registered 2D encoding. Known
limit: SeqPE's contrastive regulariser fails under FSDP2 (a root parameter's storage is freed before its second use
in backward); SeqPE trains under FSDP2 with ``contrastive_weight=0``, and under DDP as it is.
"""
from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

import torch.nn as nn

__all__ = ["configure_sharding", "end_spawned_worker", "shard_model", "sync_batchnorm", "transformer_blocks"]


def end_spawned_worker() -> NoReturn:
    """End a ``torch.multiprocessing.spawn`` worker that has destroyed its process group and written its results, with
    exit status 0 and without the interpreter's finalization.

    ``destroy_process_group`` leaves the gloo backend alive while DDP, FSDP2 or a device mesh still reference it, and
    its C++ threads may drop the last reference to a Python-owned tensor after the interpreter has begun to finalize;
    Python < 3.14 then ends that thread with ``pthread_exit``, whose unwinding through C++ aborts the process
    ("terminate called without an active exception") after its work is done. Skipping finalization leaves nothing
    for such a thread to race with. Call it on the success path only: an exception should still reach ``spawn``."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a vispe host (``blocks`` of the image / video ViT and of the video-LLM)."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, (nn.ModuleList, nn.Sequential)) or not len(blocks):
        raise ValueError(f"{type(model).__name__} has no 'blocks' to shard; shard_model takes vispe's ViTs and video-LLM")
    return list(blocks)


def shard_model(model: nn.Module, mesh: Any = None, reshard_after_forward: bool = True, **fsdp_kwargs: Any) -> nn.Module:
    """Apply FSDP2 (``torch.distributed.fsdp.fully_shard``) to each transformer block, then to the whole model (the
    root group: embeddings, head, the positional encoding's parameters). ``reshard_after_forward`` applies to the
    blocks; the root group is never resharded between forward and backward. Returns ``model`` (sharded in place)."""
    from torch.distributed.fsdp import fully_shard

    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, **fsdp_kwargs)
    # the root group stays gathered from forward to the end of backward: backward needs it at once, and an auxiliary
    # loss (SeqPE's contrastive term) reaches the encoding's root parameters by a path that bypasses the root's output,
    # so FSDP2's pre-backward gather would come too late for it
    fully_shard(model, mesh=mesh, reshard_after_forward=False, **fsdp_kwargs)
    return model


def sync_batchnorm(model: nn.Module) -> nn.Module:
    """``SyncBatchNorm`` in place of every BatchNorm (LOOPE's context network), for multi-process training on CUDA
    (PyTorch's ``SyncBatchNorm`` has no CPU kernel)."""
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def configure_sharding(task: Any, *modules: nn.Module) -> None:
    """A task's ``configure_model`` under Lightning's ``ModelParallelStrategy``: FSDP2 over the mesh's data-parallel
    dimension (:func:`shard_model`) for each vispe host given; nothing under any other strategy. Lightning may call
    ``configure_model`` more than once: a module already sharded is left as it is."""
    mesh = getattr(task, "device_mesh", None)
    if mesh is None:
        return
    if "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            f"vispe shards with FSDP2 only; the ModelParallelStrategy mesh has tensor_parallel_size="
            f"{mesh['tensor_parallel'].size()}: set --trainer.strategy.tensor_parallel_size 1 and "
            f"--trainer.strategy.data_parallel_size to the number of processes"
        )
    dp = mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh
    from torch.distributed.fsdp import FSDPModule

    for module in modules:
        if not isinstance(module, FSDPModule):
            shard_model(module, mesh=dp)

