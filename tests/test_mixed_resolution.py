"""Mixed-resolution (NaFlex-style) batches in the image ViT.

The property: a padded batch of images with different grids gives, per sample, what the model gives on that
image alone at its own size (every 2D encoding: token tables resampled per grid, rotary tables per grid, bias
maps per grid, PEG on the sample's own lattice), and gradients likewise. The oracle for the input format and
the learned table's resampling is timm's own NaFlexViT.
"""
from __future__ import annotations

import pytest
import timm
import torch
from timm.models.naflexvit import NaFlexVit, NaFlexVitCfg, batch_patchify

import vispe
from vispe.encodings import get_encoding_class
from vispe.models.naflex import grids_from_patch_coord, patchify_images, unpatchify

ENC_2D = [n for n in vispe.list_encodings() if 2 in get_encoding_class(n).grid_ndims]
PATCH = 4
SIZES = [(16, 16), (12, 20), (24, 8)]  # grids (4, 4) -- the training grid --, (3, 5), (6, 2)


def _model(name: str, **kw) -> torch.nn.Module:
    args = dict(pos_encoding=name, img_size=16, patch_size=PATCH, embed_dim=64, depth=2, num_heads=4, num_classes=5,
                dynamic_img_size=True)
    args.update(kw)
    return timm.create_model("vispe_vit_tiny_patch4_32", **args)


def _images(seed: int = 0, sizes=SIZES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, h, w, generator=g) for h, w in sizes]


def test_patchify_round_trip_and_timm_layout():
    imgs = _images()
    batch = patchify_images(imgs, PATCH)
    assert batch["patches"].shape == (3, 16, PATCH * PATCH * 3)  # the largest grid, 4x4
    assert grids_from_patch_coord(batch["patch_coord"], batch["patch_valid"]) == [(4, 4), (3, 5), (6, 2)]
    assert batch["patch_valid"].sum(1).tolist() == [16, 15, 12]
    for img, (h, w), b in zip(imgs, [(4, 4), (3, 5), (6, 2)], range(3)):
        # timm's batch_patchify (channels_last=True, NaFlex's default) lays the patches out as we do
        ref, grid = batch_patchify(img[None], (PATCH, PATCH))
        assert grid == (h, w)
        torch.testing.assert_close(batch["patches"][b, : h * w], ref[0], rtol=0, atol=0)
        torch.testing.assert_close(unpatchify(batch["patches"][b : b + 1, : h * w], (h, w), (PATCH, PATCH), 3), img[None])
    assert not batch["patches"][2, 12:].any() and batch["patches"][2, :12].abs().sum(-1).gt(0).all()  # padding rows are zeros


@pytest.mark.parametrize("name", ENC_2D)
def test_mixed_batch_equals_each_image_alone(name):
    torch.manual_seed(0)
    model = _model(name).eval()
    imgs = _images()
    batch = patchify_images(imgs, PATCH)
    weights = torch.randn(3, 5)
    mixed = model(batch)
    alone = torch.cat([model(img[None]) for img in imgs])
    assert mixed.shape == (3, 5)
    torch.testing.assert_close(mixed, alone, atol=1e-5, rtol=0)
    assert (alone[0] - alone[1]).abs().max() > 1e-4  # the samples differ: not a constant output
    # a list of images is the same batch
    torch.testing.assert_close(model(imgs), mixed, atol=1e-6, rtol=0)
    # timm NaFlexViT's split: forward_features gives {'patches', 'patch_valid'}, forward_head pools the valid rows
    feats = model.forward_features(batch)
    assert feats["patches"].shape[:2] == (3, model.num_prefix_tokens + 16) and feats["patch_valid"].sum(1).tolist() == [16, 15, 12]
    torch.testing.assert_close(model.forward_head(feats["patches"], patch_valid=feats["patch_valid"]), mixed, atol=0, rtol=0)
    # and the gradient of the batch is the sum of the per-image gradients (padding leaks nowhere in backward)
    params = [p for p in model.parameters() if p.requires_grad]
    g_mixed = torch.autograd.grad((model(batch) * weights).sum(), params, allow_unused=True)
    g_alone = torch.autograd.grad(sum((model(img[None]) * w).sum() for img, w in zip(imgs, weights)), params, allow_unused=True)
    for (pname, _), a, b in zip([(n, p) for n, p in model.named_parameters() if p.requires_grad], g_mixed, g_alone):
        assert (a is None) == (b is None), pname
        if a is not None:
            # float32 round-off scales with the gradient: 1e-5 of the tensor's largest entry
            scale = max(1.0, b.abs().max().item())
            assert (a - b).abs().max().item() <= 1e-5 * scale, f"{name}: gradient of {pname} differs by {(a - b).abs().max().item():.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("name", ENC_2D)
def test_mixed_batch_training_step_has_finite_gradients(name):
    torch.manual_seed(0)
    model = _model(name).train()
    batch = patchify_images(_images(1), PATCH)
    loss = torch.nn.functional.cross_entropy(model(batch), torch.tensor([0, 3, 4]))
    loss = loss + (model.auxiliary_loss() or 0.0)
    loss.backward()
    assert torch.isfinite(loss)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(torch.isfinite(g).all() for g in grads.values())
    missing = [n for n, p in model.pos_encoding.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"{name}: encoding parameters without a gradient: {missing}"
    assert all(n in grads for n, _ in model.blocks.named_parameters(prefix="blocks"))


@pytest.mark.parametrize("name", ["rope_mixed", "irpe", "cpe", "comrope_ld", "learned"])
def test_mixed_batch_with_gradient_checkpointing_and_patch_dropout(name):
    torch.manual_seed(0)
    model = _model(name).eval()
    imgs = _images(4)
    plain = model(imgs)
    model.set_grad_checkpointing(True)
    torch.testing.assert_close(model(imgs), plain, atol=1e-6, rtol=0)
    if not model.pos_encoding.supports_token_dropout or name == "cpe":
        return
    # patch dropout runs per grid group: each sample keeps half of its own lattice, and the step trains
    dropping = _model(name, patch_drop_rate=0.5).train()
    lengths = []
    original = dropping.embed_naflex

    def spy(*args):
        x, grouped = original(*args)
        lengths.append(grouped.lengths.tolist())
        return x, grouped

    dropping.embed_naflex = spy
    out = dropping(imgs)
    out.logsumexp(-1).sum().backward()
    assert lengths == [[1 + 8, 1 + 7, 1 + 6]]  # cls + half of 16, 15 (rounded down), 12 patches
    assert all(torch.isfinite(p.grad).all() for p in dropping.parameters() if p.grad is not None)


@pytest.mark.parametrize("pool,reg_tokens", [("avg", 0), ("max", 2), ("avgmax", 1), ("map", 0)])
def test_masked_pooling_leaves_padding_out(pool, reg_tokens):
    torch.manual_seed(0)
    model = _model("rope_mixed", global_pool=pool, reg_tokens=reg_tokens, class_token=pool != "map").eval()
    imgs = _images(2)
    torch.testing.assert_close(model(imgs), torch.cat([model(img[None]) for img in imgs]), atol=1e-5, rtol=0)


def test_bad_naflex_inputs_are_named():
    model = _model("learned").eval()
    batch = patchify_images(_images(), PATCH)
    with pytest.raises(ValueError, match="patch_coord"):
        model(batch["patches"], patch_valid=batch["patch_valid"])
    with pytest.raises(ValueError, match=r"\(B, N, P\*P\*C\)"):
        model(batch["patches"][..., :-1], patch_coord=batch["patch_coord"], patch_valid=batch["patch_valid"])
    shuffled = dict(batch, patch_coord=batch["patch_coord"].flip(1))
    with pytest.raises(ValueError, match="row-major"):
        model(shuffled)
    holes = dict(batch, patch_valid=batch["patch_valid"].clone())
    holes["patch_valid"][0, 3] = False
    with pytest.raises(ValueError, match="valid patches must come first"):
        model(holes)
    with pytest.raises(ValueError, match="not a multiple of the patch size"):
        patchify_images([torch.randn(3, 10, 8)], PATCH)
    with pytest.raises(ValueError, match="image 1 of the list is 17x16, not a multiple of the patch size 4x4"):
        model([torch.randn(3, 16, 16), torch.randn(3, 17, 16)])
    with pytest.raises(ValueError, match="C=3"):
        model([torch.randn(3, 16, 16), torch.randn(1, 8, 16)])
    with pytest.raises(ValueError, match="key-padding mask"):
        model(batch, attn_mask=torch.ones(1, 1, 19, 19, dtype=torch.bool))


def _timm_naflex_and_vispe(class_token: bool, pool: str):
    """A timm NaFlexViT with a learned (1, 4, 4, D) table and vispe's ``learned`` (no prefix rows, as NaFlex's
    table has none) carrying the same weights."""
    torch.manual_seed(0)
    cfg = NaFlexVitCfg(patch_size=PATCH, embed_dim=64, depth=2, num_heads=4, class_token=class_token, global_pool=pool,
                       pos_embed="learned", pos_embed_grid_size=(4, 4), fix_init=False)
    ref = NaFlexVit(cfg, img_size=16, in_chans=3, num_classes=5).eval()
    with torch.no_grad():
        ref.embeds.pos_embed.normal_(0, 1.0)  # a table far from zero, so its resampling matters
    ours = _model({"name": "learned", "embed_prefix": False}, class_token=class_token, global_pool=pool).eval()
    sd = {}
    for k, v in ref.state_dict().items():
        if k == "embeds.pos_embed":
            sd["pos_encoding.pos_embed"] = v.reshape(1, 16, -1)
        elif k == "embeds.proj.weight":  # NaFlex's linear over (ph, pw, C) patches == the conv over (C, ph, pw)
            sd["patch_embed.proj.weight"] = v.reshape(-1, PATCH, PATCH, 3).permute(0, 3, 1, 2)
        elif k.startswith("embeds."):
            sd[k.replace("embeds.", "patch_embed." if "proj" in k else "")] = v
        else:
            sd[k] = v
    missing, unexpected = ours.load_state_dict(sd, strict=True)
    assert not missing and not unexpected
    return ref, ours


@pytest.mark.parametrize("class_token,pool", [(True, "token"), (False, "avg")])
def test_agrees_with_timm_naflexvit_learned_table(class_token, pool):
    ref, ours = _timm_naflex_and_vispe(class_token, pool)
    batch = patchify_images(_images(3, SIZES + [(8, 28)]), PATCH)
    expected = ref(batch)
    got = ours(batch)
    assert expected.abs().max() > 0.1
    # same maths on different kernels (conv vs linear patch embedding, masked vs sliced attention): float32 round-off
    # (measured: bit-equal on CPU float32)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)
    # the check sees the resampling: another resampler disagrees on the grids that are not the table's own 4x4
    ours.pos_encoding.interpolation = "bilinear"
    ours.pos_encoding.clear_cache()
    off = (ours(batch) - expected).abs().amax(-1)
    assert off[0] < 1e-5 and bool((off[1:] > 1e-3).all())


# -- training with sampled resolutions ----------------------------------------------------------
def _synthetic(**kw):
    from vispe.data import SyntheticDataModule

    return SyntheticDataModule(num_classes=4, image_size=16, train_size=64, val_size=32, batch_size=16, **kw)


def test_datamodule_samples_one_resolution_per_batch():
    dm = _synthetic(resolutions=[16, [12, 20], [20, 12]], resolution_sampling="batch")
    x = torch.randn(16, 3, 16, 16)
    seen = {tuple(dm.sample_resolutions(x, torch.Generator().manual_seed(s)).shape[-2:]) for s in range(20)}
    assert seen == {(16, 16), (12, 20), (20, 12)}


def test_datamodule_samples_per_sample_into_a_list_of_images():
    """The data module only batches: a per-sample draw is a list of images at their drawn sizes; the model lays
    them out as NaFlex patches (and gives what a padded-patch batch of the same images gives)."""
    dm = _synthetic(resolutions=[[16, 16], [12, 20], [20, 12]], resolution_sampling="sample")
    x = torch.randn(16, 3, 16, 16)
    batch = dm.sample_resolutions(x, torch.Generator().manual_seed(0))
    assert isinstance(batch, list) and len(batch) == 16
    assert {tuple(img.shape[-2:]) for img in batch} == {(16, 16), (12, 20), (20, 12)}
    # each sample is its own image resized to its drawn size (bicubic, antialiased)
    from vispe.data.image_datamodule import resize_images

    for b in (0, 7, 15):
        torch.testing.assert_close(batch[b][None], resize_images(x[b : b + 1], tuple(batch[b].shape[-2:])))
    # the same draw from the same generator: reproducible from the seed
    again = dm.sample_resolutions(x, torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(again, batch))
    model = _model("rope_mixed").eval()
    torch.testing.assert_close(model(batch[:4]), model(patchify_images(batch[:4], PATCH)), atol=0, rtol=0)


@pytest.mark.parametrize("kw,message", [
    (dict(resolutions=[[16, 16], [12, 0]]), r"entry \[12, 0\] is not a size"),
    (dict(resolutions="16"), "non-empty list"),
    (dict(resolutions=[16, 18], patch_size=4), r"\[18, 18\] is not a multiple of patch_size=4"),
    (dict(resolutions=[16], resolution_sampling="pixel"), r"resolution_sampling='pixel' is not valid; choose one of \['batch', 'sample'\]"),
    (dict(resolutions=[16], patch_size=0), "patch_size must be a positive int"),
])
def test_bad_resolution_options_fail_at_construction(kw, message):
    with pytest.raises(ValueError, match=message):
        _synthetic(**kw)


def test_datamodule_takes_the_models_patch_size():
    dm = _synthetic(resolutions=[[16, 16], [12, 20]], resolution_sampling="sample")
    dm.use_model_patch_size(4, "model 'm'")
    assert dm.patch_size == 4
    with pytest.raises(ValueError, match=r"\[12, 20\] is not a multiple of patch_size=8 .*the patch size of model 'm'"):
        _synthetic(resolutions=[[16, 16], [12, 20]]).use_model_patch_size(8, "model 'm'")
    with pytest.raises(ValueError, match="data patch_size=7 differs from model 'm''s patch size 4; leave the data module's patch_size out"):
        _synthetic(resolutions=[28], patch_size=7).use_model_patch_size(4, "model 'm'")


@pytest.mark.slow
def test_fit_three_steps_with_per_sample_resolutions(tmp_path, monkeypatch):
    """`vispe fit` on the synthetic set with `--data.init_args.resolutions ... --resolution_sampling sample`: the
    training batches reach the model as mixed-resolution patches and the run trains."""
    import csv

    from vispe.models.vispe_vit import VispeVisionTransformer
    from vispe.train_cli import main

    grids_seen: list[list[tuple[int, int]]] = []
    original = VispeVisionTransformer.forward_features_naflex

    def spy(self, patches, patch_coord=None, patch_valid=None):
        assert isinstance(patches, list)  # the data module batches images; the model lays out the patches
        grids_seen.append([(img.shape[-2] // PATCH, img.shape[-1] // PATCH) for img in patches])
        return original(self, patches, patch_coord, patch_valid)

    monkeypatch.setattr(VispeVisionTransformer, "forward_features_naflex", spy)
    main(["fit", "--recipe", "smoke", "--trainer.max_steps", "3", "--trainer.max_epochs", "1",
          "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.enable_progress_bar", "false",
          "--trainer.enable_checkpointing", "false", "--model.init_args.pos_encoding", "cpe",
          "--data.init_args.resolutions", "[[16,16],[12,20],[20,12]]", "--data.init_args.resolution_sampling", "sample"])
    # the data module was given no patch_size: the task handed it the model's (4)
    assert len(grids_seen) == 3 and all(len(set(g)) > 1 for g in grids_seen)  # three steps, each a mixed batch
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    losses = [float(r["train/loss_step"]) for r in rows if r.get("train/loss_step")]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize("timm_name,pe", [("vit_small_patch16_rope_mixed_224", "rope_mixed"), ("vit_small_patch16_rope_224", "rope_axial")])
def test_agrees_with_timm_naflexvit_rope(timm_name, pe):
    """timm builds a NaFlexViT from its RoPE ViTs (``use_naflex=True``, per-sample rotary tables); the same EVA
    weights loaded into vispe (``load_timm_checkpoint``) give the same logits on a padded batch of three grids."""
    from timm.models.naflexvit import checkpoint_filter_fn

    from vispe.models import load_timm_checkpoint

    small = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=5)
    torch.manual_seed(0)
    eva = timm.create_model(timm_name, dynamic_img_size=True, **small).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # timm's layer scale starts at 1e-5: give the blocks (and so the positions) a real say
        for n, p in eva.named_parameters():
            if n.endswith(("gamma_1", "gamma_2", "ls1.gamma", "ls2.gamma")):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
        eva.head.weight.copy_(torch.randn(eva.head.weight.shape, generator=g) / 8)  # O(1) logits: 1e-5 is a real bound
    ref = timm.create_model(timm_name, use_naflex=True, **small).eval()
    ref.load_state_dict(checkpoint_filter_fn(eva.state_dict(), ref), strict=True)
    ours = timm.create_model("vispe_vit_small_patch16_224", pos_encoding=pe, **small).eval()
    report = load_timm_checkpoint(ours, eva.state_dict())
    assert not report.new and not report.dropped, str(report)
    batch = patchify_images(_images(5, [(32, 32), (24, 40), (48, 16)]), 8)
    with torch.no_grad():
        expected = ref(batch)
        got = ours(batch)
        no_pe = timm.create_model("vispe_vit_small_patch16_224", pos_encoding="none", **small).eval()
        load_timm_checkpoint(no_pe, eva.state_dict())
        without_rope = no_pe(batch)
    assert expected.abs().max() > 0.5 and (expected[1:] - expected[0]).abs().max() > 1e-2  # samples differ
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert (without_rope - expected).abs().max() > 1e-3  # the rotary tables matter here: 100x the tolerance
