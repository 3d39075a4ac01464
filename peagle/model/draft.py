"""The draft model of both training methods (docs/draft-and-export.md, docs/methods.md): EAGLE-3's decoder.

A P-EAGLE draft (``config.method == "peagle"``) predicts K tokens in one forward (``forward``); an
EAGLE-3 draft one token per forward, each reading the previous one's pre-norm hidden state, through
the layers' ``step`` methods and a key/value cache (:mod:`peagle.model.sequential`). The layers,
norms, ``fc``, embeddings and head are the same modules either way.

P-EAGLE's input is one flat sequence of N elements (no batch, no padding to K·L). The first R are *real*
(depth 0): element i reads ``(embed(token_i), fc(aux_i))``. The other M = N - R are *mask slots*
(depth >= 1): they all read ``(embed(mask_token_id), fc(mask_hidden))``. Which element sees which is
the caller's attention mask (peagle.model.mask for training, causal for the inference proposer).

Layer 0 attends over ``cat[input_layernorm(embeds), hidden_norm(fc_hidden)]`` (2H wide q/k/v) with
its residual taken from the hidden stream; layers 1.. are plain pre-norm Llama layers. The variants
are vLLM's: a Qwen3 decoder (q/k head norms), ``norm_before_residual``, and the norms before ``fc``
(``norm_before_fc``, ``fc_norm``), all computed as vLLM 0.32 computes them (llama_eagle3.py,
qwen3_eagle3.py). Parameter names equal the speculators/vLLM P-EAGLE checkpoint keys, so export is a
near-identity key map.

Mask slots share one layer-0 input, so its q/k/v (before RoPE) and residual are computed once and
broadcast: layer 0's projections cost R rows instead of N (R is ~40% of N in COD training).

Shape letters: N elements, R real, M mask slots, X rows of one sequential step, P rows cached before
it, A aux layers, H hidden, T target hidden, V draft vocab, h/g query/kv heads, D head dim.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint

from peagle.model.flex import FlexFn
from peagle.model.mask import DocumentMasks
from peagle.model.target import TargetWeights
from peagle.schemas.draft_config import DraftConfig
from peagle.schemas.errors import UserError

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


class PEagleDraft(nn.Module):
    """The draft of both methods (``config.method``). A P-EAGLE draft's ``forward`` returns the final-normed
    hidden states of real rows and mask slots; an EAGLE-3 draft (no ``mask_hidden``) drafts one token
    per forward through the layers' ``step`` (:mod:`peagle.model.sequential`). ``compute_logits``
    applies lm_head.

    ``lm_head`` is frozen unless ``train_lm_head``; ``embed_tokens`` trains unless not
    ``train_embeddings`` (P-EAGLE trains it; EAGLE-3 drafts keep the target's).
    ``d2t`` (draft index -> target id offset) and ``t2d`` (target id in draft vocab) are the buffers
    vLLM reads; identity/all-True when the draft vocab is the whole target vocab.
    """

    def __init__(self, config: DraftConfig, *, train_lm_head: bool = False, train_embeddings: bool = True,
                 activation_checkpointing: bool = False):
        super().__init__()
        self.config = config
        self.activation_checkpointing = activation_checkpointing
        self.embed_tokens = nn.Embedding(config.target_vocab_size, config.hidden_size)
        self.fc = nn.Linear(config.num_aux * config.target_hidden_size, config.hidden_size, bias=False)
        self.input_norm = (RMSNorm(config.num_aux * config.target_hidden_size, config.rms_norm_eps)
                           if config.norm_before_fc else None)
        self.fc_norm = (nn.ModuleList([RMSNorm(config.target_hidden_size, config.rms_norm_eps)
                                       for _ in range(config.num_aux)]) if config.fc_norm else None)
        self.layers = nn.ModuleList([FirstLayer(config)]
                                    + [DecoderLayer(config) for _ in range(config.num_layers - 1)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        # P-EAGLE's learned stand-in for the target state of a mask slot; an EAGLE-3 draft has none.
        self.mask_hidden = (nn.Parameter(torch.empty(1, 1, config.num_aux * config.target_hidden_size))
                            if config.method == "peagle" else None)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.target_vocab_size, dtype=torch.bool))
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.reset_parameters()
        self.set_vocab_map(torch.arange(config.draft_vocab_size) if not config.has_vocab_map else None)
        self.lm_head.weight.requires_grad_(train_lm_head)
        self.embed_tokens.weight.requires_grad_(train_embeddings)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Random init: N(0, 0.02) linears and embeddings (HF's initializer_range), unit norms, and a
        unit-variance ``mask_hidden`` (the scale of a raw aux state is O(1) per feature or larger)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, 0.02)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        if self.mask_hidden is not None:
            self.mask_hidden.normal_(0.0, 1.0)

    @torch.no_grad()
    def set_vocab_map(self, draft_token_ids: Tensor | None) -> None:
        """Record which target ids the draft vocab holds (sorted ascending); None leaves t2d all-False."""
        if draft_token_ids is None:
            return
        ids = torch.as_tensor(draft_token_ids, dtype=torch.long).flatten().cpu()
        check_draft_token_ids(ids, self.config)
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Map draft-vocab indices to target token ids (vLLM: ``target = draft + d2t[draft]``)."""
        return draft_ids + self.d2t[draft_ids]

    def target_to_draft(self, target_ids: Tensor) -> Tensor:
        """Map target ids to draft-vocab indices, -1 where the id is not in the draft vocab (or is -1)."""
        index_of_target = torch.where(self.t2d, torch.cumsum(self.t2d.long(), 0) - 1, -1)
        in_range = target_ids.long().clamp(0, self.config.target_vocab_size - 1)
        return torch.where(target_ids >= 0, index_of_target[in_range], -1)

    def rope(self, position_ids_N: Tensor) -> tuple[Tensor, Tensor]:
        """cos/sin ``[N, D]`` (fp32) for absolute positions (vLLM counts a request's positions from 0)."""
        freqs_N = position_ids_N.float()[:, None] * self.inv_freq[None, :]
        angles_ND = torch.cat([freqs_N, freqs_N], dim=-1)
        return angles_ND.cos(), angles_ND.sin()

    def forward(self, token_ids: Tensor, aux_RAH: Tensor, position_ids_N: Tensor, attn_mask: AttnMask,
                flex: FlexFn | None = None) -> Tensor:
        """Final-normed hidden ``[N, H]`` of a flat sequence: R = len(aux_RAH) real rows, then N - R mask slots.

        ``token_ids`` are the real rows' tokens: its first R entries are read, any further ones are
        not (every mask slot reads ``config.mask_token_id``, whose layer-0 input is computed once).
        ``aux_RAH`` is ``[R, A, T]`` (or ``[R, A*T]``, aux layers in ``aux_layer_ids`` order).
        ``position_ids_N`` are the N RoPE positions (reference positions, docs/indexing.md): they say
        how many mask slots follow the real rows. A leading batch dim of 1 is accepted on every
        argument. ``flex`` runs flex attention when ``attn_mask`` is a BlockMask (see :func:`attend`);
        the compile decision is the caller's.
        """
        assert self.mask_hidden is not None, "an EAGLE-3 draft has no mask slots: it drafts with decode_step"
        token_ids, position_ids_N = token_ids.reshape(-1), position_ids_N.reshape(-1)
        aux_R = aux_RAH.reshape(-1, self.fc.in_features)
        num_real = aux_R.shape[0]
        if not torch.is_autocast_enabled(aux_R.device.type):  # autocast casts inside fc itself
            aux_R = aux_R.to(self.fc.weight.dtype)
        num_mask = position_ids_N.shape[0] - num_real
        assert num_mask >= 0 and token_ids.shape[0] >= num_real, "token/position/aux sizes disagree"

        hidden_RH = self.combine_hidden_states(aux_R)
        mask_hidden_1H = self.combine_hidden_states(self.mask_hidden.reshape(1, -1).to(aux_R.dtype))
        # The mask row goes through the embedding op with the real rows: indexing the weight instead
        # would give backward a second dense [V, H] fp32 gradient of the whole table to add up.
        mask_id = token_ids.new_full((1,), self.config.mask_token_id)
        embeds_R1H = self.embed_tokens(torch.cat([token_ids[:num_real], mask_id]))
        cos_ND, sin_ND = self.rope(position_ids_N)

        h = self._run(self.layers[0], embeds_R1H, hidden_RH, mask_hidden_1H, cos_ND, sin_ND, attn_mask, flex)
        for layer in self.layers[1:]:
            h = self._run(layer, h, cos_ND, sin_ND, attn_mask, flex)
        return self.norm(h)

    def combine_hidden_states(self, aux_RF: Tensor) -> Tensor:
        """``fc`` over ``[R, A*T]`` aux rows, after the optional norms, in vLLM's order and for the
        same inputs: its ``combine_hidden_states`` runs on the target's aux states and on
        ``mask_hidden`` (which is why the mask slots' hidden goes through the norms too)."""
        if self.input_norm is not None:
            aux_RF = self.input_norm(aux_RF)
        if self.fc_norm is not None:
            chunks = aux_RF.chunk(self.config.num_aux, dim=-1)
            aux_RF = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux_RF)

    def _run(self, layer: nn.Module, *args: Any) -> Tensor:
        # Activation checkpointing trades one extra layer forward for not keeping its activations;
        # use_reentrant=False lets the BlockMask (not a tensor) pass through and composes with flex.
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(layer, *args, use_reentrant=False)
        return layer(*args)

    def compute_logits(self, hidden_NH: Tensor) -> Tensor:
        """Draft-vocab logits ``[N, V]`` (index with ``draft_to_target`` for target ids)."""
        return self.lm_head(hidden_NH)


def check_draft_token_ids(ids: Tensor, config: DraftConfig) -> None:
    """Raise UserError unless ``ids`` are draft_vocab_size sorted, unique target ids without the mask token."""
    if ids.numel() != config.draft_vocab_size:
        raise UserError(f"draft vocab has {ids.numel()} ids but draft_vocab_size is {config.draft_vocab_size}")
    if ids.numel() > 1 and bool((ids[1:] <= ids[:-1]).any()):
        raise UserError("draft token ids must be strictly ascending target ids")
    if int(ids.min()) < 0 or int(ids.max()) >= config.target_vocab_size:
        raise UserError(f"draft token ids must lie in [0, {config.target_vocab_size})")


def build_draft_from_target(target_dir: str | Path, config: DraftConfig, draft_token_ids: Tensor | None = None,
                            **draft_kwargs: Any) -> PEagleDraft:
    """A randomly initialised draft whose ``embed_tokens`` and ``lm_head`` rows come from the target.

    ``draft_token_ids`` are the draft vocab's target ids (sorted ascending); None means the whole
    target vocab. A target with tied embeddings gives its embedding rows to ``lm_head``. Weights are
    fp32 (master weights) whatever the target's dtype. Extra keyword arguments go to PEagleDraft.

    Raises:
        UserError: when files are missing, shapes disagree with the config, or the ids are invalid.
    """
    weights = TargetWeights(target_dir)
    embed_key = weights.find("embed_tokens.weight")
    if embed_key is None:
        raise UserError(f"target {target_dir} has no unique embed_tokens.weight")
    head_key = weights.find("lm_head.weight") or embed_key  # tied embeddings: lm_head is embed_tokens
    embed_VH = weights.read(embed_key)
    expected = (config.target_vocab_size, config.hidden_size)
    if tuple(embed_VH.shape) != expected:
        raise UserError(f"target embed_tokens shape {tuple(embed_VH.shape)} does not match draft config {expected}")
    if draft_token_ids is None:
        if config.has_vocab_map:
            raise UserError(f"draft_vocab_size {config.draft_vocab_size} < target vocab needs draft_token_ids")
        draft_token_ids = torch.arange(config.target_vocab_size)
    ids = torch.as_tensor(draft_token_ids, dtype=torch.long).flatten()
    check_draft_token_ids(ids, config)

    draft = PEagleDraft(config, **draft_kwargs)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(embed_VH.float())
        draft.lm_head.weight.copy_((embed_VH if head_key == embed_key else weights.read(head_key)).float()[ids])
    draft.set_vocab_map(ids)
    return draft
