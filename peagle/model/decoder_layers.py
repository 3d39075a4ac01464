"""The decoder layers of a draft, shared by both training methods (docs/draft-and-export.md, docs/methods.md).

Layer 0 (:class:`FirstLayer`) attends over ``cat[input_layernorm(embeds), hidden_norm(fc_hidden)]``
(2H wide q/k/v) with its residual taken from the hidden stream; layers 1.. (:class:`DecoderLayer`)
are plain pre-norm Llama layers, with Qwen3's q/k head norms when the config says so. Each has two
entry points over the same weights: ``forward`` runs one flat sequence under one attention mask
(P-EAGLE's single forward; EAGLE-3's depth 0 too), ``step`` runs X new rows over the keys and values
of earlier ones and returns the extended cache (:data:`KV`; EAGLE-3's training-time test and
sequential drafting, :mod:`peagle.model.sequential`). :func:`attend` is the one attention: SDPA for a
dense bool mask, SDPA per document for :class:`~peagle.model.mask.DocumentMasks`, flex for a
``BlockMask``. Everything is computed as vLLM 0.32 computes it (llama_eagle3.py, qwen3_eagle3.py);
parameter names are the speculators/vLLM checkpoint keys. The model around them is
:class:`peagle.model.draft.PEagleDraft`.

Shape letters: N elements, R real, X rows of one sequential step, P rows cached before it, H hidden,
h/g query/kv heads, D head dim, F a projection's input width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from peagle.model.flex import FlexFn
from peagle.model.mask import DocumentMasks
from peagle.schemas.draft_config import DraftConfig

AttnMask = Tensor | BlockMask | DocumentMasks
"""bool [N, N] (True = may attend) selects SDPA, a BlockMask flex, DocumentMasks SDPA per document."""

KV = tuple[Tensor, Tensor]
"""One layer's keys and values so far, ``[g, P, D]`` each (after RoPE): sequential drafting's cache."""


def rope_inv_freq(config: DraftConfig) -> Tensor:
    """RoPE inverse frequencies [D/2] from ``rope_parameters`` (default, linear and llama3 types)."""
    params = config.rope_parameters
    dim = config.head_dim
    inv_freq = 1.0 / (float(params["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    rope_type = params.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
        # interpolated linearly in 1/wavelength.
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_context = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_context / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        inv_freq = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return inv_freq.float()


def rotate_half(x: Tensor) -> Tensor:
    """The neox-style rotation used by HF Llama and vLLM (``is_neox_style=True``)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 then scale in the input dtype, as HF Llama and vLLM do.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def attend(q_hND: Tensor, k_gND: Tensor, v_gND: Tensor, attn_mask: AttnMask, flex: FlexFn | None = None) -> Tensor:
    """Masked attention with GQA; SDPA for a dense bool mask, flex for a BlockMask. Returns [N, h*D].

    With SDPA every query must see at least one key (true for COD masks: an element sees itself).
    ``flex`` runs flex attention (the trainer's compiled ``FlexRunner``); None is eager
    ``flex_attention``, which materialises ``[h, N, N]`` scores: for tests and short rows only.
    """
    if isinstance(attn_mask, DocumentMasks):
        return _attend_per_document(q_hND, k_gND, v_gND, attn_mask)
    # Contiguous [h, N, D] operands: flex's kernels read them row-major (under torch.compile the copy
    # fuses into RoPE, which writes them in this layout directly).
    q, k, v = (t[None].contiguous() for t in (q_hND, k_gND, v_gND))
    if isinstance(attn_mask, BlockMask):
        out = (flex or flex_attention)(q, k, v, block_mask=attn_mask, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(q_hND.shape[1], -1)


def _attend_per_document(q_hND: Tensor, k_gND: Tensor, v_gND: Tensor, masks: DocumentMasks) -> Tensor:
    """SDPA over each document's elements alone (no element sees another document), scattered back
    into place: the same result as one dense mask at a fraction of the N^2 work."""
    num_heads, n, head_dim = q_hND.shape
    out_NF = q_hND.new_zeros(n, num_heads * head_dim)
    keys = masks.key_index_per_doc or masks.index_per_doc
    for idx, key_idx, mask in zip(masks.index_per_doc, keys, masks.mask_per_doc):
        q, k, v = q_hND[:, idx][None], k_gND[:, key_idx][None], v_gND[:, key_idx][None]
        doc_out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        out_NF = out_NF.index_copy(0, idx, doc_out[0].transpose(0, 1).reshape(idx.numel(), -1))
    return out_NF


class Attention(nn.Module):
    """Llama attention (no bias) whose q/k/v read ``in_features`` (H, or 2H in layer 0); Qwen3's adds
    ``q_norm``/``k_norm``, an RMSNorm over each head's D features before RoPE (vLLM's Qwen3Attention)."""

    def __init__(self, config: DraftConfig, in_features: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = nn.Linear(in_features, config.num_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, config.num_kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, config.num_kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)
        qwen3 = config.architecture == "qwen3"
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if qwen3 else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if qwen3 else None

    def _heads(self, q_N: Tensor, k_N: Tensor, v_N: Tensor, cos_ND: Tensor,
               sin_ND: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Projected rows as heads ``[h, N, D]`` / ``[g, N, D]``, RoPE applied to q and k."""
        n = q_N.shape[0]
        q = q_N.view(n, self.num_heads, self.head_dim)
        k = k_N.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # back to the projection's dtype: fp32 norm weights must not upcast under autocast
            q, k = self.q_norm(q).to(q.dtype), self.k_norm(k).to(k.dtype)
        q, k = q.transpose(0, 1), k.transpose(0, 1)
        v = v_N.view(n, self.num_kv_heads, self.head_dim).transpose(0, 1)
        cos, sin = cos_ND.to(q.dtype), sin_ND.to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def attend_projected(self, q_N: Tensor, k_N: Tensor, v_N: Tensor, cos_ND: Tensor, sin_ND: Tensor,
                         attn_mask: AttnMask, flex: FlexFn | None = None) -> Tensor:
        """RoPE, attention and o_proj on already projected q/k/v rows."""
        q, k, v = self._heads(q_N, k_N, v_N, cos_ND, sin_ND)
        return self.o_proj(attend(q, k, v, attn_mask, flex))

    def forward(self, x_NH: Tensor, cos_ND: Tensor, sin_ND: Tensor, attn_mask: AttnMask,
                flex: FlexFn | None = None) -> Tensor:
        q, k, v = self.q_proj(x_NH), self.k_proj(x_NH), self.v_proj(x_NH)
        return self.attend_projected(q, k, v, cos_ND, sin_ND, attn_mask, flex)

    def step(self, x_XF: Tensor, cos_XD: Tensor, sin_XD: Tensor, attn_mask: AttnMask, past: KV | None,
             flex: FlexFn | None = None) -> tuple[Tensor, KV]:
        """X new rows attending over the keys and values of earlier steps (``past``) and their own
        (sequential drafting, :mod:`peagle.model.sequential`); returns the output and every key and
        value so far, ``[g, P + X, D]`` each, for the next step."""
        q, k, v = self._heads(self.q_proj(x_XF), self.k_proj(x_XF), self.v_proj(x_XF), cos_XD, sin_XD)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=1), torch.cat([past[1], v], dim=1)
        return self.o_proj(attend(q, k, v, attn_mask, flex)), (k, v)


class MLP(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A pre-norm Llama layer (layers 1..num_layers-1)."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x_NH: Tensor, cos_ND: Tensor, sin_ND: Tensor, attn_mask: AttnMask,
                flex: FlexFn | None = None) -> Tensor:
        h = x_NH + self.self_attn(self.input_layernorm(x_NH), cos_ND, sin_ND, attn_mask, flex)
        return h + self.mlp(self.post_attention_layernorm(h))

    def step(self, x_XH: Tensor, cos_XD: Tensor, sin_XD: Tensor, attn_mask: AttnMask, past: KV | None,
             flex: FlexFn | None = None) -> tuple[Tensor, KV]:
        """:meth:`forward` of X new rows over a key/value cache (:meth:`Attention.step`)."""
        attn, kv = self.self_attn.step(self.input_layernorm(x_XH), cos_XD, sin_XD, attn_mask, past, flex)
        h = x_XH + attn
        return h + self.mlp(self.post_attention_layernorm(h)), kv


class FirstLayer(DecoderLayer):
    """Layer 0: attention over ``cat[input_layernorm(embeds), hidden_norm(fc_hidden)]``, residual from
    the hidden stream (normed when ``norm_before_residual``, as vLLM's ``_norm_before_residual``)."""

    def __init__(self, config: DraftConfig):
        super().__init__(config)
        self.self_attn = Attention(config, 2 * config.hidden_size)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_before_residual = config.norm_before_residual

    def forward(self, embeds_R1H: Tensor, hidden_RH: Tensor, mask_hidden_1H: Tensor, cos_ND: Tensor,
                sin_ND: Tensor, attn_mask: AttnMask, flex: FlexFn | None = None) -> Tensor:
        """``embeds_R1H``: the R real rows' embeddings and the mask token's (one lookup); the N - R mask
        slots' count is read off the RoPE rows, so it is a size, not an int argument that a compiled
        layer would specialise on."""
        num_mask = cos_ND.shape[0] - embeds_R1H.shape[0] + 1
        # Real rows and the one shared mask row go through the norms and projections together.
        hidden_R1H = torch.cat([hidden_RH, mask_hidden_1H])
        normed_hidden = self.hidden_norm(hidden_R1H)
        x = torch.cat([self.input_layernorm(embeds_R1H), normed_hidden], dim=-1)
        residual = normed_hidden if self.norm_before_residual else hidden_R1H
        attn = self.self_attn
        q, k, v = (_expand_last_row(proj(x), num_mask) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        h = _expand_last_row(residual, num_mask) + attn.attend_projected(q, k, v, cos_ND, sin_ND, attn_mask, flex)
        return h + self.mlp(self.post_attention_layernorm(h))

    def step(self, embeds_XH: Tensor, hidden_XH: Tensor, cos_XD: Tensor, sin_XD: Tensor, attn_mask: AttnMask,
             past: KV | None, flex: FlexFn | None = None) -> tuple[Tensor, KV]:
        """Layer 0 of X new rows, each with its own embedding and hidden state, over a key/value cache:
        vLLM's EAGLE-3 layer 0 (the hidden is ``fc(aux)`` at depth 0, the previous step's pre-norm
        output after)."""
        normed_hidden = self.hidden_norm(hidden_XH)
        x = torch.cat([self.input_layernorm(embeds_XH), normed_hidden], dim=-1)
        residual = normed_hidden if self.norm_before_residual else hidden_XH
        attn, kv = self.self_attn.step(x, cos_XD, sin_XD, attn_mask, past, flex)
        h = residual + attn
        return h + self.mlp(self.post_attention_layernorm(h)), kv


def _expand_last_row(x_R1: Tensor, num_repeats: int) -> Tensor:
    """``[R+1, F] -> [R+M, F]``: keep the R real rows, repeat the shared mask row M times."""
    return torch.cat([x_R1[:-1], x_R1[-1:].expand(num_repeats, -1)])
