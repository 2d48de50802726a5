"""The bidirectional context encoder.

A Llama-style transformer (RMSNorm, RoPE, SwiGLU) without a causal mask. Weight names follow the
released checkpoints (``embed_tokens``, ``layers.{j}.self_attn.{q,k,v,o}_proj``, ``layers.{j}.mlp.*``,
``layers.{j}.{input,post_attention}_layernorm``, ``norm``).

Shape legend: B batch, K chunks, L chunk length, S = K·L, N = chunks in one encoder call, D = hidden size,
D_enc = the width of Φ (D, or ``EncoderConfig.output_size`` with a down-projection).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import EncoderConfig
from .layers import ATTENTION_KERNELS, RMSNorm, apply_rope, repeat_kv, rope_cos_sin


class EncoderAttention(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

        self.causal = cfg.causal

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_mask: torch.Tensor | None, impl: str
    ) -> torch.Tensor:
        n, length, _ = x.shape
        q = self.q_proj(x).view(n, length, self.num_heads, self.head_dim).transpose(1, 2)  # (N, H, L, hd)
        k = self.k_proj(x).view(n, length, self.num_kv, self.head_dim).transpose(1, 2)  # (N, KV, L, hd)
        v = self.v_proj(x).view(n, length, self.num_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        scale = 1.0 / math.sqrt(self.head_dim)
        if self.causal:
            out = causal_attention(q, k, v, key_mask, scale, impl)
        else:
            out = ATTENTION_KERNELS[impl](q, k, v, key_mask, scale)
        return self.o_proj(out.transpose(1, 2).reshape(n, length, -1))


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, scale: float, impl: str
) -> torch.Tensor:
    """Left-to-right attention within each chunk: query i sees keys ``j <= i`` that are real.

    Args:
        q: ``(N, H, L, hd)``; k, v: ``(N, KV, L, hd)``; key_mask: ``(N, L)`` bool or None.
        impl: ``"eager"`` (plain reference: masked scores, fp32 softmax) or ``"sdpa"`` (fused).

    Returns:
        ``(N, H, L, hd)``.
    """
    length = q.shape[2]
    allowed = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()  # (L, L)
    if key_mask is not None:
        # a query with no real key at or before it (a leading pad) may see every real key: its output
        # is never read, the row only has to stay finite
        allowed = allowed[None] & key_mask[:, None, :]  # (N, L, L)
        allowed = allowed | ~allowed.any(-1, keepdim=True)
        allowed = allowed[:, None]  # (N, 1, L, L)
    k, v = repeat_kv(k, q.shape[1] // k.shape[1]), repeat_kv(v, q.shape[1] // v.shape[1])
    if impl == "sdpa":
        if key_mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


class EncoderMLP(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.self_attn = EncoderAttention(cfg)
        self.mlp = EncoderMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, key_mask, impl):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, key_mask, impl)
        return x + self.mlp(self.post_attention_layernorm(x))


class ContextEncoder(nn.Module):
    """Bidirectional encoder applied to every chunk independently (positions 0..L-1 in each chunk).

    ``shared_embeddings``: read tokens through this (frozen) embedding module, the decoder's, instead of
    a table of its own; it is then not a submodule (not saved with the adapter, not trained).
    """

    def __init__(
        self,
        cfg: EncoderConfig,
        attn_implementation: str = "sdpa",
        shared_embeddings: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.attn_implementation = attn_implementation
        self.gradient_checkpointing = False
        if shared_embeddings is None:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        else:
            self.__dict__["_shared_embeddings"] = shared_embeddings  # not registered: not ours to save
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # the learned down-projection D -> D_enc (``EncoderConfig.output_size``): Φ is narrower than the
        # encoder, so the caches that keep Φ keep less per context token
        self.out_proj = (
            nn.Linear(cfg.hidden_size, cfg.output_size, bias=False) if cfg.output_size is not None else None
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, initializer_range) for linear and embedding weights, ones for norms."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=self.config.initializer_range)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``(N, L) -> (N, L, D)`` (the decoder's when shared)."""
        shared = self.__dict__.get("_shared_embeddings")
        return self.embed_tokens(input_ids) if shared is None else shared(input_ids)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, project: bool = True
    ) -> torch.Tensor:
        """Encode a batch of chunks.

        Args:
            input_ids: ``(N, L)`` token ids.
            attention_mask: ``(N, L)``, nonzero/True on real tokens; every row needs one real token.
            project: apply the down-projection (when there is one); False gives the ``(N, L, D)`` states
                before it.

        Returns:
            Φ: the last hidden states after the final norm (and the down-projection), ``(N, L, D_enc)``.
        """
        x = self.embed(input_ids).to(self.norm.weight.dtype)
        cos, sin = rope_cos_sin(
            input_ids.shape[1], self.config.head_dim, self.config.rope_theta, x.device, x.dtype
        )
        key_mask = None if attention_mask is None else attention_mask.bool()
        if key_mask is not None and bool(key_mask.all()):
            key_mask = None
        for layer in self.layers:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(
                    layer, x, cos, sin, key_mask, self.attn_implementation, use_reentrant=False
                )
            else:
                x = layer(x, cos, sin, key_mask, self.attn_implementation)
        x = self.norm(x)
        return x if self.out_proj is None or not project else self.out_proj(x)

    def encode_chunks(
        self,
        encoder_input_ids: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
        micro_batch: int = 64,
        in_place: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode ``(B, K, L)`` chunks independently into Φ.

        Chunks without any real token are skipped (never run through the encoder); chunks are encoded
        in micro-batches of at most ``micro_batch`` so long contexts fit in memory.

        ``in_place`` (default: when autograd is off) writes every micro-batch into one preallocated Φ
        instead of building a new copy per micro-batch (the reference, autograd-friendly path): the
        same values without ``K / micro_batch`` transient copies of Φ at long contexts.

        Returns:
            ``(states, key_mask)``: Φ ``(B, K·L, D)`` (zeros at padded positions) and ``(B, K·L)`` bool.
        """
        b, k, length = encoder_input_ids.shape
        ids = encoder_input_ids.reshape(b * k, length)  # (B·K, L)
        if encoder_attention_mask is None:
            mask = torch.ones_like(ids, dtype=torch.bool)
        else:
            mask = encoder_attention_mask.reshape(b * k, length).bool()
        dtype = self.norm.weight.dtype
        if torch.is_autocast_enabled(ids.device.type):
            dtype = torch.get_autocast_dtype(ids.device.type)
        states = torch.zeros(b * k, length, self.config.state_size, dtype=dtype, device=ids.device)
        live = mask.any(-1).nonzero().flatten()  # chunks with at least one real token
        if in_place is None:
            in_place = not torch.is_grad_enabled()
        for start in range(0, live.numel(), micro_batch):
            sel = live[start : start + micro_batch]
            out = self(ids[sel], mask[sel])
            if in_place:
                states.index_copy_(0, sel, out.to(dtype))
            else:
                states = states.index_copy(0, sel, out.to(dtype))
        if in_place:
            states.mul_(mask[..., None].to(dtype))
        else:
            states = states * mask[..., None].to(dtype)
        return states.view(b, k * length, -1), mask.view(b, k * length)


class EncoderForMaskedLM(nn.Module):
    """The encoder with a masked-LM head, for pre-training (the head is dropped inside CEPE).

    Head names follow the released MLM encoder: ``lm_dense`` (D_enc→D_enc, bias), GELU, ``lm_layer_norm``,
    ``lm_head`` (D_enc→V, bias).
    """

    def __init__(self, cfg: EncoderConfig, attn_implementation: str = "sdpa") -> None:
        super().__init__()
        if cfg.mask_token_id is None:
            raise ValueError("masked-LM pre-training needs EncoderConfig.mask_token_id")
        self.encoder = ContextEncoder(cfg, attn_implementation)
        d = cfg.state_size  # the head reads Φ, after the down-projection when there is one
        self.lm_dense = nn.Linear(d, d)
        self.lm_layer_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(d, cfg.vocab_size)
        for m in (self.lm_dense, self.lm_head):
            nn.init.normal_(m.weight, std=cfg.initializer_range)
            nn.init.zeros_(m.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Returns ``(loss, logits)``; logits ``(M, V)`` only at positions with ``labels != -100``
        when labels are given (fp32 loss), else ``(N, L, V)``."""
        h = self.encoder(input_ids, attention_mask)  # (N, L, D_enc)
        if labels is not None:
            sel = labels != -100
            h = h[sel]
        logits = self.lm_head(self.lm_layer_norm(F.gelu(self.lm_dense(h))))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float(), labels[labels != -100])
        return loss, logits
