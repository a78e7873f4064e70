"""Video-text data: generated captions vs generated motion, decord read-back, bad files, manifests, real clips."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from vispe.data.video_text import (
    BACKGROUND,
    COLORS,
    Event,
    SyntheticVideoTextDataModule,
    SyntheticVideoTextSpec,
    VideoReadError,
    VideoTextDataset,
    caption_for,
    collate_video_text,
    generate_video_text_set,
    load_manifest,
    position_free_r1,
    read_video,
    render_events,
    write_video,
)

SHARED_CLIPS = Path(os.environ.get("VISPE_ACTION_CLIPS", Path(__file__).resolve().parents[2] / "shared" / "data" / "action-clips"))

# an independent reading of the caption grammar (not the generator's code)
CELLS_2 = {"top left": (0, 0), "top right": (0, 1), "bottom left": (1, 0), "bottom right": (1, 1)}
EVENT_RE = re.compile(r"^a (\w+) (\w+) (?:appears in the (.+)|moves from the (.+) to the (.+))$")


def parse_caption(caption: str) -> list[tuple[str, tuple[int, int], tuple[int, int]]]:
    out = []
    for part in caption.split(", then "):
        m = EVENT_RE.match(part)
        assert m, part
        color, _shape, at, src, dst = m.groups()
        a = CELLS_2[at or src]
        out.append((color, a, CELLS_2[dst] if dst else a))
    return out


def detect(frame: np.ndarray) -> tuple[str, tuple[float, float]] | None:
    """Colour name and centroid (y, x) in [0, 1) of the one object in a decoded frame, or None."""
    diff = np.abs(frame.astype(np.float32) - np.array(BACKGROUND, dtype=np.float32)).sum(-1)
    mask = diff > 120
    if mask.sum() < 4:
        return None
    mean = frame[mask].astype(np.float32).mean(0)
    color = min(COLORS, key=lambda c: np.abs(mean - np.array(COLORS[c])).sum())
    ys, xs = np.nonzero(mask)
    return color, (ys.mean() / frame.shape[0], xs.mean() / frame.shape[1])


@pytest.fixture(scope="module")
def small_set(tmp_path_factory) -> Path:
    spec = SyntheticVideoTextSpec(num_videos=6, num_frames=8, fps=8, size=(32, 32), num_events=2, seed=3)
    return generate_video_text_set(tmp_path_factory.mktemp("vt"), spec)


def test_captions_agree_with_decoded_motion(small_set: Path) -> None:
    """Decode every clip, find the object per frame and check colour, cell and direction against the caption."""
    records = json.loads(small_set.read_text())
    kinds = set()
    for rec in records:
        events = parse_caption(rec["caption"])
        frames = read_video(small_set.parent / rec["video"]).numpy()
        T = frames.shape[0]
        seg = T // len(events)
        for k, (color, a, b) in enumerate(events):
            kinds.add("moves" if a != b else "appears")
            for t in range(k * seg, (k + 1) * seg):
                found = detect(frames[t])
                assert found is not None, (rec["video"], t)
                got_color, (cy, cx) = found
                want = a if t - k * seg < seg // 2 else b
                assert got_color == color, (rec["caption"], t, got_color)
                assert (int(cy * 2), int(cx * 2)) == want, (rec["caption"], t, (cy, cx))
            if a != b:  # direction of motion: the centroid moves towards the destination cell
                start = detect(frames[k * seg])[1]
                end = detect(frames[(k + 1) * seg - 1])[1]
                dy, dx = end[0] - start[0], end[1] - start[1]
                assert np.sign(round(dy, 2)) == np.sign(b[0] - a[0]) and np.sign(round(dx, 2)) == np.sign(b[1] - a[1])
    assert kinds == {"moves", "appears"}


def test_position_free_view_cannot_tell_captions_apart() -> None:
    """Two captions that differ only in where/when have the same multiset of 2x8x8 tubelets:
    a model without position sees identical inputs."""
    a = [Event("red", "square", "appears", (0, 0), (0, 0)), Event("blue", "circle", "moves", (1, 0), (1, 1))]
    b = [Event("blue", "circle", "moves", (0, 1), (0, 0)), Event("red", "square", "appears", (1, 1), (1, 1))]
    assert caption_for(a, 2) != caption_for(b, 2)

    def tubelets(frames: np.ndarray) -> list[bytes]:
        T, H, W, _ = frames.shape
        x = frames.reshape(T // 2, 2, H // 8, 8, W // 8, 8, 3).transpose(0, 2, 4, 1, 3, 5, 6).reshape(-1, 2 * 8 * 8 * 3)
        return sorted(row.tobytes() for row in x)

    fa, fb = render_events(a, 8, (32, 32), 2), render_events(b, 8, (32, 32), 2)
    assert not np.array_equal(fa, fb)
    assert tubelets(fa) == tubelets(fb)


def test_deterministic_by_seed(tmp_path: Path) -> None:
    spec = dict(num_videos=4, num_frames=4, size=(16, 16), kinds=("appears",))
    m1 = generate_video_text_set(tmp_path / "a", SyntheticVideoTextSpec(seed=7, **spec))
    m2 = generate_video_text_set(tmp_path / "b", SyntheticVideoTextSpec(seed=7, **spec))
    m3 = generate_video_text_set(tmp_path / "c", SyntheticVideoTextSpec(seed=8, **spec))
    caps = lambda m: [r["caption"] for r in json.loads(m.read_text())]  # noqa: E731
    assert caps(m1) == caps(m2) != caps(m3)
    assert torch.equal(read_video(m1.parent / "clip_00001.mp4"), read_video(m2.parent / "clip_00001.mp4"))


@pytest.mark.parametrize("codec,mean_bound,psnr_bound", [("libx264", 1.5, 32.0), ("mpeg4", 5.0, 25.0)])
def test_decord_reads_back_the_frames_written(tmp_path: Path, codec: str, mean_bound: float, psnr_bound: float) -> None:
    events = [Event("green", "square", "moves", (0, 0), (0, 1)), Event("yellow", "circle", "appears", (1, 1), (1, 1))]
    frames = render_events(events, 12, (48, 64), 2)
    for t in range(12):
        frames[t, :8, :8] = 10 + 20 * t  # a grey block that differs in every frame
    path = write_video(tmp_path / "clip.mp4", frames, fps=6, codec=codec)
    back = read_video(path)
    assert back.shape == frames.shape and back.dtype == torch.uint8  # exact frame count and size
    err = (back.float() - torch.from_numpy(frames).float()).abs()
    assert err.mean().item() < mean_bound
    assert 10 * np.log10(255.0**2 / (err**2).mean().item()) > psnr_bound
    # each frame matches its own source frame best (no dropped / duplicated / shifted frames)
    d = ((back.float()[:, None] - torch.from_numpy(frames).float()[None]) ** 2).mean((2, 3, 4))
    assert torch.equal(d.argmin(1), torch.arange(12))
    # index sampling returns exactly the frames of a full decode (repeats and any order allowed)
    sub = read_video(path, indices=[5, 5, 3, 11, 0])
    assert torch.equal(sub, back[[5, 5, 3, 11, 0]])
    with pytest.raises(VideoReadError, match="clip.mp4"):
        read_video(path, indices=[12])


def test_libx264_needs_even_sizes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="even"):
        write_video(tmp_path / "odd.mp4", np.zeros((2, 33, 32, 3), np.uint8))
    with pytest.raises(ValueError, match="even"):
        SyntheticVideoTextSpec(size=(30, 31))
    with pytest.raises(ValueError, match="purple"):
        SyntheticVideoTextSpec(colors=("red", "purple"))
    write_video(tmp_path / "odd_ok.mp4", np.zeros((2, 33, 32, 3), np.uint8), codec="mpeg4")  # mpeg4 takes odd sizes


def _bad_manifest(tmp_path: Path, small_set: Path) -> Path:
    good = [small_set.parent / r["video"] for r in json.loads(small_set.read_text())[:2]]
    corrupt = tmp_path / "corrupt.mp4"
    corrupt.write_bytes(b"\x00\x00\x00\x18ftypmp42" + os.urandom(2000))
    truncated = tmp_path / "truncated.mp4"
    truncated.write_bytes(good[0].read_bytes()[:300])
    rows = [
        {"video": str(good[0]), "caption": "good one"},
        {"video": str(tmp_path / "missing.mp4"), "caption": "missing"},
        {"video": str(corrupt), "caption": "corrupt"},
        {"video": str(good[1]), "caption": "good two"},
        {"video": str(truncated), "caption": "truncated"},
    ]
    m = tmp_path / "manifest.json"
    m.write_text(json.dumps(rows))
    return m


def test_bad_files_raise_naming_the_file(tmp_path: Path, small_set: Path) -> None:
    ds = VideoTextDataset(_bad_manifest(tmp_path, small_set), num_frames=4, size=32, on_error="raise")
    assert ds[0]["video"].shape == (3, 4, 32, 32)
    for i, name in [(1, "missing.mp4"), (2, "corrupt.mp4"), (4, "truncated.mp4")]:
        with pytest.raises(VideoReadError, match=re.escape(name)):
            ds[i]
    with pytest.raises(ValueError, match="on_error"):
        VideoTextDataset(_bad_manifest(tmp_path, small_set), on_error="ignore")


def test_bad_files_skipped_and_counted_rest_of_batch_kept(tmp_path: Path, small_set: Path) -> None:
    ds = VideoTextDataset(_bad_manifest(tmp_path, small_set), num_frames=4, size=32, on_error="skip")
    batch = next(iter(DataLoader(ds, batch_size=5, collate_fn=collate_video_text)))
    assert batch["video"].shape == (2, 3, 4, 32, 32)
    assert batch["captions"] == ["good one", "good two"]
    assert batch["index"].tolist() == [0, 3]
    assert batch["num_skipped"] == 3
    assert sorted(Path(p).name for p in batch["skipped"]) == ["corrupt.mp4", "missing.mp4", "truncated.mp4"]


def test_manifest_forms(tmp_path: Path) -> None:
    (tmp_path / "v1.mp4").touch()
    (tmp_path / "video7.mp4").touch()
    (tmp_path / "a.csv").write_text("video,caption\nv1.mp4,first\nv1.mp4,second\nsub/v2.avi,third\n")
    recs = load_manifest(tmp_path / "a.csv")
    assert [(Path(r.video).name, r.captions) for r in recs] == [("v1.mp4", ["first", "second"]), ("v2.avi", ["third"])]
    assert Path(recs[1].video) == tmp_path / "sub" / "v2.avi"
    (tmp_path / "b.json").write_text(json.dumps({"videos": [{"video_id": "video7"}], "sentences": [
        {"video_id": "video7", "caption": "x"}, {"video_id": "video7", "caption": "y"}]}))
    recs = load_manifest(tmp_path / "b.json")  # MSR-VTT: ids without suffix are resolved to files
    assert [(Path(r.video).name, r.captions) for r in recs] == [("video7.mp4", ["x", "y"])]
    (tmp_path / "c.json").write_text(json.dumps({"v1.mp4": {"label": "l", "captions": ["p", "q"]}}))
    assert load_manifest(tmp_path / "c.json")[0].captions == ["p", "q"]
    (tmp_path / "d.json").write_text(json.dumps([{"clip": "v1.mp4", "text": "z"}]))
    assert load_manifest(tmp_path / "d.json")[0].captions == ["z"]
    (tmp_path / "e.json").write_text(json.dumps([{"clip": "v1.mp4", "label": "z"}]))
    with pytest.raises(ValueError, match="caption key"):
        load_manifest(tmp_path / "e.json")
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_manifest(tmp_path / "nope.json")


def test_synthetic_datamodule_views(tmp_path: Path) -> None:
    dm = SyntheticVideoTextDataModule(
        root=str(tmp_path), num_train=8, num_val=6, num_frames=4, size=16, eval_settings=[(8, 32)], batch_size=4,
        kinds=("appears",),
    )
    dm.prepare_data()
    dm.setup("fit")
    assert dm.views == [(4, (16, 16)), (8, (32, 32))]
    b = next(iter(dm.train_dataloader()))
    assert b["video"].shape == (4, 3, 4, 16, 16) and len(b["captions"]) == 4
    low, high = dm.val_dataloader()
    bl, bh = next(iter(low)), next(iter(high))
    assert bl["video"].shape[2:] == (4, 16, 16) and bh["video"].shape[2:] == (8, 32, 32)
    assert bl["captions"] == bh["captions"]  # the same clips, two views
    assert dm.chance_r1 == pytest.approx(100 / 6)


def test_real_clips_mp4_avi_mkv() -> None:
    manifest = SHARED_CLIPS / "captions.json"
    if not manifest.is_file():
        pytest.skip("the shared action clips are not available")
    ds = VideoTextDataset(manifest, num_frames=8, size=32, caption_mode="all")
    assert {Path(r.video).suffix for r in ds.records} >= {".mp4", ".avi", ".mkv"}
    batch = collate_video_text([ds[i] for i in range(len(ds))])
    assert batch["video"].shape == (len(ds), 3, 8, 32, 32)
    assert batch["num_skipped"] == 0
    assert len(batch["captions"]) == sum(len(r.captions) for r in ds.records) > len(ds)
    assert batch["caption_video"].tolist() == [i for i, r in enumerate(ds.records) for _ in r.captions]
    assert (batch["video"].flatten(2).std(-1) > 0.05).all()  # real pictures, not blank frames
    frames = read_video(ds.records[0].video)
    assert frames.shape[0] > 100 and frames.shape[-1] == 3  # whole clip decoded (frame counts in the README)


def test_position_free_ceiling_worked_example() -> None:
    ev = lambda *objs: {"events": [{"color": c, "shape": s} for c, s in objs]}  # noqa: E731
    recs = [ev(("red", "square"), ("blue", "circle")), ev(("blue", "circle"), ("red", "square")), ev(("red", "circle"), ("blue", "circle"))]
    # the first two are the same objects in another order/place: indistinguishable without position
    assert position_free_r1(recs) == pytest.approx(100 * (0.5 + 0.5 + 1) / 3)
