"""Models built on the meta device and materialised after sharding (FSDP2, large models): what vispe guarantees.

``with torch.device("meta"): model = timm.create_model(...)`` allocates nothing; ``model.to_empty(device=...)`` then
gives every parameter and buffer storage with undefined contents. Two ways on from there give the model a normally
built one would have:

* load a state dict (``load_state_dict(strict=True)``): every encoding keeps its derived tables (frequencies,
  lattice codes, cached rotations) out of persistent state -- they are rebuilt from parameters and the grid on the
  first forward -- and no encoding keeps a non-persistent buffer that a forward reads without rebuilding it, so the
  loaded model equals the saved one;
* or initialise in place with :func:`init_empty_weights`.

``tests/test_meta_device.py`` checks both for every registered encoding (image ViT, video ViT, video-LLM).
"""
from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["init_empty_weights"]


def init_empty_weights(model: nn.Module) -> nn.Module:
    """Initialise, in place, a model whose storage came from ``to_empty`` (contents undefined) as a fresh build would.

    1. every module's own ``reset_parameters`` (norms, convolutions, linear layers: innermost first);
    2. the host's ``init_weights()`` (timm's ViT init, the video models' init);
    3. every (outermost) positional encoding is built again on the CPU from the options it was created with
       (:func:`vispe.encodings.create_encoding` records them) and its parameters and buffers copied in: an encoding's
       init (tables, generators, frequency ladders, prefix embeddings) is whatever its constructor does, with no
       second init to keep in step with it;
    4. the host's ``tie_weights()`` (``to_empty`` unties shared parameters).

    Returns ``model``.
    """
    from vispe.encodings.base import PositionalEncoding

    with torch.no_grad():
        # modules() lists a parent before its children: reversed, every child resets before its parent
        for mod in reversed(list(model.modules())):
            if isinstance(mod, PositionalEncoding):
                continue
            reset = getattr(mod, "reset_parameters", None)
            if callable(reset):
                reset()
        init = getattr(model, "init_weights", None)
        if callable(init):
            init()
        encodings = [m for m in model.modules() if isinstance(m, PositionalEncoding)]
        inner = {id(c) for e in encodings for c in e.modules() if c is not e}  # parts of a composed encoding
        for enc in encodings:
            if id(enc) not in inner:
                _rebuild_encoding(enc)
        tie = getattr(model, "tie_weights", None)  # to_empty unties shared parameters
        if callable(tie):
            tie()
    return model


def _rebuild_encoding(enc: nn.Module) -> None:
    recorded = getattr(enc, "construction", None)
    if recorded is None:
        raise ValueError(
            f"{type(enc).__name__} was not made by vispe.encodings.create_encoding, so how to build it again is unknown; "
            "load a state dict into the materialised model instead"
        )
    cls, args, backend = recorded
    with torch.device("cpu"):
        fresh = cls(**args)
    if backend is not None:
        fresh.set_backend(backend)
    mine = dict(enc.named_parameters(recurse=True)) | dict(enc.named_buffers(recurse=True))
    theirs = dict(fresh.named_parameters(recurse=True)) | dict(fresh.named_buffers(recurse=True))
    if mine.keys() != theirs.keys():
        raise ValueError(f"{type(enc).__name__}: rebuilt with other tensors ({sorted(mine.keys() ^ theirs.keys())[:5]})")
    for key, t in mine.items():
        t.copy_(theirs[key])
