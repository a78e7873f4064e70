"""V-NIAH on a tiny random Hugging Face Qwen2-VL or Qwen3-VL with any vispe position scheme (needs ``pip install "vispe[hf]"``).

An example of :func:`vispe.integrations.hf.apply_position_scheme` in a plain PyTorch fine-tuning loop (the library's
own training goes through ``vispe.runner`` and LightningCLI; this script shows the patched Hugging Face model in the
loop a Hugging Face user writes). Run it from a checkout:

    python examples/hf_niah.py --scheme vrope --steps 300 --eval-frames 8,32
    python examples/hf_niah.py --model qwen3_vl --scheme qwen3vl     # Qwen3-VL's own layout: timestamped (1, H, W) patches

The haystacks are ``vispe niah``'s (``vispe.data.niah``: procedural frames, one coloured needle frame
at a random depth, question "what color is the needle ?", one-token answer). Frames go through the HF
model's own vision tower as ``pixel_values_videos`` in the Qwen2-VL processor's patch order; the
whole model (vision tower, merger, LLM) is fine-tuned on the answer token, then scored on longer
haystacks at every depth. It shows the patched model trains, not only runs; it is no ranking.
With ``--model qwen3_vl`` the video is written as Qwen3-VL's processor writes it: per temporal patch
the ``<x.y seconds>`` text (one token per character class: ``<``, digits, ``.``, `` seconds>``),
``<|vision_start|>``, the patch's tokens, ``<|vision_end|>``.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.nn.functional as F

from vispe.data.niah import NIAHDataset, NIAHVocab
from vispe.integrations.hf import apply_position_scheme
from vispe.positions import qwen3vl_timestamps, timestamp_text

TPATCH, MERGE = 2, 2
NEEDLE = 4  # the needle's square (pixels), independent of the ViT patch


def video_pixels(frames: np.ndarray, patch: int) -> tuple[torch.Tensor, list[int]]:
    """uint8 ``(T, S, S, 3)`` -> Qwen2-VL ``pixel_values_videos`` rows and ``(t, h, w)`` grid (frames padded to even T)
    for a ViT patch of ``patch`` pixels."""
    x = torch.as_tensor(frames).float().div(127.5).sub(1.0).permute(0, 3, 1, 2)  # (T, C, S, S)
    if x.shape[0] % TPATCH:  # the processor repeats the last frame
        x = torch.cat([x, x[-1:].expand(TPATCH - x.shape[0] % TPATCH, -1, -1, -1)])
    T, C, H, W = x.shape
    gt, gh, gw = T // TPATCH, H // patch, W // patch
    x = x.reshape(gt, TPATCH, C, gh // MERGE, MERGE, patch, gw // MERGE, MERGE, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # merge windows contiguous, as the merger expects
    return x.reshape(gt * gh * gw, C * TPATCH * patch * patch), [gt, gh, gw]


def build_model(vocab_size: int, ids: dict[str, int], seed: int, family: str = "qwen2_vl", patch: int = 4):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    if family == "qwen3_vl":
        import transformers
        from packaging.version import Version
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

        # Qwen3-VL's interleaved M-RoPE, section 24:20:20 of 64 pairs scaled to 8 pairs
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2], "mrope_interleaved": True}
        rope_kw = {"rope_parameters": rope} if Version(transformers.__version__).major >= 5 else {"rope_scaling": rope, "rope_theta": 10000.0}
        cfg = Qwen3VLConfig(
            text_config={"vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 4, "head_dim": 16, "pad_token_id": 0, **rope_kw},
            vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64, "patch_size": patch,
                           "spatial_merge_size": MERGE, "temporal_patch_size": TPATCH, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]},
            **{k: v for k, v in ids.items() if not k.startswith("ts_")},
        )
        return Qwen3VLForConditionalGeneration(cfg)
    cfg = Qwen2VLConfig(
        text_config={"vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 4, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}, "rope_theta": 10000.0,
                         "pad_token_id": 0},
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "patch_size": patch, "spatial_merge_size": MERGE, "temporal_patch_size": TPATCH},
        **ids,
    )
    return Qwen2VLForConditionalGeneration(cfg)


def batch(ds: NIAHDataset, idx: list[int], vocab: NIAHVocab, ids: dict[str, int], with_answer: bool, patch: int):
    question = vocab.question_ids().tolist()
    rows, pix, grids, answers = [], [], [], []
    for i in idx:
        frames, meta = ds.frames(i)
        p, g = video_pixels(frames, patch)
        n = g[0] * g[1] * g[2] // MERGE**2
        ans = int(vocab.answer_ids[meta["answer"]])
        if "ts_<" in ids:  # Qwen3-VL: timestamp text and markers around every temporal patch
            per = n // g[0]
            video = []
            for sec in qwen3vl_timestamps(g[0], fps=2.0, temporal_patch_size=TPATCH):
                text = timestamp_text(sec)  # '<1.2 seconds>'
                video += [ids["ts_<"]] + [ids["ts_" + c] for c in text[1:text.index(" ")]] + [ids["ts_ seconds>"]]
                video += [ids["vision_start_token_id"]] + [ids["video_token_id"]] * per + [ids["vision_end_token_id"]]
        else:
            video = [ids["vision_start_token_id"]] + [ids["video_token_id"]] * n + [ids["vision_end_token_id"]]
        rows.append([vocab.bos_id] + video + question + ([ans] if with_answer else []))
        pix.append(p)
        grids.append(g)
        answers.append(ans)
    L = max(map(len, rows))
    input_ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for b, r in enumerate(rows):  # left padding: the answer (or the next token) is last in every row
        input_ids[b, L - len(r):] = torch.tensor(r)
        mask[b, L - len(r):] = 1
    kw = {"input_ids": input_ids, "attention_mask": mask, "pixel_values_videos": torch.cat(pix), "video_grid_thw": torch.tensor(grids)}
    return kw, torch.tensor(answers)


def forward_kwargs(model, kw):
    import inspect

    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        kw = dict(kw, mm_token_type_ids=2 * (kw["input_ids"] == model.config.video_token_id).long())
    return kw


def main(argv: list[str] | None = None) -> int:
    """Trains, evaluates and prints the result as one JSON line."""
    run(argv)
    return 0


def run(argv: list[str] | None = None) -> dict:
    """Fine-tune and score one scheme; returns the result that :func:`main` prints."""
    ap = argparse.ArgumentParser(prog="examples/hf_niah.py", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2_vl", choices=["qwen2_vl", "qwen3_vl"])
    ap.add_argument("--scheme", default="mrope")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--train-frames", type=int, default=8)
    ap.add_argument("--eval-frames", default="8,32")
    ap.add_argument("--eval-episodes", type=int, default=64)
    ap.add_argument("--frame-size", type=int, default=8)
    ap.add_argument("--patch", type=int, default=4, help="ViT patch size (frames must be a multiple of 2 x patch)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    # the ViT patch: with 8x8 frames, 4 gives one LLM token per temporal patch (a 1x1 block, where every
    # scheme's coordinates coincide); 2 gives 2x2 tokens, where the layouts differ
    torch.set_num_threads(1)
    vocab = NIAHVocab()
    base = len(vocab)
    ids = {"video_token_id": base, "image_token_id": base + 1, "vision_start_token_id": base + 2, "vision_end_token_id": base + 3}
    size = base + 4
    if args.model == "qwen3_vl":  # timestamp characters: '<', digits, '.', ' seconds>'
        for c in ["<", ".", " seconds>"] + [str(d) for d in range(10)]:
            ids["ts_" + c] = size
            size += 1
    model = build_model(size, ids, args.seed, args.model, args.patch)
    options = {"hope": {"gamma": 0.75}, "v2pe": {"delta": 0.25}}.get(args.scheme, {})
    apply_position_scheme(model, args.scheme, **options)
    train = NIAHDataset(args.steps * args.batch_size, args.train_frames, frame_size=args.frame_size, patch=NEEDLE, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    model.train()
    t0, log = time.time(), []
    for step in range(args.steps):
        kw, answers = batch(train, list(range(step * args.batch_size, (step + 1) * args.batch_size)), vocab, ids, with_answer=True, patch=args.patch)
        logits = model(**forward_kwargs(model, kw)).logits[:, -2]  # the token before the answer predicts it
        loss = F.cross_entropy(logits, answers)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == args.steps - 1:
            acc = (logits.argmax(-1) == answers).float().mean().item()
            log.append({"step": step, "loss": round(loss.item(), 4), "train_acc": round(acc, 3)})
            print(log[-1], flush=True)
    model.eval()
    result = {"model": args.model, "scheme": args.scheme, "patch": args.patch, "frame_size": args.frame_size, "steps": args.steps, "train_frames": args.train_frames, "train_seconds": round(time.time() - t0, 1), "log": log, "eval": {}}
    with torch.no_grad():
        for n in (int(x) for x in args.eval_frames.split(",")):
            ds = NIAHDataset(args.eval_episodes, n, depths=[0, 0.25, 0.5, 0.75, 1], frame_size=args.frame_size, patch=NEEDLE, seed=args.seed + 1000)
            ok = 0
            for s in range(0, args.eval_episodes, args.batch_size):
                idx = list(range(s, min(s + args.batch_size, args.eval_episodes)))
                kw, answers = batch(ds, idx, vocab, ids, with_answer=False, patch=args.patch)
                out = model.generate(**forward_kwargs(model, kw), max_new_tokens=1, do_sample=False)
                ok += int((out[:, -1] == answers).sum())
            result["eval"][n] = round(ok / args.eval_episodes, 3)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    import sys

    sys.exit(main())
