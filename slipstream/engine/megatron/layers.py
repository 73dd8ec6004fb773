"""megatron-core modules that slipstream plugs into a GPTModel: packed attention and a hidden-state head.

`VarlenCoreAttention` replaces the local spec's DotProductAttention, which refuses packed (THD)
input and builds an (S x S) score matrix per sequence. It receives q (T, Hq, D) and k/v
(T, Hkv, D) of this TP rank's heads, already rotated by Megatron's RoPE (per sequence in THD
format: positions restart at every cu_seqlens boundary), and calls slipstream's varlen
attention dispatch (FlashAttention varlen on CUDA bf16, flex attention on CUDA fp32, one SDPA
call per sequence on the CPU). No Transformer Engine needed.

`HiddenStatesGPTModel` is a GPTModel whose forward stops after the final norm: the engine
computes log-probs from (T, H) hidden states and the output weight in a fused op, so the
(T, V) logits of the output layer are never built.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from slipstream.ops.attention import varlen_causal_attention


class VarlenCoreAttention(MegatronModule):
    """Causal attention within each packed sequence, for THD input (PackedSeqParams with cu_seqlens).

    The constructor takes DotProductAttention's arguments so the layer spec can build it in its
    place; dropout must be 0 (RL log-probs are deterministic) and context parallelism needs TE.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ) -> None:
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout != 0.0:
            raise ValueError(f"VarlenCoreAttention has no dropout; got attention_dropout={dropout}")
        if config.context_parallel_size != 1:
            raise ValueError("context parallelism needs Transformer Engine's attention (ring / a2a over CP ranks)")
        if config.apply_query_key_layer_scaling:
            raise ValueError("apply_query_key_layer_scaling is not supported by VarlenCoreAttention")
        # None lets the kernel use 1/sqrt(head_dim), as DotProductAttention does by default.
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.softmax_scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """q (T, Hq, D), k/v (T, Hkv, D) -> (T, Hq * D); SelfAttention reshapes it to (T, 1, Hq * D)."""
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("VarlenCoreAttention takes packed THD input (PackedSeqParams(qkv_format='thd'))")
        if attention_bias is not None:
            raise ValueError("VarlenCoreAttention does not take an attention bias")
        # One dtype for the kernel: the engine holds the whole model in the compute dtype, so these
        # casts are no-ops there; they keep other callers (a model built with fp32 norms) working.
        out = varlen_causal_attention(
            query.to(value.dtype),
            key.to(value.dtype),
            value,
            packed_seq_params.cu_seqlens_q,
            packed_seq_params.max_seqlen_q,
            scale=self.softmax_scale,
        )
        return out.flatten(-2)


class HiddenStatesGPTModel(GPTModel):
    """GPTModel returning the decoder's final-normed hidden states (S, B, H) instead of logits.

    The output layer (or the tied embedding) stays a parameter of the model, read by the engine's
    log-prob head through `output_weight()`.
    """

    def _postprocess(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        return hidden_states

    def output_weight(self) -> torch.Tensor:
        """(V / TP, H) LM-head weight of this rank: the embedding when tied, else the output layer's."""
        if self.share_embeddings_and_output_weights:
            return self.shared_embedding_or_output_weight()
        return self.output_layer.weight
