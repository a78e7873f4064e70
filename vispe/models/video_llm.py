"""A small decoder-only video-LLM backbone with multimodal rotary position ids of any vispe scheme.

``VideoLLM(vocab_size, dim, depth, num_heads, pos_scheme='mrope', position_kwargs=None,
visual_dim=None, vision_encoder=None, spatial_merge_size=1, ...)``

* Text tokens: ``nn.Embedding``; output head tied to it by default (``tie_embeddings``).
* Visual tokens: features on a ``(T, H, W)`` lattice, either raw (``visual_dim`` wide, e.g. the
  video ViT's ``forward_video_tokens`` or plain patch features) or pixels through an optional
  ``vision_encoder`` (a :class:`vispe.models.video_vit.VispeVideoViT`). A projector merges
  ``spatial_merge_size x spatial_merge_size`` neighbours (Qwen2-VL's patch merger: LayerNorm ->
  Linear -> GELU -> Linear) into one LLM token; visual tokens enter the sequence in raster order
  (t-major, then h, then w), as :mod:`vispe.positions` assumes.
* Positions: ``pos_scheme`` is one of ``rope_1d, mrope, mrope_interleave, mhrope, vrope, hope, v2pe, videorope, qwen3vl``
  (a name, ``{'name': ..., 'theta': ..., 'mrope_section': ...}`` or ``(name, options)``: the
  rotary options of :mod:`vispe.encodings.multimodal_rope`); ``position_kwargs`` are the scheme's
  position options (``gamma``, ``delta``, ``fps``, ``spatial_reset``, ...). HoPE's ``gamma`` and
  V2PE's ``delta`` are drawn per visual block while ``model.training`` (``training=True`` in the
  position builder) and fixed (``position_kwargs``) in eval mode.
* Blocks: pre-norm (RMSNorm) causal self-attention and a timm ``Mlp``; attention goes through the encoding's
  ``attend`` hook exactly as in the ViTs (:func:`vispe.models.layers.encoding_attend`: q and k rotated by
  ``apply_rotary``, 'half' layout, then SDPA with a boolean causal + padding mask).
* Generation: greedy, with a per-layer KV cache of keys before rotation and the keys' rotation table (the
  encoding's ``attend`` rotates the cached keys with it, a :class:`~vispe.encodings.multimodal_rope.KeyTable`).
  After the prompt the cache stores ``rope_delta`` (per sample, relative to the padded prompt length); the
  token at cache index ``j`` gets position ``j + rope_delta`` on every coordinate.

Stable API:
    ``pack(samples, padding_side='left') -> MultimodalBatch`` where a sample is a list of items:
    a 1D ``LongTensor`` of token ids (text), a float tensor ``(T, H, W, C)`` of visual features
    (``C = visual_dim``, or ``dim`` without a projector) or :class:`VisualFeatures`; pixels
    ``(C, T, H, W)`` go through ``encode_video`` first.
    ``forward(input_ids=None, inputs_embeds=None, position_ids=None, attention_mask=None,
    cache=None, use_cache=False, labels=None) -> LLMOutput(logits, cache, loss)``;
    ``forward_batch(batch, labels=None, use_cache=False)``;
    ``generate(batch_or_samples, max_new_tokens, eos_token_id=None) -> (B, n) LongTensor``;
    ``encode_video(video (B, C, T, H, W)) -> (B, T', H', W', visual_dim)``;
    ``project_visual(features (B, T, H, W, C)) -> (B, T, H/m, W/m, dim)``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import Mlp
from torch import nn

from ..encodings import EncodingContext, create_encoding
from .._checks import Int, Real, check_options
from ..encodings.base import check_context_fields
from ..encodings.multimodal_rope import KeyTable, MultimodalRotary
from ..positions import (
    SCHEMES,
    Segment,
    Text,
    Visual,
    build_positions_batch,
    decode_positions,
)
from ..encodings.spec import PosEncodingArg, parse_pos_encoding
from .layers import LayerPE, auxiliary_loss, encoding_attend, record_auxiliary_loss

__all__ = ["DecoderBlock", "KVCache", "LLMOutput", "MultimodalBatch", "VideoLLM", "VisualFeatures", "VisualProjector"]

IGNORE_INDEX = -100


@dataclass
class VisualFeatures:
    """Visual features ``(T, H, W, C)`` of one video/image, with an optional ``seconds_per_grid`` (absolute-time M-RoPE)."""

    features: torch.Tensor
    seconds_per_grid: float | None = None


@dataclass
class MultimodalBatch:
    """A packed, padded batch. ``token_ids`` holds the text ids and ``-100`` at visual and pad slots
    (so it can serve as LM labels); ``visual_mask`` marks visual tokens."""

    inputs_embeds: torch.Tensor  # (B, L, D)
    position_ids: torch.Tensor  # (K, B, L)
    attention_mask: torch.Tensor  # (B, L) bool
    rope_delta: torch.Tensor  # (B,)
    token_ids: torch.Tensor  # (B, L) long
    visual_mask: torch.Tensor  # (B, L) bool
    segments: list = field(default_factory=list)
    padding_side: str = "left"


@dataclass
class KVCache:
    """Keys (before rotation) and values per layer, the key padding mask, the decode offset ``rope_delta`` and the
    keys' rotation table (the encoding's ``attend`` rotates keys and queries alike)."""

    keys: list
    values: list
    attention_mask: torch.Tensor  # (B, Lk) bool
    rope_delta: torch.Tensor  # (B,)
    key_table: torch.Tensor | None = None  # (B, 1|H, Lk, P) complex: table_from_positions of the cached keys

    @property
    def length(self) -> int:
        return self.attention_mask.shape[1]


@dataclass
class LLMOutput:
    logits: torch.Tensor
    cache: KVCache | None = None
    loss: torch.Tensor | None = None


class VisualProjector(nn.Module):
    """Merge ``m x m`` neighbouring visual features and map them to the LLM width (LN -> Linear -> GELU -> Linear)."""

    def __init__(self, visual_dim: int, dim: int, spatial_merge_size: int = 1) -> None:
        super().__init__()
        if not isinstance(spatial_merge_size, int) or spatial_merge_size < 1:
            raise ValueError(f"spatial_merge_size must be an int >= 1, got {spatial_merge_size!r}")
        self.merge = spatial_merge_size
        self.visual_dim = visual_dim
        hidden = visual_dim * spatial_merge_size**2
        self.norm = nn.LayerNorm(visual_dim)
        self.fc1 = nn.Linear(hidden, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, H, W, C) -> (B, T, H/m, W/m, dim)``."""
        if x.ndim != 5 or x.shape[-1] != self.visual_dim:
            raise ValueError(f"visual features must be (B, T, H, W, {self.visual_dim}), got {tuple(x.shape)}")
        B, T, H, W, C = x.shape
        m = self.merge
        if H % m or W % m:
            raise ValueError(f"visual grid {H}x{W} is not divisible by the spatial merge size {m}")
        x = self.norm(x)
        x = x.reshape(B, T, H // m, m, W // m, m, C).permute(0, 1, 2, 4, 3, 5, 6).reshape(B, T, H // m, W // m, m * m * C)
        return self.fc2(self.act(self.fc1(x)))


class DecoderAttention(nn.Module):
    """Causal self-attention with a KV cache; scores through the encoding's ``attend`` (the ViTs' path)."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = False) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self,
        x: torch.Tensor,
        pe: LayerPE,
        mask: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        B, L, C = x.shape
        q, k, v = self.qkv(x).reshape(B, L, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if past is not None:  # cached keys are kept before rotation: the state's table covers them
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        out = encoding_attend(pe, q, k, v, mask, 0.0, False)
        return self.proj(out.transpose(1, 2).reshape(B, L, C)), (k, v)


class DecoderBlock(nn.Module):
    """Pre-norm causal block: RMSNorm -> attention (rotary) -> residual; RMSNorm -> timm Mlp -> residual."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = False, norm_eps: float = 1e-6, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(dim, eps=norm_eps)
        self.attn = DecoderAttention(dim, num_heads, qkv_bias)
        self.norm2 = nn.RMSNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=dropout)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, pe: LayerPE, mask: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None = None):
        h, kv = self.attn(self.norm1(x), pe, mask, past)
        x = x + self.drop(h)
        x = x + self.mlp(self.norm2(x))
        return x, kv


class VideoLLM(nn.Module):
    """Decoder-only causal transformer over text + visual tokens with multimodal RoPE.

    Args:
        vocab_size: text vocabulary size.
        dim, depth, num_heads, mlp_ratio: transformer size (``dim / num_heads`` must be even).
        pos_scheme: multimodal rotary scheme (name, mapping or ``(name, options)``).
        position_kwargs: the scheme's position options (see :func:`vispe.positions.build_positions`).
        visual_dim: width of incoming visual features (adds a projector); ``None`` with a
            ``vision_encoder`` takes the encoder's ``embed_dim``; ``None`` without one means visual
            features are already ``dim`` wide (then ``spatial_merge_size`` must be 1).
        vision_encoder: optional video encoder with ``forward_video_tokens`` (e.g. ``VispeVideoViT``).
        spatial_merge_size: ``m``: ``m x m`` visual features form one LLM token.
        tie_embeddings: share the output head with the token embedding.
        pad_token_id: id used for pad slots in ``generate``'s outputs after EOS.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        dim: int = 128,
        depth: int = 4,
        num_heads: int = 4,
        mlp_ratio: float = 4.0,
        pos_scheme: PosEncodingArg = "mrope",
        position_kwargs: dict[str, Any] | None = None,
        visual_dim: int | None = None,
        vision_encoder: nn.Module | None = None,
        spatial_merge_size: int = 1,
        qkv_bias: bool = False,
        tie_embeddings: bool = True,
        norm_eps: float = 1e-6,
        dropout: float = 0.0,
        pad_token_id: int = 0,
    ) -> None:
        super().__init__()
        name, rope_kwargs = parse_pos_encoding(pos_scheme)
        if name not in SCHEMES:
            raise ValueError(f"pos_scheme {name!r} is not a multimodal scheme; choose one of {list(SCHEMES)}")
        check_context_fields(type(self).__name__, dim=dim, num_heads=num_heads, depth=depth)  # num_heads=0 named, not divided by
        check_options(type(self).__name__, {"vocab_size": Int(1), "spatial_merge_size": Int(1), "mlp_ratio": Real(0, 1e3, low_open=True)},
                      {"vocab_size": vocab_size, "spatial_merge_size": spatial_merge_size, "mlp_ratio": mlp_ratio})
        if dim % num_heads or (dim // num_heads) % 2:
            raise ValueError(f"dim={dim} must split into num_heads={num_heads} heads of even width (got head_dim {dim / num_heads})")
        self.vocab_size, self.dim, self.num_heads = vocab_size, dim, num_heads
        self.pos_scheme = name
        self.scheme = SCHEMES[name]
        self.num_coords = self.scheme.num_coords
        self.position_kwargs = dict(position_kwargs or {})
        self.pad_token_id = pad_token_id
        self.spatial_merge_size = spatial_merge_size
        self.pos_encoding: MultimodalRotary = create_encoding(  # type: ignore[assignment]
            name, EncodingContext(dim=dim, num_heads=num_heads, depth=depth, grid_size=(1, 1, 1), num_prefix_tokens=0), **rope_kwargs
        )
        # fail at construction on bad position options (unknown names / invalid values); on the CPU, also when the
        # model is being built on the meta device
        with torch.device("cpu"):
            build_positions_batch(name, [[Text(1)]], **self._pos_kwargs(False))

        self.vision_encoder = vision_encoder
        if visual_dim is None and vision_encoder is not None:
            visual_dim = int(vision_encoder.embed_dim)
        self.visual_dim = visual_dim
        if visual_dim is not None:
            self.projector: VisualProjector | None = VisualProjector(visual_dim, dim, spatial_merge_size)
        else:
            if spatial_merge_size != 1:
                raise ValueError("spatial_merge_size > 1 needs a projector: pass visual_dim (or a vision_encoder)")
            self.projector = None
        self.tok_embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList([DecoderBlock(dim, num_heads, mlp_ratio, qkv_bias, norm_eps, dropout) for _ in range(depth)])
        self.norm = nn.RMSNorm(dim, eps=norm_eps)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        self.init_weights()
        self.tie_embeddings = tie_embeddings
        self.tie_weights()
        # ``to_empty`` (meta-device builds) converts each module's parameters on its own, which unties shared ones:
        # tie again after every state-dict load, as Hugging Face models do
        self.register_load_state_dict_post_hook(lambda module, incompatible: module.tie_weights())

    def tie_weights(self) -> None:
        """Share the output head's weight with the token embedding (``tie_embeddings``)."""
        if self.tie_embeddings:
            self.lm_head.weight = self.tok_embed.weight

    def init_weights(self) -> None:
        """Normal(0.02) linear and embedding weights, zero biases (encodings own their init: ``reset_parameters``)."""
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    # ------------------------------------------------------------------------------------
    # positions and packing
    # ------------------------------------------------------------------------------------
    def _pos_kwargs(self, training: bool) -> dict[str, Any]:
        return self.scheme.builder_options(self.position_kwargs, training)

    def build_positions(self, segments: Sequence[Sequence[Segment]], padding_side: str = "left"):
        """``vispe.positions.build_positions_batch`` with this model's scheme and options (train-mode draws for HoPE/V2PE)."""
        return build_positions_batch(self.pos_scheme, segments, padding_side=padding_side, **self._pos_kwargs(self.training))

    def encode_video(self, video: torch.Tensor) -> torch.Tensor:
        """Pixels ``(B, C, T, H, W)`` -> vision-encoder lattice features ``(B, T', H', W', visual_dim)``."""
        if self.vision_encoder is None:
            raise ValueError("this VideoLLM has no vision_encoder; pass visual features to pack() instead of pixels")
        return self.vision_encoder.forward_video_tokens(video)

    def project_visual(self, features: torch.Tensor) -> torch.Tensor:
        """Visual features ``(B, T, H, W, C)`` -> LLM tokens ``(B, T, H/m, W/m, dim)``."""
        if self.projector is None:
            if features.ndim != 5 or features.shape[-1] != self.dim:
                raise ValueError(f"without a projector visual features must be (B, T, H, W, dim={self.dim}), got {tuple(features.shape)}")
            return features
        return self.projector(features)

    def pack(self, samples: Sequence[Sequence[Any]], padding_side: str = "left") -> MultimodalBatch:
        """Embed and pad a batch of interleaved text / visual samples and build their position ids."""
        if isinstance(samples, torch.Tensor) or not len(samples):
            raise ValueError("pack() takes a non-empty list of samples, each a list of items (LongTensor ids or visual features)")
        device = self.tok_embed.weight.device
        seqs, segs, ids, vis = [], [], [], []
        for si, sample in enumerate(samples):
            if isinstance(sample, (torch.Tensor, VisualFeatures)):
                raise TypeError(f"sample {si} must be a list of items, got a single {type(sample).__name__}")
            parts, sseg, sids, svis = [], [], [], []
            for ii, item in enumerate(sample):
                spg = None
                if isinstance(item, VisualFeatures):
                    spg, item = item.seconds_per_grid, item.features
                if not isinstance(item, torch.Tensor):
                    raise TypeError(f"sample {si} item {ii}: expected a LongTensor of token ids or a visual feature tensor, got {type(item).__name__}")
                if not item.is_floating_point():
                    if item.ndim != 1:
                        raise ValueError(f"sample {si} item {ii}: token ids must be 1D, got shape {tuple(item.shape)}")
                    if item.numel() and (int(item.min()) < 0 or int(item.max()) >= self.vocab_size):
                        raise ValueError(f"sample {si} item {ii}: token ids must lie in [0, {self.vocab_size})")
                    if item.numel() == 0:
                        continue
                    parts.append(self.tok_embed(item.to(device)))
                    sseg.append(Text(item.numel()))
                    sids.append(item.to(device))
                    svis.append(torch.zeros(item.numel(), dtype=torch.bool, device=device))
                else:
                    if item.ndim != 4 or min(item.shape[:3]) < 1:
                        raise ValueError(
                            f"sample {si} item {ii}: visual features must be (T, H, W, C) with every size >= 1, got {tuple(item.shape)}"
                        )
                    tok = self.project_visual(item[None].to(device))[0]  # (T, h, w, dim)
                    T, h, w = tok.shape[:3]
                    parts.append(tok.reshape(-1, self.dim))
                    sseg.append(Visual(T, h, w, spg))
                    sids.append(torch.full((T * h * w,), IGNORE_INDEX, dtype=torch.long, device=device))
                    svis.append(torch.ones(T * h * w, dtype=torch.bool, device=device))
            if not parts:
                raise ValueError(f"sample {si} is empty")
            seqs.append(torch.cat(parts))
            segs.append(sseg)
            ids.append(torch.cat(sids))
            vis.append(torch.cat(svis))
        bp = self.build_positions(segs, padding_side)
        B, L = len(seqs), bp.attention_mask.shape[1]
        emb = seqs[0].new_zeros(B, L, self.dim)
        token_ids = torch.full((B, L), IGNORE_INDEX, dtype=torch.long, device=device)
        visual_mask = torch.zeros(B, L, dtype=torch.bool, device=device)
        for b in range(B):
            n = seqs[b].shape[0]
            sl = slice(L - n, L) if padding_side == "left" else slice(0, n)
            emb[b, sl] = seqs[b]
            token_ids[b, sl] = ids[b]
            visual_mask[b, sl] = vis[b]
        return MultimodalBatch(emb, bp.pos.to(device), bp.attention_mask.to(device), bp.rope_delta.to(device), token_ids, visual_mask, segs, padding_side)

    # ------------------------------------------------------------------------------------
    # forward
    # ------------------------------------------------------------------------------------
    def _text_positions(self, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        delta = pos.max(dim=-1).values + 1 - mask.shape[1]
        return pos[None].expand(self.num_coords, -1, -1), delta

    @staticmethod
    def _attn_mask(key_mask: torch.Tensor, lq: int) -> torch.Tensor:
        """Boolean ``(B, 1, Lq, Lk)``: causal over absolute indices, pads masked, each token sees itself."""
        lk = key_mask.shape[1]
        qi = torch.arange(lk - lq, lk, device=key_mask.device)[:, None]
        ki = torch.arange(lk, device=key_mask.device)[None]
        causal = ki <= qi
        mask = causal[None] & key_mask[:, None, :]
        mask = mask | (ki == qi)[None]  # fully padded rows would otherwise give NaN
        return mask[:, None]

    def _check_inputs(self, input_ids, inputs_embeds, attention_mask, cache, labels, rope_delta) -> None:
        """Every input's rank, dtype, batch and length agreement and the token ids' range, before any compute
        (a wrong shape otherwise ends in an index or broadcast error deep inside attention)."""

        def shape(t: torch.Tensor) -> tuple[int, ...]:
            return tuple(t.shape)

        if input_ids is not None:
            if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
                raise TypeError(f"input_ids must be an integer tensor (B, L), got {getattr(input_ids, 'dtype', type(input_ids).__name__)}")
            if input_ids.ndim != 2:
                raise ValueError(f"input_ids must be (B, L), got shape {shape(input_ids)}" + (" (add a batch dimension: ids[None])" if input_ids.ndim == 1 else ""))
            # value checks read the tensors (a device sync; a data-dependent branch that torch.compile cannot
            # trace), so a compiled forward relies on the eager one having checked them
            if not torch.compiler.is_compiling() and input_ids.numel() and (
                    int(input_ids.min()) < 0 or int(input_ids.max()) >= self.vocab_size):
                raise ValueError(
                    f"input_ids must lie in [0, vocab_size={self.vocab_size}), got values in [{int(input_ids.min())}, {int(input_ids.max())}]"
                )
            B, L = input_ids.shape
        else:
            if not isinstance(inputs_embeds, torch.Tensor) or not inputs_embeds.is_floating_point():
                raise TypeError(f"inputs_embeds must be a float tensor (B, L, dim={self.dim}), got {getattr(inputs_embeds, 'dtype', type(inputs_embeds).__name__)}")
            if inputs_embeds.ndim != 3 or inputs_embeds.shape[-1] != self.dim:
                raise ValueError(f"inputs_embeds must be (B, L, dim={self.dim}), got shape {shape(inputs_embeds)}")
            weight_dtype = self.tok_embed.weight.dtype
            if inputs_embeds.dtype != weight_dtype and not torch.is_autocast_enabled(inputs_embeds.device.type):
                raise TypeError(f"inputs_embeds has dtype {inputs_embeds.dtype}, the model's weights {weight_dtype}; convert it or run under torch.autocast")
            B, L = inputs_embeds.shape[:2]
        if L < 1:
            raise ValueError("the input sequence is empty (L = 0)")
        if attention_mask is not None:
            if shape(attention_mask) != (B, L):
                raise ValueError(f"attention_mask must be (B, L) = ({B}, {L}) like the input, got shape {shape(attention_mask)}")
            if attention_mask.is_floating_point():  # an additive 0/-inf mask would be read inverted by .bool()
                raise TypeError(f"attention_mask must be bool or integer 0/1 (1 = a real token), got {attention_mask.dtype}")
        if labels is not None:
            if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.dtype == torch.bool:
                raise TypeError(f"labels must be an integer tensor (B, L), got {getattr(labels, 'dtype', type(labels).__name__)}")
            if shape(labels) != (B, L):
                raise ValueError(f"labels must be (B, L) = ({B}, {L}) like the input, got shape {shape(labels)}")
            bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= self.vocab_size))
            if not torch.compiler.is_compiling() and bool(bad.any()):
                raise ValueError(f"labels must lie in [0, vocab_size={self.vocab_size}) or be {IGNORE_INDEX} (ignored), got {int(labels[bad][0])}")
        if rope_delta is not None and torch.is_tensor(rope_delta) and rope_delta.numel() not in (1, B):
            raise ValueError(f"rope_delta must have 1 or B={B} values, got shape {shape(rope_delta)}")
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise TypeError(f"cache must be the KVCache returned by a forward with use_cache=True, got {type(cache).__name__}")
            if len(cache.keys) != len(self.blocks) or len(cache.values) != len(self.blocks):
                raise ValueError(f"cache holds {len(cache.keys)} layers, the model has {len(self.blocks)}")
            if cache.attention_mask.ndim != 2 or cache.attention_mask.shape[0] != B:
                raise ValueError(f"cache is for batch size {shape(cache.attention_mask)[:1]}, the input has B={B} (cache attention_mask {shape(cache.attention_mask)})")
            lk = cache.attention_mask.shape[1]
            expected = (B, self.num_heads, lk, self.dim // self.num_heads)
            for i, (k, v) in enumerate(zip(cache.keys, cache.values)):
                if shape(k) != expected or shape(v) != expected:
                    raise ValueError(f"cache layer {i}: keys/values must be {expected}, got {shape(k)} / {shape(v)}")
            if cache.rope_delta.numel() not in (1, B):
                raise ValueError(f"cache.rope_delta must have 1 or B={B} values, got shape {shape(cache.rope_delta)}")
            table = cache.key_table
            if not isinstance(table, torch.Tensor) or table.ndim != 4 or table.shape[0] != B or table.shape[-2] != lk:
                raise ValueError(f"cache.key_table must be the (B={B}, 1|H, Lk={lk}, P) rotation table of the cached keys "
                                 f"(from a forward with use_cache=True), got {shape(table) if isinstance(table, torch.Tensor) else table!r}")

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        use_cache: bool = False,
        labels: torch.Tensor | None = None,
        rope_delta: torch.Tensor | None = None,
    ) -> LLMOutput:
        """Logits ``(B, L, vocab)``.

        Without ``position_ids``: a prefill gets text positions (cumulative mask), a step with
        ``cache`` gets ``cache_index + rope_delta``. ``rope_delta`` (from :meth:`pack`) is stored in
        the returned cache; ``labels`` (``-100`` = ignore) adds a next-token cross-entropy ``loss``.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        self._check_inputs(input_ids, inputs_embeds, attention_mask, cache, labels, rope_delta)
        x = self.tok_embed(input_ids) if inputs_embeds is None else inputs_embeds
        B, L = x.shape[:2]
        if attention_mask is None:
            attention_mask = torch.ones(B, L, dtype=torch.bool, device=x.device)
        attention_mask = attention_mask.bool()
        if position_ids is None:
            if cache is None:
                position_ids, text_delta = self._text_positions(attention_mask)
                rope_delta = text_delta if rope_delta is None else rope_delta
            else:
                position_ids = decode_positions(cache.rope_delta, cache.length, self.num_coords, L)
        elif position_ids.ndim == 2:
            position_ids = position_ids[None]
        if position_ids.shape != (self.num_coords, B, L):
            raise ValueError(f"position_ids must be ({self.num_coords}, B={B}, L={L}) for scheme {self.pos_scheme!r}, got {tuple(position_ids.shape)}")
        if cache is not None:
            key_mask = torch.cat([cache.attention_mask, attention_mask], dim=1)
            rope_delta = cache.rope_delta
        else:
            key_mask = attention_mask
            if rope_delta is None and use_cache:
                # the next free position is scheme-specific (e.g. HoPE: last t + 1, reset: un-reset extent)
                raise ValueError(
                    "use_cache=True with explicit position_ids needs the rope_delta returned by the position builder "
                    "(vispe.positions.build_positions / VideoLLM.pack)"
                )
        table = self.pos_encoding.table_from_positions(position_ids.to(x.device))
        if cache is not None:
            table = torch.cat([cache.key_table, table], dim=-2)
        state = KeyTable(table)
        mask = self._attn_mask(key_mask, L)
        new_k, new_v = [], []
        for i, blk in enumerate(self.blocks):
            past = (cache.keys[i], cache.values[i]) if cache is not None else None
            x, (k, v) = blk(x, LayerPE(self.pos_encoding, state, i), mask, past)
            new_k.append(k)
            new_v.append(v)
        logits = self.lm_head(self.norm(x))
        out_cache = None
        if use_cache:
            out_cache = KVCache(new_k, new_v, key_mask, torch.as_tensor(rope_delta, device=x.device).reshape(-1).expand(B), table)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX)
        record_auxiliary_loss(self)
        return LLMOutput(logits, out_cache, loss)

    def auxiliary_loss(self) -> torch.Tensor | None:
        """The training regularisers of this model's modules (e.g. a vision encoder's SeqPE), found by
        :func:`vispe.models.layers.auxiliary_loss`; ``None`` when none has one."""
        return auxiliary_loss(self)

    def forward_batch(self, batch: MultimodalBatch, labels: torch.Tensor | None = None, use_cache: bool = False) -> LLMOutput:
        """Forward over a :meth:`pack` result."""
        return self(
            inputs_embeds=batch.inputs_embeds, position_ids=batch.position_ids, attention_mask=batch.attention_mask,
            rope_delta=batch.rope_delta, labels=labels, use_cache=use_cache,
        )

    @torch.no_grad()
    def generate(
        self,
        batch: MultimodalBatch | Sequence[Sequence[Any]],
        max_new_tokens: int = 16,
        eos_token_id: int | None = None,
    ) -> torch.Tensor:
        """Greedy decoding with a KV cache; returns ``(B, max_new_tokens)`` ids (``pad_token_id`` after EOS)."""
        if not isinstance(batch, MultimodalBatch):
            batch = self.pack(batch, padding_side="left")
        if batch.padding_side != "left" and not bool(batch.attention_mask.all()):
            raise ValueError("generate() needs a left-padded batch (pack(..., padding_side='left'))")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if eos_token_id is not None and not 0 <= eos_token_id < self.vocab_size:
            raise ValueError(f"eos_token_id={eos_token_id!r} is outside the vocabulary [0, {self.vocab_size}): generation could never stop on it")
        out = self.forward_batch(batch, use_cache=True)
        cache = out.cache
        nxt = out.logits[:, -1].argmax(-1)
        B = nxt.shape[0]
        done = torch.zeros(B, dtype=torch.bool, device=nxt.device)
        tokens = []
        for step in range(max_new_tokens):
            nxt = torch.where(done, torch.full_like(nxt, self.pad_token_id), nxt)
            tokens.append(nxt)
            if eos_token_id is not None:
                done = done | (nxt == eos_token_id)
                if bool(done.all()):
                    break
            if step == max_new_tokens - 1:
                break
            step_mask = torch.ones(B, 1, dtype=torch.bool, device=nxt.device)
            out = self(input_ids=nxt[:, None], attention_mask=step_mask, cache=cache, use_cache=True)
            cache = out.cache
            nxt = out.logits[:, -1].argmax(-1)
        gen = torch.stack(tokens, dim=1)
        if gen.shape[1] < max_new_tokens:
            gen = F.pad(gen, (0, max_new_tokens - gen.shape[1]), value=self.pad_token_id)
        return gen
