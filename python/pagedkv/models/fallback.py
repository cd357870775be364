"""Any other decoder-only HF text model, run by its OWN modules over pagedkv's cache.

The model's *ForCausalLM forward runs on the step's flat batch as one sequence (input_ids [1, T],
position_ids from the step's metadata, use_cache=False), with HF's attention dispatch pointed,
for that call only, at `paged_attention_forward`: it receives each layer's q, k, v after HF
applied its rotary embedding (and q/k norms, clipping, partial rotary: whatever the model does),
writes k, v at the step's cache slots and attends through the block tables, rows kept apart by
the metadata. No 4D mask is built (HF builds none for an attention function without a mask
function registered). The logits of `logits_rows` come from HF's own head (final norm, LM head,
logit scales and softcapping) through `logits_to_keep`.

Slower than models/llama.py (HF's eager modules, no fused kernels) but exact for what the
attention function can express: causal self-attention with an optional scale, sliding
window and score softcap (the module's, as HF passes them; computed on the CPU and CUDA alike). What
it cannot (alibi, non-causal or cross-attention, recurrent layers) is refused by
`fallback_reason` before anything runs, and again here if a call asks.

A decode step runs no host sync here (K/V go to the cache through ops.rope_and_write_kv with the
identity rotation, which skips a CUDA-graph bucket's padding rows on the device), so on CUDA the
runtime captures it as a CUDA graph where HF's modules allow (runtime/runner.py capture_step:
one that syncs or branches on values fails its capture and the model runs eagerly). A replay
skips the modules' Python: what they read from their own attributes or config each call is in
the model's fingerprint (runtime/fingerprint.py, with the modules' training flags here), so a
change there makes generate() take the model again and an LLM refuse it, as a replaced weight does.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import sys

import torch
import transformers
from transformers.modeling_utils import AttentionInterface

from pagedkv import ops
from pagedkv.layers.attention import ForwardMetadata, attention_workspace, paged_attention
from pagedkv.layers.rotary import identity_rotation

LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
ATTN_IMPLEMENTATION = "pagedkv"  # the name registered in HF's AttentionInterface (not "paged|...")


@dataclasses.dataclass(eq=False)
class FallbackWeights:
    """What the runtime reads of a model's weights (runtime/model.py: cache shape, vocabulary),
    for a model pagedkv runs by its own modules. `layers` only counts them."""

    model: torch.nn.Module  # the HF *ForCausalLM itself: its parameters are the weights
    layers: list[None]  # [num_layers]
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    # Why a decode step of this model could not be captured as a CUDA graph (runtime/runner.py
    # capture_step): its steps then run eagerly, for as long as these weights are the model's.
    capture_error: str | None = None


def fallback_weights(model) -> FallbackWeights:
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    vocab = int(model.get_output_embeddings().weight.shape[0])
    return FallbackWeights(model, [None] * config.num_hidden_layers, kv_heads, head_dim, vocab)


def fallback_reason(model) -> str | None:
    """None if the attention function reproduces every attention of `model` exactly, else what
    it has that the function cannot compute, as a noun phrase (from the config; the type itself
    is checked against the allowlist by the registry)."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        return "cross-attention (an encoder-decoder model, or add_cross_attention=True)"
    if any(getattr(config, f, None) is not None for f in ("vision_config", "audio_config", "text_config")):
        return "a multimodal config (vision, audio or text sub-configs)"
    if getattr(config, "alibi", False):
        return "alibi=True (ALiBi position biases in the attention scores)"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    nested = [v for v in rope.values() if isinstance(v, dict)]  # per layer type (Gemma 3)
    kinds = {p.get("rope_type", p.get("type")) for p in [rope, *nested]} & set(LENGTH_DEPENDENT_ROPE)
    if kinds:
        # their frequencies follow the longest sequence of a batch, which the step's flat batch
        # of other rows would change
        return f"rope type {sorted(kinds)[0]!r} (its frequencies depend on the sequence length)"
    layer_types = set(getattr(config, "layer_types", None) or [])
    if layer_types - {"full_attention", "sliding_attention"}:
        return (f"layer_types {sorted(layer_types)} (only full and sliding attention layers run "
                "over the paged cache)")
    if not _dispatches_attention(type(model).__module__):
        return (f"{type(model).__name__}'s attention computes its scores itself in transformers "
                f"{transformers.__version__}, not through HF's attention interface, which is what "
                "pagedkv replaces to run it (a newer transformers may route it there)")
    if model.get_output_embeddings() is None:
        return f"no LM head ({type(model).__name__} is not a *ForCausalLM model)"
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return f"a forward without logits_to_keep ({type(model).__name__})"
    return None


@functools.cache
def _dispatches_attention(module_name: str) -> bool:
    """Whether a modeling module calls HF's attention functions (ALL_ATTENTION_FUNCTIONS) at all:
    GPT-J's and CodeGen's in transformers 5.17 do not (their own `_attn`), 5.24's do. Read off the
    source; a module without readable source passes, and the per-call count of layers that ran
    the function (`layers_run`) still catches it."""
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(sys.modules[module_name])
    except (KeyError, OSError, TypeError):
        return True


@dataclasses.dataclass(slots=True)
class _Call:
    """One forward's state, read by the attention function of each layer."""

    k_caches: list[torch.Tensor]  # per layer [num_blocks, block_size, Hkv, Dh]
    v_caches: list[torch.Tensor]
    meta: ForwardMetadata
    at_zero: torch.Tensor  # [T] int32 zeros: every token at the identity table's one position
    identity: torch.Tensor  # [1, rot_dim] fp32: cos 1 | sin 0
    workspace: torch.Tensor | None = None
    layers_run: int = 0


_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("pagedkv_fallback_call", default=None)


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask, scaling: float | None = None,
                            dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """HF's attention interface: query [1, Hq, T, Dh], key/value [1, Hkv, T, Dh] (rotated) ->
    ([1, T, Hq, Dh], None). attention_mask is ignored: the block tables keep the rows apart and
    the kernels are causal within each."""
    call = _CALL.get()
    if call is None:
        raise RuntimeError("pagedkv's paged attention ran outside a pagedkv forward")
    sinks = kwargs.get("s_aux")  # GPT-OSS passes its sinks as s_aux
    if sinks is None:
        sinks = kwargs.get("sinks")
    if sinks is not None:  # [Hq] logits, each head's one more softmax column with a zero value row
        sinks = sinks.detach().float().contiguous()
    if not getattr(module, "is_causal", True) or key.shape[2] != query.shape[2]:
        raise NotImplementedError(f"pagedkv's paged attention runs causal self-attention only "
                                  f"({type(module).__name__})")
    layer = getattr(module, "layer_idx", None)
    layer = call.layers_run if layer is None else layer
    call.layers_run += 1
    k_cache, v_cache = call.k_caches[layer], call.v_caches[layer]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if key.shape[1] != num_kv_heads or key.shape[3] != head_dim:
        raise RuntimeError(f"layer {layer}: K of {key.shape[1]} heads of {key.shape[3]} but the cache "
                           f"holds {num_kv_heads} heads of {head_dim}")
    k = key[0].transpose(0, 1).to(k_cache.dtype).contiguous()  # [T, Hkv, Dh]
    v = value[0].transpose(0, 1).to(v_cache.dtype).contiguous()
    q = query[0].transpose(0, 1).to(k_cache.dtype).contiguous()  # [T, Hq, Dh]
    # The identity rotation (x * 1 - y * 0 rounds to x): only the write, which skips slot -1
    # (a graph bucket's padding rows) on the device, with no host sync.
    ops.rope_and_write_kv(q, k, v, call.at_zero, call.identity, k_cache, v_cache, call.meta.slot_mapping)
    if call.workspace is None:
        call.workspace = attention_workspace(q, k_cache, call.meta)
    scale = scaling if scaling is not None else head_dim ** -0.5
    softcap = float(kwargs.get("softcap") or 0.0)
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None)) or 0
    out = paged_attention(q, k_cache, v_cache, call.meta, float(scale), call.workspace,
                          sliding_window=int(window), logit_softcap=softcap, sinks=sinks)  # [T, Hq, Dh]
    return out.to(query.dtype)[None], None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


@contextlib.contextmanager
def _attention_implementation(model, name: str):
    """The model's attention dispatch set to `name` for the block, its own restored after (on
    errors too). Set on the config the modules read at each call."""
    config = model.config
    own = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = own


class FallbackDecoder:
    """PagedDecoder's interface (models/llama.py) over the HF model's own modules."""

    def __init__(self, weights: FallbackWeights, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]):
        self.w = weights
        self.k_caches = k_caches  # per layer [num_blocks, block_size, Hkv, Dh]
        self.v_caches = v_caches
        # rope_and_write_kv's table of one position that rotates nothing: 16 dims keep its
        # vectorized path (rot_dim / 2 a multiple of 16 bytes' elements)
        rot_dim = min(16, weights.head_dim - weights.head_dim % 2)
        self.identity = identity_rotation(rot_dim, k_caches[0].device)  # [1, rot_dim]

    def forward(self, input_ids: torch.Tensor, meta: ForwardMetadata,
                logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] -> logits [R, V] for the rows `logits_rows` [R] of the T tokens (all
        when None), as the HF model's head computes them. Padding rows (slot -1) write nothing;
        no host sync, so a decode step can be captured as a CUDA graph."""
        at_zero = torch.zeros_like(meta.slot_mapping, dtype=torch.int32)  # [T]
        call = _Call(self.k_caches, self.v_caches, meta, at_zero, self.identity)
        model = self.w.model
        token = _CALL.set(call)
        try:
            with _attention_implementation(model, ATTN_IMPLEMENTATION), torch.no_grad():
                out = model(input_ids=input_ids[None], position_ids=meta.positions.long()[None],
                            use_cache=False, logits_to_keep=0 if logits_rows is None else logits_rows)
        finally:
            _CALL.reset(token)
        if call.layers_run != len(self.k_caches):
            raise RuntimeError(f"{type(model).__name__}: {call.layers_run} of {len(self.k_caches)} layers "
                               "ran pagedkv's attention; the others bypass HF's attention interface")
        return out.logits[0]  # [R, V]
