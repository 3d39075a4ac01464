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
its residual taken from the hidden stream; layers 1.. are plain pre-norm Llama layers (both in
:mod:`peagle.model.decoder_layers`, shared by the two methods). The variants
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

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from peagle.model.decoder_layers import AttnMask, DecoderLayer, FirstLayer, RMSNorm, rope_inv_freq
from peagle.model.flex import FlexFn
from peagle.model.target.directory import TargetWeights
from peagle.schemas.draft_config import DraftConfig
from peagle.schemas.errors import UserError


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
                 activation_checkpointing: bool = False, device: torch.device | str | None = None,
                 init_vocab_weights: bool = True):
        """``device``: where the weights are made and drawn (default CPU); a trainer passes its own, so
        that an 8B-shaped draft's ~1B parameters are not drawn on the host and copied over.
        ``init_vocab_weights=False`` leaves ``embed_tokens`` and ``lm_head`` uninitialised, for a caller
        that fills them from the target (:func:`build_draft_from_target`)."""
        super().__init__()
        self.config = config
        self.activation_checkpointing = activation_checkpointing
        device = torch.device(device or "cpu")
        # The modules are made on the meta device: their constructors' own init (kaiming for every
        # nn.Linear, N(0, 1) for nn.Embedding) would be drawn and then thrown away by reset_parameters.
        with torch.device("meta"):
            self._make_modules(config)
        self.to_empty(device=device)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long, device=device))
        self.register_buffer("t2d", torch.zeros(config.target_vocab_size, dtype=torch.bool, device=device))
        self.register_buffer("inv_freq", rope_inv_freq(config).to(device), persistent=False)
        self.reset_parameters(vocab_weights=init_vocab_weights)
        self.set_vocab_map(torch.arange(config.draft_vocab_size) if not config.has_vocab_map else None)
        self.lm_head.weight.requires_grad_(train_lm_head)
        self.embed_tokens.weight.requires_grad_(train_embeddings)

    def _make_modules(self, config: DraftConfig) -> None:
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

    @torch.no_grad()
    def reset_parameters(self, *, vocab_weights: bool = True) -> None:
        """Random init: N(0, 0.02) linears and embeddings (HF's initializer_range), unit norms, and a
        unit-variance ``mask_hidden`` (the scale of a raw aux state is O(1) per feature or larger).
        ``vocab_weights=False`` skips ``embed_tokens`` and ``lm_head`` (the caller copies the target's)."""
        skipped = () if vocab_weights else (self.embed_tokens, self.lm_head)
        drawn = {id(p) for m in skipped for p in m.parameters()}
        for module in self.modules():
            if any(module is s for s in skipped):
                continue
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, 0.02)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            else:
                continue
            drawn.add(id(module.weight))
        if self.mask_hidden is not None:
            self.mask_hidden.normal_(0.0, 1.0)
            drawn.add(id(self.mask_hidden))
        # The modules were made on the meta device: a parameter this method does not set holds garbage.
        missed = [name for name, p in self.named_parameters() if id(p) not in drawn]
        assert not missed, f"reset_parameters does not initialise {missed}"

    @torch.no_grad()
    def set_vocab_map(self, draft_token_ids: Tensor | None) -> None:
        """Record which target ids the draft vocab holds (sorted ascending); None leaves t2d all-False."""
        if draft_token_ids is None:
            return
        ids = torch.as_tensor(draft_token_ids, dtype=torch.long).flatten().cpu()
        check_draft_token_ids(ids, self.config)
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids.to(self.t2d.device)] = True

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
        argument. ``flex`` runs flex attention when ``attn_mask`` is a BlockMask (see :func:`peagle.model.decoder_layers.attend`);
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

    draft = PEagleDraft(config, init_vocab_weights=False, **draft_kwargs)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(embed_VH.float())
        draft.lm_head.weight.copy_((embed_VH if head_key == embed_key else weights.read(head_key)).float()[ids])
    draft.set_vocab_map(ids)
    return draft
