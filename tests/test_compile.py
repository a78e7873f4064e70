"""Whole-graph ``torch.compile`` for every registered encoding, in every host that takes it.

For each name in ``vispe.list_encodings()`` (so encodings added later are covered without editing this file):
the image ViT (2D encodings), the video ViT (3D encodings) and the video-LLM (multimodal schemes) compile with
``fullgraph=True`` -- a graph break raises -- in train mode (AOT autograd: forward and backward graphs, outputs and
every gradient equal to eager) and in eval mode; one new grid costs one recompilation, going back to the training
grid costs none, and the layers of one forward never recompile each other (one graph per forward, counted).
"""
from __future__ import annotations

import pytest
import timm
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import vispe
from vispe.encodings import get_encoding_class
from vispe.models.video_llm import VideoLLM
from vispe.positions import SCHEMES

ALL = vispe.list_encodings()
IMAGE = [n for n in ALL if 2 in get_encoding_class(n).grid_ndims]
VIDEO = [n for n in ALL if 3 in get_encoding_class(n).grid_ndims]
LLM = [n for n in ALL if n in SCHEMES]
TOL = dict(atol=1e-5, rtol=1e-4)
#: AOT autograd with its default partitioner: the forward and backward graphs inductor would get, split without the
#: min-cut search of ``aot_eager`` (networkx: a quarter of AOT autograd's time on these models). The custom-op test
#: below and tests/test_bias_paths_compiled.py keep ``aot_eager``: there the min-cut split of saved tensors is the point.
AOT = "aot_eager_default_partitioner"
#: Encodings whose training forward is random by default (SeqPE: random lattice shift, dropout in its digit encoder).
#: Compiled and eager draw their random numbers separately, so the value comparison of a train step uses the
#: encoding with those draws off; the default, random one is compiled whole on its own below.
STOCHASTIC_TRAINING = {"seqpe": "seqpe[random_shift=0.0,resid_drop=0.0]", "seqpe_3d": "seqpe_3d[random_shift=0.0,resid_drop=0.0]"}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_every_registered_encoding_has_a_compiled_host():
    assert set(IMAGE) | set(VIDEO) | set(LLM) == set(ALL)


def _image_model(name: str) -> torch.nn.Module:
    name = STOCHASTIC_TRAINING.get(name, name)
    torch.manual_seed(0)
    # 8 x 8 grid, 3 heads (multi-head schemes need >= 3), head_dim 16
    return timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding=name, embed_dim=48, depth=2, num_heads=3, num_classes=5)


def _video_model(name: str) -> torch.nn.Module:
    name = STOCHASTIC_TRAINING.get(name, name)
    torch.manual_seed(0)
    return timm.create_model(
        "vispe_video_vit_nano_patch8_64", pos_encoding=name, img_size=32, num_frames=4, embed_dim=48, depth=2, num_heads=3,
        num_classes=5,
    )


def _check_train_step(model: torch.nn.Module, inputs: tuple, loss_of, backend: str = AOT):
    """Compiled (fullgraph, AOT autograd) and eager train steps from the same weights: same loss, same gradients.
    Returns the compiled model and its counter (for :func:`_check_eval_and_new_grid`)."""
    model.train()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    want = loss_of(model(*inputs))
    want.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    got = loss_of(compiled(*inputs))
    got.backward()
    torch.testing.assert_close(got, want, **TOL)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == ref.keys()
    for n in ref:
        torch.testing.assert_close(grads[n], ref[n], **TOL, msg=lambda m, n=n: f"gradient of {n}: {m}")
    assert counter.frame_count == 1  # one graph for the whole forward: no layer recompiles another
    return compiled, counter


def _check_eval_and_new_grid(model: torch.nn.Module, trained, inputs: tuple, large: torch.Tensor) -> None:
    """After :func:`_check_train_step` on ``inputs``: eval at a new grid (``large``) compiles once, fullgraph, equal to
    eager, and a second call adds nothing; then the training grid in training mode is served by its first graph (the
    new grid's state, now cached, is outside its guards). ``dynamic=False``: grid sizes are Python ints to the
    encodings (position tables are constants of the grid), so each new grid is one static recompilation. One new
    trace per encoding, not two: tracing is most of these tests' time."""
    model.eval()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter, dynamic=False)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(compiled(large), model(large), **TOL)
    assert counter.frame_count == 1, f"{counter.frame_count} compilations for one grid"
    train_compiled, train_counter = trained
    model.train()
    train_compiled(*inputs)
    assert train_counter.frame_count == 1, f"{train_counter.frame_count} compilations: back on the training grid, it recompiled"


@pytest.mark.parametrize("name", sorted(STOCHASTIC_TRAINING))
@pytest.mark.slow
def test_random_training_draws_compile_whole(name):
    """The default (random) training forward compiles as one graph too; its values are random, so only finiteness
    and the graph count are checked here."""
    _check_random_training_forward_compiles_whole(name, name)


def _check_random_training_forward_compiles_whole(name: str, pos_encoding) -> None:
    """One training step of a small host of ``name`` (an image ViT, or the video ViT for 3D-only encodings) built
    with ``pos_encoding``, compiled with ``fullgraph``: one graph, finite outputs (the draws make values random)."""
    ndim = 3 if 3 in get_encoding_class(name).grid_ndims else 2
    torch.manual_seed(0)
    model = (timm.create_model("vispe_video_vit_nano_patch8_64", pos_encoding=pos_encoding, img_size=32, num_frames=4,
                               embed_dim=48, depth=2, num_heads=3, num_classes=5) if ndim == 3 else
             timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding=pos_encoding, embed_dim=48, depth=2, num_heads=3,
                               num_classes=5))
    x = torch.randn(2, 3, 4, 32, 32) if ndim == 3 else torch.randn(2, 3, 32, 32)
    counter = CompileCounterWithBackend(AOT)
    out = torch.compile(model.train(), fullgraph=True, backend=counter)(x)
    out.square().mean().backward()
    assert torch.isfinite(out).all() and counter.frame_count == 1


def _coordinate_moves(name: str) -> dict[str, float]:
    """Every training-time coordinate option ``name`` takes, set to move the coordinates (identity values draw too,
    so only moving ones show a draw that leaves the graph)."""
    value = {"shift": 0.5, "jitter": 1.2, "rescale": 1.2, "random_positions": 2.0}
    return {o: next(v for k, v in value.items() if k in o) for o in get_encoding_class(name).coordinate_options}


@pytest.mark.parametrize("name", sorted(n for n in ALL if get_encoding_class(n).coordinate_options))
@pytest.mark.slow
def test_coordinate_moves_compile_whole(name):
    """With every coordinate option moving the positions (one random draw per training forward), the training
    forward still compiles as one graph: the draws stay tensors inside it."""
    _check_random_training_forward_compiles_whole(name, {"name": name, **_coordinate_moves(name)})


@pytest.mark.parametrize("name", IMAGE)
@pytest.mark.slow
def test_image_vit_compiles_whole(name):
    model = _image_model(name)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    trained = _check_train_step(model, (x,), lambda y: y.square().mean())
    _check_eval_and_new_grid(model, trained, (x,), torch.randn(1, 3, 48, 40))


#: one per family (rotary, learned rotation, attention bias, token encoding): the models a
#: benchmark or a sweep compiles side by side in one process
SIDE_BY_SIDE = ["rope_axial", "comrope_ld", "irpe", "learned"]


@pytest.mark.slow
def test_models_compiled_side_by_side_keep_one_graph_each():
    """Every model of a class shares its forward's code objects with the others, so a graph break in one encoding's
    code can split or recompile the graphs of models compiled before or after it (torch 2.11, ComRoPE's coordinate
    property: every other model of the process then ran as two graphs). Compiled in turn (``fullgraph`` off, as a
    user compiles), each model is one graph after its first steps, and stepping them all again compiles nothing."""
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    runs = {}
    for name in SIDE_BY_SIDE:
        counter = CompileCounterWithBackend("eager")
        model = _image_model(name).train()
        runs[name] = (torch.compile(model, backend=counter), counter)
        for _ in range(2):  # the second call may take a cached-table path
            runs[name][0](x).square().mean().backward()
    graphs = {name: counter.frame_count for name, (_, counter) in runs.items()}
    assert graphs == dict.fromkeys(SIDE_BY_SIDE, 1), graphs
    for name, (compiled, _) in runs.items():
        compiled(x).square().mean().backward()
    assert {name: counter.frame_count for name, (_, counter) in runs.items()} == graphs


@pytest.mark.parametrize("name", ["alibi_2d", "fire", "irpe"])
@pytest.mark.slow
def test_blocked_bias_training_compiles_whole_as_the_custom_op(name, monkeypatch):
    """On the blocked path (here forced to 16-row blocks; at 577+ tokens 'auto' picks it) a compiled CPU training step
    runs each layer's attention as ``vispe::indexed_bias_attention`` and its backward op, one graph, equal to eager."""
    from vispe.encodings import attention

    calls = []
    spec_of = attention._spec_of
    monkeypatch.setattr(attention, "_spec_of", lambda *a: calls.append(1) or spec_of(*a))  # only the custom ops call it
    model = _image_model(name)
    model.pos_encoding.set_attention_backend("blocked", block_rows=16)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    _check_train_step(model, (x,), lambda y: y.square().mean(), backend="aot_eager")
    assert len(calls) == 2 * 2  # depth 2: one forward and one backward op per layer


@pytest.mark.parametrize("name", VIDEO)
@pytest.mark.slow
def test_video_vit_compiles_whole(name):
    model = _video_model(name)
    x = torch.randn(2, 3, 4, 32, 32, generator=torch.Generator().manual_seed(1))
    trained = _check_train_step(model, (x,), lambda y: y.square().mean())
    _check_eval_and_new_grid(model, trained, (x,), torch.randn(1, 3, 6, 24, 32))


@pytest.mark.parametrize("name", LLM)
@pytest.mark.slow
def test_video_llm_compiles_whole(name):
    torch.manual_seed(0)
    model = VideoLLM(vocab_size=40, dim=48, depth=2, num_heads=3, pos_scheme=name, visual_dim=24, spatial_merge_size=2)
    gen = torch.Generator().manual_seed(1)
    feats = torch.randn(2, 4, 4, 24, generator=gen)
    text = torch.randint(0, 40, (6,), generator=gen)
    batch = model.pack([[text[:3], feats, text[3:]], [text[:2], feats[:1]]])  # left padding, two layouts
    labels = torch.randint(0, 40, batch.inputs_embeds.shape[:2], generator=gen)

    def step(emb, pos, mask):
        return model(inputs_embeds=emb, position_ids=pos, attention_mask=mask, labels=labels)

    inputs = (batch.inputs_embeds.detach(), batch.position_ids, batch.attention_mask)
    model.train()
    counter = CompileCounterWithBackend(AOT)
    want = step(*inputs).loss
    want.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    got = torch.compile(step, fullgraph=True, backend=counter)(*inputs).loss
    got.backward()
    torch.testing.assert_close(got, want, **TOL)
    for n, g in ref.items():
        torch.testing.assert_close(dict(model.named_parameters())[n].grad, g, **TOL)
    assert counter.frame_count == 1
