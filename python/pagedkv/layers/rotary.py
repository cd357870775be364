"""The cos/sin cache that ``ops.rope_and_write_kv`` reads, computed by HF's own rotary embedding.

HF's ``<Model>RotaryEmbedding`` computes ``inv_freq`` on the CPU from the config (default, llama3,
yarn, linear... rope types, rope_theta, partial_rotary_factor) and, in every forward, cos/sin in
float32 on the model's device as ``cos(position * inv_freq) * attention_scaling``. Calling that
very module for positions 0..max_position-1 on the target device gives the values HF would use,
bit for bit; the kernel then casts them to the model dtype, as HF does before
``apply_rotary_pos_emb``.
"""

from __future__ import annotations

import copy
import importlib
import inspect

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# Rope types whose frequencies depend on the current sequence length: no static cache fits them
# (the native decoder computes each step's cos/sin instead: RopeByLength).
LENGTH_DEPENDENT_ROPE_TYPES = _DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


def identity_rotation(rot_dim: int, device: torch.device) -> torch.Tensor:
    """[1, rot_dim] fp32, cos 1 | sin 0: a rotary table of one position that rotates nothing, so
    that ops.rope_and_write_kv (every token at row 0) only writes K and V, for decoders that rotate
    q and k themselves (HF's rounding, HF's own modules). x * 1 - y * 0 rounds to x."""
    identity = torch.zeros(1, rot_dim, dtype=torch.float32, device=device)
    identity[:, :rot_dim // 2] = 1.0
    return identity


def rope_type(config) -> str:
    """The config's rope type ("default", "llama3", "yarn", ...), across transformers versions."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default")) or "default"


def hf_rotary_embedding(config) -> torch.nn.Module:
    """A fresh instance of the config's ``<Model>RotaryEmbedding`` (on the CPU, as HF builds it)."""
    module_name = f"transformers.models.{config.model_type}.modeling_{config.model_type}"
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"pagedkv: no transformers module {module_name} for model_type {config.model_type!r}; "
            "pass rotary_emb= (the model's own rotary embedding module)"
        ) from err
    classes = [
        cls for name, cls in vars(module).items()
        if name.endswith("RotaryEmbedding") and isinstance(cls, type) and cls.__module__ == module_name
    ]
    if len(classes) != 1:
        raise ValueError(
            f"pagedkv: {module_name} defines {len(classes)} RotaryEmbedding classes, expected one; "
            "pass rotary_emb= (the model's own rotary embedding module)"
        )
    return classes[0](config)


@torch.no_grad()
def build_cos_sin_cache(
    config, max_position: int, device: torch.device | str, rotary_emb: torch.nn.Module | None = None
) -> torch.Tensor:
    """cos_sin_cache [max_position, rot_dim] float32 on device: cos of the rot_dim/2 frequencies,
    then their sin, for positions 0..max_position-1 (HF's rotate-half convention repeats both
    halves). rot_dim is head_dim, or less with a partial_rotary_factor.

    rotary_emb: the loaded model's rotary embedding (e.g. ``model.model.rotary_emb``), used as is;
    by default a fresh one is built from the config. Rope types "dynamic" and "longrope" change
    their frequencies with the sequence length and are refused.
    """
    kind = rope_type(config)
    if kind in _DYNAMIC_ROPE_TYPES:
        raise NotImplementedError(
            f"pagedkv: rope type {kind!r} recomputes its frequencies per sequence length; "
            "a static cos/sin cache cannot reproduce it"
        )
    if rotary_emb is None:
        rotary_emb = hf_rotary_embedding(config).to(device)
    on = rotary_emb.inv_freq.device
    positions = torch.arange(max_position, device=on)[None]  # int64, as HF's position_ids
    cos, sin = rotary_emb(torch.empty(1, dtype=torch.float32, device=on), positions)
    half = cos.shape[-1] // 2
    return torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1).to(device).contiguous()


class LengthDependentRope:
    """HF's "dynamic" and "longrope" rotary embeddings, whose frequencies follow the length S of
    the forward they run in (HF: S = the call's largest position_id + 1, over the whole batch).

    dynamic: S > original_max_seq_len (the module's max_position_embeddings) recomputes inv_freq
    with seq_len=S (a growing NTK base); S within it uses the original. longrope: S past
    rope_parameters["original_max_position_embeddings"] switches to the long factors, else the
    short ones; its attention scaling is fixed. Both as HF's own functions compute them (for the
    state a fresh module starts a generate() from: its frequencies not grown yet).

    Which S a token's rotation used in HF is the caller's to say (`rope_lens`): K written by an
    earlier call keep the S of that call, so a prefill chunk's tokens need their prompt's S, not
    the chunk's. Phi-3 (phi3 and phimoe) drops its cache when it first passes the switch (its
    prepare_inputs_for_generation): 5.24 recomputes the whole sequence, so every earlier K is
    then rotated long; 5.17 goes on without the earlier K (phi3_drops_cache). Memoized per S on
    the host, for tests; the native decoder reads RopeByLength's device tables (built from this),
    and the fallback path refuses both types (fallback.LENGTH_DEPENDENT_ROPE)."""

    def __init__(self, rotary_emb: torch.nn.Module):
        self.kind = rotary_emb.rope_type
        if self.kind not in _DYNAMIC_ROPE_TYPES:
            raise ValueError(f"pagedkv: rope type {self.kind!r} does not depend on the sequence length")
        self.module = copy.deepcopy(rotary_emb)  # ours to re-point; the model's keeps its state
        self.original = rotary_emb.original_inv_freq.detach().clone()
        self.scaling = float(rotary_emb.attention_scaling)
        config = rotary_emb.config
        if self.kind == "longrope":
            params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
            self.switch = int(params.get("original_max_position_embeddings") or config.max_position_embeddings)
        else:
            self.switch = int(rotary_emb.original_max_seq_len)
        self._init = ROPE_INIT_FUNCTIONS[self.kind]
        self._frequencies: dict[int, tuple[torch.Tensor, float]] = {}

    def frequencies(self, length: int) -> tuple[torch.Tensor, float]:
        """(inv_freq [rot_dim / 2] fp32, attention scaling) of a forward of length S=`length`."""
        if length <= self.switch:
            return self.original, self.scaling
        if self.kind == "longrope":  # one long set for every S past the switch
            length = self.switch + 1
        if length not in self._frequencies:
            on = self.original.device
            # HF passes dynamic's S as torch.max(position_ids) + 1, a 0-d int64 tensor, and the
            # base it computes from it is fp32 tensor arithmetic: the same here, bit for bit
            seq_len = torch.tensor(length - 1, device=on) + 1 if self.kind == "dynamic" else length
            inv_freq, scaling = self._init(self.module.config, on, seq_len=seq_len)
            self._frequencies[length] = (inv_freq, self.scaling if self.kind == "longrope" else float(scaling))
        return self._frequencies[length]

    @torch.no_grad()
    def cos_sin(self, positions: torch.Tensor, rope_lens: torch.Tensor) -> torch.Tensor:
        """positions [T], rope_lens [T] (each token's S) -> [T, rot_dim] fp32: cos halves, then sin
        halves (build_cos_sin_cache's row layout), computed by HF's own forward for each S."""
        out = None
        forward = inspect.unwrap(type(self.module).forward)  # without the per-call S update
        for length in torch.unique(rope_lens).tolist():
            rows = (rope_lens == length).nonzero().squeeze(1)
            inv_freq, scaling = self.frequencies(int(length))
            self.module.inv_freq = inv_freq.to(positions.device)
            self.module.attention_scaling = scaling
            on = positions[rows].long()[None]  # [1, n]
            cos, sin = forward(self.module, torch.empty(1, dtype=torch.float32, device=on.device), on)
            half = cos.shape[-1] // 2
            if out is None:
                out = torch.empty(positions.shape[0], 2 * half, dtype=torch.float32, device=positions.device)
            out[rows] = torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1)
        return out


def rope_lens(positions: torch.Tensor, row_of_token: torch.Tensor, offsets: torch.Tensor,
              bases: torch.Tensor) -> torch.Tensor:
    """Each token's S (LengthDependentRope) as HF's generate() gave it: positions [T] and
    row_of_token [T]; per row, offsets [B] (how far its positions trail the batch's longest
    row, whose max position HF takes: 0 for a batch of one prompt, as LLM compares against) and
    bases [B] (the S of the prefill that wrote the prompt: the longest prompt of the batch).
    S = max(position + 1 + offset, base): prompt tokens the prefill's S, each generated token the
    S of the decode step that fed it."""
    return torch.maximum(positions.long() + 1 + offsets.long()[row_of_token], bases.long()[row_of_token])


def max_length(config) -> int:
    """The longest sequence pagedkv runs a length-dependent rope at: longrope's
    max_position_embeddings (its long factors' range); dynamic's max_position_embeddings is where
    its NTK scaling starts, and HF sets no end: pagedkv stops at factor times it (its tables are
    sized by it)."""
    mpe = int(config.max_position_embeddings)
    if rope_type(config) != "dynamic":
        return mpe
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return max(mpe, int(float(params.get("factor", 1.0)) * mpe))


class RopeByLength:
    """A length-dependent rope (LengthDependentRope) on the device, for the native decoder: each
    S's frequencies and attention scaling in a device table (row 0: S <= switch; longrope: row 1,
    every S past it; dynamic: row S - switch), so that a step's cos/sin follow from its tokens'
    positions and S by torch ops alone (no host sync: CUDA graphs capture it). Dynamic's rows are
    filled by `ensure` before a call needs them (HF's own function, on the device HF runs it on);
    the table never moves, so captured graphs keep reading it."""

    def __init__(self, rotary_emb: torch.nn.Module, length: int, device: torch.device):
        self.hf_module = rotary_emb  # the model's own: dynamic's grown state (generate() reads it)
        self.host = LengthDependentRope(rotary_emb)
        self.kind, self.switch, self.length = self.host.kind, self.host.switch, length
        rows = 2 if self.kind == "longrope" else max(length - self.switch, 0) + 1
        half = self.host.original.shape[0]
        self.inv_freq = torch.zeros(rows, half, dtype=torch.float32, device=device)  # [rows, rot_dim / 2]
        self.scaling = torch.zeros(rows, dtype=torch.float32, device=device)  # [rows]
        self.filled = 0  # rows computed so far
        self.ensure(self.switch + 1 if self.kind == "longrope" else self.switch)

    def ensure(self, length: int) -> None:
        """Compute the rows of every S up to `length` (at most self.length) not computed yet."""
        rows = min(length - self.switch, self.inv_freq.shape[0] - 1) + 1 if length > self.switch else 1
        for row in range(self.filled, rows):
            inv_freq, scaling = self.host.frequencies(self.switch + row if row else self.switch)
            self.inv_freq[row].copy_(inv_freq)
            self.scaling[row] = scaling
        self.filled = max(self.filled, rows)

    def cos_sin(self, positions: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """positions [T], lens [T] (each token's S) -> [T, rot_dim] fp32, cos halves then sin
        halves, as HF's forward computes them for that S: cos(position * inv_freq) * scaling."""
        # clamped to the table, not to the rows filled: a captured graph keeps the bound
        row = (lens.long() - self.switch).clamp_(0, self.inv_freq.shape[0] - 1)  # [T]
        freqs = self.inv_freq[row] * positions.float()[:, None]  # [T, rot_dim / 2]
        scale = self.scaling[row][:, None]  # [T, 1]
        return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)

    def admit(self, prompt_len: int, total_len: int) -> str | None:
        """An LLM request (run as HF's generate of it alone): why it cannot give HF's tokens, or
        None with the rows of every S it reaches computed."""
        reason = crossing_reason(self.hf_module.config, prompt_len, total_len)
        if reason is None:
            self.ensure(total_len)
        return reason

    def call_base(self, longest: int) -> int:
        """The base S of a generate() call whose longest prompt is `longest`: HF's S is the
        forward's largest position + 1, but a dynamic module that an earlier HF forward grew keeps
        its grown frequencies (transformers' dynamic_rope_update) until a forward shorter than
        max_position_embeddings resets it, so its S is at least the grown one for the whole call."""
        cached = getattr(self.hf_module, "max_seq_len_cached", None)
        if self.kind != "dynamic" or not isinstance(cached, torch.Tensor) or longest < self.switch:
            return longest
        return max(longest, int(cached))


def phi3_drops_cache(config) -> bool:
    """Whether transformers' Phi-3 generate (phi3, phimoe with longrope) discards its KV cache at
    the step that first passes original_max_position_embeddings: 5.24 then recomputes the whole
    sequence (every earlier K rotated with the long factors); 5.17 goes on without the cache it
    dropped (its later steps see no earlier K). pagedkv does neither, so it refuses such sequences."""
    return config.model_type in ("phi3", "phimoe") and rope_type(config) == "longrope"


def crossing_reason(config, prompt_len: int, total_len: int) -> str | None:
    """Why a sequence fed `prompt_len` tokens (the padded width of a generate() batch) and run to
    `total_len` cannot give HF's tokens, or None: Phi-3 crossing the switch, where HF drops its cache."""
    switch = int(getattr(config, "original_max_position_embeddings", 0) or 0)
    if not phi3_drops_cache(config) or not prompt_len <= switch < total_len - 1:
        return None
    import transformers
    what = ("recomputes the whole sequence with the long rope factors" if not transformers.__version__.startswith("5.17.")
            else "drops its KV cache and goes on without it")
    return (f"a sequence from {prompt_len} to {total_len} tokens crosses original_max_position_embeddings "
            f"({switch}), where transformers {transformers.__version__}'s Phi-3 generate() {what}, which "
            f"pagedkv does not; keep prompt + new tokens <= {switch + 1}, or start with a prompt longer than {switch}")
