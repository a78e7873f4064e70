"""Conformance with transformers >= 5.24 as installed (the oracle): the vision position ids of the HF families vispe
integrates (``vispe.integrations.hf.MODEL_FAMILIES``) against vispe's builder (:func:`vispe.positions.build_positions`
with each family's native scheme).

* LLM side: each family's ``get_vision_position_ids(start, grid_thw, temp_merge, spatial_merge, time_interval)``
  (the per-block ids its ``get_rope_index`` concatenates) against the visual part of ``build_positions`` after
  ``start`` text tokens -- images, videos (the families that keep a video as one block), Qwen2.5-VL's absolute time.
* Tower side: ``transformers.vision_utils.get_vision_position_ids`` (the vision encoder's per-patch ``(t,) h, w`` ids,
  laid out block-major over ``m x m`` merge blocks): block ``k``'s patches are the ``m x m`` patches of the LLM token
  ``k`` that ``build_positions`` places, and in raster order they are the tower grid's indices.

Skipped as a whole when the installed transformers is older than 5.24 or lacks ``vision_utils``; a family whose
model class lacks ``get_vision_position_ids`` is skipped by name. Settings are listed in ``docs/conformance.md``.
"""
from __future__ import annotations

import importlib

import pytest
import torch
from packaging.version import Version

transformers = pytest.importorskip("transformers")
TRANSFORMERS_MIN = "5.24"
pytestmark = pytest.mark.skipif(Version(transformers.__version__) < Version(TRANSFORMERS_MIN),
                                reason=f"transformers {transformers.__version__} is older than {TRANSFORMERS_MIN}")

from vispe.encodings import PositionGrid  # noqa: E402
from vispe.integrations.hf import MODEL_FAMILIES  # noqa: E402
from vispe.positions import Text, Visual, build_positions  # noqa: E402

FAMILIES = {f.name: f for f in MODEL_FAMILIES}
#: (T, H, W) ViT grids and merge sizes
IMAGES = [((1, 4, 6), 2), ((1, 6, 4), 2), ((1, 3, 5), 1), ((1, 8, 8), 2)]
VIDEOS = [((3, 4, 6), 2), ((5, 2, 4), 2), ((2, 3, 3), 1)]
STARTS = [0, 1, 7]


def _hf_block_ids(name: str):
    """The family's ``get_vision_position_ids`` (a method that reads nothing of the model), or skip."""
    try:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    method = getattr(getattr(module, FAMILIES[name].classes[1]), "get_vision_position_ids", None)
    if method is None:
        pytest.skip(f"transformers {transformers.__version__}: {FAMILIES[name].classes[1]} has no get_vision_position_ids")
    return lambda *args: method(None, *args)


def _vispe_block(scheme: str, start: int, thw, m: int, **options) -> torch.Tensor:
    segments = ([Text(start)] if start else []) + [Visual(*thw)]
    pos, _ = build_positions(scheme, segments, spatial_merge_size=m, **options)
    return pos[:, start:]


@pytest.mark.parametrize("start", STARTS)
@pytest.mark.parametrize("thw,m", IMAGES)
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_image_block_ids_equal_the_family(name, thw, m, start):
    hf = _hf_block_ids(name)(start, torch.tensor(thw), 1, m, 1.0)
    mine = _vispe_block(FAMILIES[name].native_scheme, start, thw, m)
    assert mine.shape == hf.shape and torch.equal(mine.long(), hf)


@pytest.mark.parametrize("start", STARTS)
@pytest.mark.parametrize("thw,m", VIDEOS)
@pytest.mark.parametrize("name", sorted(n for n, f in FAMILIES.items() if not f.frames_as_blocks and not f.absolute_time))
def test_video_block_ids_equal_the_family(name, thw, m, start):
    """Families that keep a video as one block with frame-index time (Qwen2-VL): ``time_interval`` 1."""
    hf = _hf_block_ids(name)(start, torch.tensor(thw), 1, m, 1.0)
    assert torch.equal(_vispe_block(FAMILIES[name].native_scheme, start, thw, m).long(), hf)


#: (tokens_per_second, seconds_per_grid): Qwen2.5-VL's time_interval is their product (floored after the multiply)
ABSOLUTE_TIME = [(2.0, 1.0), (2.0, 0.5), (2.0, 4 / 3), (2.0, 0.7), (2.0, 2 / 3), (4.0, 0.75), (25.0, 0.08)]


@pytest.mark.parametrize("tps,spg", ABSOLUTE_TIME)
@pytest.mark.parametrize("start", STARTS)
@pytest.mark.parametrize("thw,m", VIDEOS + [((12, 2, 2), 1)])
def test_absolute_time_video_ids_equal_qwen2_5_vl(thw, m, start, tps, spg):
    assert FAMILIES["qwen2_5_vl"].absolute_time
    hf = _hf_block_ids("qwen2_5_vl")(start, torch.tensor(thw), 1, m, tps * spg)
    mine = _vispe_block("mrope", start, thw, m, seconds_per_grid=spg, tokens_per_second=tps)
    assert torch.equal(mine.long(), hf), (mine, hf)


@pytest.mark.parametrize("include_temporal", [False, True])
@pytest.mark.parametrize("thw,m", IMAGES + VIDEOS)
def test_tower_ids_are_the_merge_blocks_of_the_llm_tokens(thw, m, include_temporal):
    from transformers import vision_utils

    if not hasattr(vision_utils, "get_vision_position_ids"):
        pytest.skip(f"transformers {transformers.__version__} has no vision_utils.get_vision_position_ids")
    T, H, W = thw
    tower = vision_utils.get_vision_position_ids(torch.tensor([thw]), m, include_temporal=include_temporal)
    assert tower.shape == (T * H * W, 3 if include_temporal else 2)
    # block k of m*m patches <-> LLM token k of vispe's block (raster over (T, H/m, W/m)); h, w local to the block
    llm = _vispe_block("mrope", 0, thw, m)  # (3, T*H*W/m^2), no text before: (t, h, w) of each LLM token
    blocks = tower.reshape(-1, m * m, tower.shape[-1])
    hw = blocks[..., -2:]
    assert torch.equal(hw // m, llm[1:].T.long()[:, None, :].expand_as(hw))
    assert torch.equal(hw % m, torch.cartesian_prod(torch.arange(m), torch.arange(m)).expand_as(hw))
    if include_temporal:
        assert torch.equal(blocks[..., 0], llm[0].long()[:, None].expand(-1, m * m))
    # the same patches in raster order are the tower grid's indices (vispe's PositionGrid)
    raster = PositionGrid((T, H, W), 0).indices().long()
    order = torch.arange(T * H * W).reshape(T, H // m, m, W // m, m).permute(0, 1, 3, 2, 4).reshape(-1)
    assert torch.equal(tower, raster[order][:, (0 if include_temporal else 1):])
