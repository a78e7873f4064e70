"""SeqPE: digit sequences, the embedding as a function of the digit sequence only, unseen positions, both
regularisers learning, the generic auxiliary-loss hook through models and tasks, grids, policies, bad input."""
from __future__ import annotations

import pytest
import timm
import torch

import vispe
from vispe.encodings import EncodingContext, PositionGrid, create_encoding
from vispe.encodings.seqpe import position_digits

MODEL = "vispe_vit_tiny_patch4_32"
SMALL = dict(num_pivots=4, num_negatives=8, num_windows=4, num_distill=8)  # fast regulariser batches for the tests


def _seqpe(grid=(4, 4), dim=16, name="seqpe", **kw):
    return create_encoding(name, EncodingContext(dim, 2, 1, grid), **{**SMALL, **kw})


def test_registered_for_2d_and_3d():
    assert {"seqpe", "seqpe_3d"} <= set(vispe.list_encodings())
    assert "seqpe" in vispe.list_encodings(grid_ndim=2) and "seqpe_3d" in vispe.list_encodings(grid_ndim=3)


def test_digit_sequences_left_padded_per_axis():
    pos = torch.tensor([[7, 12], [1, 23], [12, 3], [0, 0]])
    assert position_digits(pos, 10, 2).tolist() == [[0, 7, 1, 2], [0, 1, 2, 3], [1, 2, 0, 3], [0, 0, 0, 0]]
    assert position_digits(torch.tensor([[5, 6]]), 2, 3).tolist() == [[1, 0, 1, 1, 1, 0]]
    enc = _seqpe()
    assert enc.num_digits == 2 and enc.base == 10 and enc.max_position == 100  # released: 10000 flattened -> 100 per axis


def test_embedding_depends_only_on_the_digit_sequence():
    torch.manual_seed(0)
    enc = _seqpe().eval()
    small = enc.table_for(PositionGrid((4, 4), 1), torch.device("cpu"))[0]  # (16, D)
    large = enc.table_for(PositionGrid((6, 9), 1), torch.device("cpu"))[0]  # (54, D)
    # position (r, c) gets the same vector in any grid and whatever else is encoded with it
    for r in range(4):
        for c in range(4):
            assert torch.allclose(small[r * 4 + c], large[r * 9 + c], atol=1e-6)
    alone = enc.embed_positions(torch.tensor([[2, 3]]))[0]
    assert torch.allclose(alone, small[2 * 4 + 3], atol=1e-6)
    # the same digit sequence -> the same vector, also from a different max_position with as many digits
    other = _seqpe(max_position=64)
    other.load_state_dict(enc.state_dict())
    other.eval()
    assert torch.allclose(other.embed_positions(torch.tensor([[2, 3]]))[0], alone, atol=1e-6)
    # different digit sequences -> different vectors (here: the same digits in another per-axis layout)
    a, b = enc.embed_positions(torch.tensor([[1, 23], [12, 3]]))
    assert (a - b).norm() > 0.01 * a.norm()  # (embeddings start small: out_proj is trunc-normal 0.02, as released)


def test_unseen_positions_up_to_4x_the_training_grid_are_finite():
    torch.manual_seed(0)
    model = timm.create_model(MODEL, pos_encoding={"name": "seqpe", **SMALL}, depth=1).eval()  # 8x8 training grid
    with torch.no_grad():
        out = model(torch.randn(2, 3, 128, 128))  # 32x32 patches: 4x per axis
        table = model.pos_encoding.table_for(PositionGrid((32, 32), 1), torch.device("cpu"))[0]
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    assert table.shape == (1024, 192) and torch.isfinite(table).all()
    nearest = torch.cdist(table, table).add(torch.eye(1024) * 1e3).min()
    assert nearest > 1e-3 * table.norm(dim=-1).mean()  # every unseen position has its own vector


@pytest.mark.parametrize("loss_name,scale,ratio", [("contrastive_loss", 10.0, 0.85), ("distill_loss", 300.0, 0.1)])
def test_each_regulariser_decreases_in_a_short_run(loss_name, scale, ratio):
    """Adam on the regulariser alone, four fixed sample batches revisited. The embeddings start near zero
    (out_proj trunc-normal 0.02, as released), where the distillation's Gram matrices are flat and its loss is
    ~1e-13 already; the output is first scaled to a trained encoding's magnitude (norms ~20 for x300)."""
    torch.manual_seed(0)
    enc = _seqpe(resid_drop=0.0, random_shift=0.0, num_pivots=8, num_negatives=16, num_windows=4, num_distill=16)
    with torch.no_grad():
        enc.encoder.out_proj.weight.mul_(scale)
    opt = torch.optim.Adam(enc.parameters(), lr=1e-2)
    losses = []
    for step in range(40):
        torch.manual_seed(step % 4)
        loss = getattr(enc, loss_name)()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert all(torch.isfinite(torch.tensor(losses)))
    assert first > 0.01 and last < ratio * first, (loss_name, first, last)
    # measured: contrastive 2.77 -> 2.25 (chance ln 16 = 2.77); distillation 0.18 -> 8e-6


def test_auxiliary_loss_is_the_weighted_sum_and_the_generic_hook_defaults_to_none():
    enc = _seqpe(contrastive_weight=0.1, distill_weight=0.3)
    torch.manual_seed(1)
    total = enc.auxiliary_loss()
    torch.manual_seed(1)
    parts = 0.1 * enc.contrastive_loss() + 0.3 * enc.distill_loss()
    assert torch.allclose(total, parts)
    assert _seqpe(contrastive_weight=0.0, distill_weight=0.0).auxiliary_loss() is None
    for name in ("none", "learned", "rope_axial"):  # every other encoding: no auxiliary loss
        m = timm.create_model(MODEL, pos_encoding=name, depth=1)
        assert m.auxiliary_loss() is None
    m = timm.create_model(MODEL, pos_encoding={"name": "seqpe", **SMALL}, depth=1)
    aux = m.auxiliary_loss()
    aux.backward()
    assert aux.ndim == 0 and m.pos_encoding.encoder.out_proj.weight.grad.abs().sum() > 0


class _Recorder:
    """The part of a LightningModule add_auxiliary_loss uses: ``log``."""

    def __init__(self) -> None:
        self.logged: dict[str, float] = {}

    def log(self, name, value, **kw) -> None:
        self.logged[name] = float(value)


def test_tasks_add_the_auxiliary_loss_with_their_weight():
    from vispe.tasks.auxiliary import add_auxiliary_loss

    model = timm.create_model(MODEL, pos_encoding={"name": "seqpe", **SMALL}, depth=1)
    base = torch.tensor(1.0)
    rec = _Recorder()
    torch.manual_seed(3)
    out = add_auxiliary_loss(rec, model, base, 2.0)
    torch.manual_seed(3)
    aux = model.auxiliary_loss()
    assert torch.allclose(out, base + 2.0 * aux) and rec.logged["train/aux_loss"] == pytest.approx(aux.item())
    rec = _Recorder()
    assert add_auxiliary_loss(rec, model, base, 0.0) is base and rec.logged == {}  # weight 0: not even computed
    plain = timm.create_model(MODEL, pos_encoding="rope_axial", depth=1)
    assert add_auxiliary_loss(rec, plain, base, 1.0) is base and rec.logged == {}


def test_three_cell_task_training_step_includes_the_auxiliary_loss(monkeypatch):
    from vispe.tasks import ThreeCellTask

    task = ThreeCellTask("vispe_vit_tiny_patch16_224", {"patch_size": 2, "embed_dim": 16, "depth": 1, "num_heads": 2},
                         pos_encoding={"name": "seqpe", **SMALL}, img_size=12, aux_loss_weight=0.5)
    logged = {}
    monkeypatch.setattr(task, "log", lambda name, value, **kw: logged.__setitem__(name, float(value.detach())))
    images, target = torch.randn(4, 3, 12, 12), torch.randint(0, 2, (4, 6)).float()
    torch.manual_seed(5)
    loss = task.training_step((images, target), 0)
    assert logged["train/aux_loss"] > 0 and loss.item() == pytest.approx(logged["train/loss"])
    with pytest.raises(ValueError, match="aux_loss_weight"):
        ThreeCellTask("vispe_vit_tiny_patch16_224", {"patch_size": 2, "embed_dim": 16, "depth": 1, "num_heads": 2},
                      pos_encoding="seqpe", img_size=12, aux_loss_weight=-1.0)


def test_classification_task_validates_the_weight():
    from vispe.tasks import ImageClassification

    with pytest.raises(ValueError, match="aux_loss_weight"):
        ImageClassification(MODEL, {"depth": 1}, pos_encoding="seqpe", aux_loss_weight=-0.1)


def test_extrapolation_policies_and_the_resolution_sweep():
    from vispe.benchmarks.resolution_sweep import extrapolation_modes

    assert set(extrapolation_modes("seqpe")) == {"extend", "interpolate"}
    torch.manual_seed(0)
    ext = _seqpe().eval()
    interp = _seqpe(extrapolation="interpolate").eval()
    interp.load_state_dict(ext.state_dict())
    g4, g8 = PositionGrid((4, 4), 1), PositionGrid((8, 8), 1)
    cpu = torch.device("cpu")
    assert torch.allclose(ext.table_for(g4, cpu), interp.table_for(g4, cpu))  # identical at the training grid
    # interpolate: the 4x4 table resampled (its corners stay near the trained corners); extend: new positions
    t8 = interp.table_for(g8, cpu)[0]
    assert t8.shape == (64, 16) and not torch.allclose(t8, ext.table_for(g8, cpu)[0])


def test_random_shift_moves_training_positions_only():
    torch.manual_seed(0)
    enc = _seqpe(random_shift=1.0, resid_drop=0.0)
    grid = PositionGrid((4, 4), 1)
    x = torch.zeros(1, 17, 16)
    enc.train()
    shifted = enc.embed_tokens(x, grid)
    enc.eval()
    fixed = enc.embed_tokens(x, grid)
    assert not torch.allclose(shifted[:, 1:], fixed[:, 1:])
    assert torch.allclose(fixed[0, 1:], enc.embed_positions(PositionGrid((4, 4)).indices().long()), atol=1e-6)
    assert torch.equal(shifted[:, 0], fixed[:, 0])  # the cls vector does not move


def test_timm_model_forward_backward_grids_bf16_and_no_weight_decay():
    model = timm.create_model(MODEL, pos_encoding={"name": "seqpe", **SMALL}, depth=1)
    for hw in [(32, 32), (48, 40)]:
        model.zero_grad()
        (model(torch.randn(2, 3, *hw)).sum() + model.auxiliary_loss()).backward()
        assert model.pos_encoding.encoder.digit_embed.weight.grad.abs().sum() > 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(2, 3, 32, 32))
    assert torch.isfinite(out.float()).all()
    pe = {n for n in model.no_weight_decay() if n.startswith("pos_encoding.")}
    assert pe == {f"pos_encoding.{n}" for n, _ in model.pos_encoding.named_parameters()}  # released: PE decay 0


def test_3d_on_a_video_vit():
    torch.manual_seed(0)
    model = timm.create_model("vispe_video_vit_nano_patch8_64", pos_encoding={"name": "seqpe_3d", **SMALL}, depth=1,
                              num_classes=3).eval()
    with torch.no_grad():
        out = model(torch.randn(1, 3, 8, 64, 64))
        longer = model(torch.randn(1, 3, 32, 64, 64))  # 4x the frames
    assert out.shape == longer.shape == (1, 3) and torch.isfinite(longer).all()
    model.train()
    assert model.auxiliary_loss().ndim == 0
    enc = model.pos_encoding
    assert position_digits(torch.tensor([[3, 4, 5]]), 10, enc.num_digits).tolist() == [[0, 3, 0, 4, 0, 5]]


@pytest.mark.parametrize("kw,match", [
    ({"extrapolation": "ntk"}, "extrapolation"),
    ({"base": 1}, "base"),
    ({"max_position": 6}, "max_position"),
    ({"random_shift": 1.5}, "random_shift"),
    ({"num_negatives": 0}, "num_negatives"),
    ({"contrastive_weight": -1.0}, "contrastive_weight"),
    ({"encoder_dim": 48, "encoder_heads": 5}, "encoder_heads"),
])
def test_bad_input(kw, match):
    with pytest.raises(ValueError, match=match):
        _seqpe(**kw)


def test_position_beyond_the_digits_is_a_clear_error():
    enc = _seqpe(max_position=10)  # one digit per axis: 0..9
    with pytest.raises(ValueError, match="max_position"):
        enc.table_for(PositionGrid((4, 12), 1), torch.device("cpu"))
