"""Native CPU kernels for attention terms read from tables by index (``csrc/indexed_term.cpp``), built on first use.

The blocked attention path (:mod:`vispe.encodings.attention`) builds a bias term block by block. In PyTorch ops each
block costs several passes over its ``(B, H, rows, L)`` logits: the pair ids, the gather from the table, the add,
``exp``, and in backward the multiply, the batch sum and the ``index_add`` onto the table. These kernels run the
attention in tiles of query rows whose logits stay in cache, and do the gather (with the add and ``exp``) and the
scatter (with the multiply and the batch sum) in one pass each. Their products call the BLAS ``sgemm`` that PyTorch's
library exports (MKL builds on x86) directly, else ``at::mm``.

The same module holds ``small_bmm``'s kernel: batches of products with 8 result columns (LieRE's 8 x 8 blocks), which
ATen's ``bmm`` runs as one BLAS call per product.

They are compiled for this machine the first time a float32 CPU training step needs them
(``torch.utils.cpp_extension.load``: a C++ compiler and ninja, which the ``train`` extra installs; ~20 s once on a
2-core CPU, then cached in ``TORCH_EXTENSIONS_DIR`` per CPU capability, PyTorch build and source file); without them,
or with ``VISPE_NATIVE_KERNELS=0``, the same path runs in PyTorch ops (same values, slower). The kernels are
operators, ``torch.ops.vispe_native.*`` (no Python bindings to compile).
"""
from __future__ import annotations

import hashlib
import os
import threading
import warnings
from pathlib import Path
from typing import Any

__all__ = ["NATIVE_KERNELS_ENV", "indexed_term_kernels", "small_bmm"]

#: environment switch: ``0`` keeps the PyTorch-ops path (no compiler needed)
NATIVE_KERNELS_ENV = "VISPE_NATIVE_KERNELS"
_SOURCE = Path(__file__).with_name("csrc") / "indexed_term.cpp"
_LOCK = threading.Lock()
_STATE: dict[str, Any] = {}


def indexed_term_kernels() -> Any:
    """The compiled kernels (``gather_term``, ``term_attention_forward``, ``term_attention_backward``), or ``None``
    when they are switched off or cannot be built (a warning says why, once per process)."""
    if os.environ.get(NATIVE_KERNELS_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if "module" in _STATE:
        return _STATE["module"]
    with _LOCK:
        if "module" not in _STATE:
            _STATE["module"] = _build()
    return _STATE["module"]


#: compiler flags per CPU capability that PyTorch reports: the gathers and the exp polynomial vectorise with them
_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}


def _build() -> Any:
    try:
        import torch
        from torch.utils.cpp_extension import load  # needs setuptools; the build needs ninja and a C++ compiler

        # named and flagged by the CPU capability, not -march=native: a build cache shared by machines with different
        # CPUs (a cluster's home directory) then never hands one a module with instructions it lacks
        capability = torch.backends.cpu.get_cpu_capability()
        flags = _CAPABILITY_FLAGS.get(capability, [])
        # one build folder per PyTorch install and source file: two environments (or checkouts) that share the
        # cache would otherwise rebuild over each other's module on every switch
        where = hashlib.sha1(f"{Path(torch.__file__).parent}|{torch.__version__}|{_SOURCE}".encode()).hexdigest()[:8]
        load(name=f"vispe_indexed_term_{capability.lower()}_{where}", sources=[str(_SOURCE)],
             extra_cflags=["-O3", *flags], is_python_module=False, verbose=False)
        return torch.ops.vispe_native
    except Exception as err:  # no compiler, ninja or headers, unsupported flags: PyTorch ops instead
        warnings.warn(
            f"vispe: the native CPU kernels could not be built ({type(err).__name__}: {err}); the blocked attention "
            f"path and LieRE's small products use PyTorch ops instead (same values, slower). Set {NATIVE_KERNELS_ENV}=0 "
            "to skip the build.",
            RuntimeWarning, stacklevel=3)
        return None


def small_bmm(a: "torch.Tensor", b: "torch.Tensor", out: "torch.Tensor | None" = None,
              accumulate: bool = False) -> "torch.Tensor":
    """``a @ b`` for a batch of small matrices, ``(N, M, K) @ (N, K, P)``; with ``out`` the product is written there
    (``accumulate``: added to it, as ``out.baddbmm_(a, b)``). Float32 CPU products of at most 16 rows and 8 columns,
    ``b`` with contiguous rows (LieRE's 8 x 8 blocks), run in the native kernel (2.4x ATen's ``bmm`` on 35,712
    products of 8 x 8 blocks, one thread: ATen pays a BLAS call per product); anything else, a traced graph, or
    inputs that autograd must follow, take ``torch.bmm``."""
    import torch

    kernels = None
    # taller products (more than 16 rows) already run well in BLAS
    # b's rows are read as 8-wide vectors: a transposed b (which would need a copy as large as the product) takes bmm
    if (b.shape[-1] == 8 and b.stride(-1) == 1 and a.shape[-2] <= 16 and a.device.type == "cpu"
            and a.dtype == b.dtype == torch.float32
            and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))
            and (out is None or (out.is_contiguous() and out.dtype == torch.float32))):
        kernels = indexed_term_kernels()
    if kernels is None:
        if out is None:
            return torch.bmm(a, b)
        return out.baddbmm_(a, b) if accumulate else torch.bmm(a, b, out=out)
    if out is None:
        out = a.new_empty(a.shape[0], a.shape[1], 8)
        accumulate = False
    kernels.small_bmm(a, b, out, accumulate)
    return out

