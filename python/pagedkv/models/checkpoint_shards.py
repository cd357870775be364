"""One tensor-parallel rank's weights read straight from a checkpoint, never the whole model: a
model too large for one GPU, or for one host's memory (Llama-70B: 140 GB in bf16), shards
without being loaded first.

    model, reader = open_checkpoint(folder, torch.bfloat16)  # config -> HF skeleton on meta
    weights = read_shard(model, reader, rank, world_size, device, torch.bfloat16)

The HF model is built on the meta device (shapes, no storage) for its config, names and shapes;
each of this rank's slices is read from the safetensors files (memory-mapped: only the slice's
bytes are copied), cast and moved to the device. The split is models/sharding.py's, so the
result equals shard_weights of the loaded model. A reader is anything with shape(name) and
read(name, rows, cols): benchmarks feed random slices through one, with no checkpoint at all.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Protocol

import torch

from pagedkv.models.registry import check_supported
from pagedkv.models.llama import DecoderWeights
from pagedkv.models.native_weights import attention_scale, norm_eps
from pagedkv.models.sharding import WHOLE, rank_slices, shard_decoder
from pagedkv.models.windows import layer_windows

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class TensorReader(Protocol):
    """A checkpoint's tensors by HF's names, read a slice at a time."""

    def shape(self, name: str) -> tuple[int, ...]:
        """The whole tensor's shape; ValueError naming it (and where it was looked for) if absent."""

    def read(self, name: str, rows: slice = WHOLE, cols: slice | None = None) -> torch.Tensor:
        """Rows `rows` (and columns `cols` of a matrix; None: all) of the tensor, as stored."""


class SafetensorsReader:
    """The tensors of a folder save_pretrained wrote: model.safetensors, or
    model.safetensors.index.json and the files it names (each opened once, memory-mapped)."""

    def __init__(self, folder: str | os.PathLike):
        from safetensors import safe_open

        self._safe_open = safe_open
        folder = pathlib.Path(folder)
        if (folder / INDEX).is_file():
            self.listing = folder / INDEX
            weight_map = json.loads(self.listing.read_text())["weight_map"]
            self.files = {name: folder / file for name, file in weight_map.items()}
            for name, file in self.files.items():
                if not file.is_file():
                    raise FileNotFoundError(f"pagedkv: {file}, which {self.listing} names for {name!r}, is missing")
        elif (folder / SINGLE).is_file():
            self.listing = folder / SINGLE
            with safe_open(self.listing, framework="pt") as f:
                self.files = dict.fromkeys(f.keys(), self.listing)
        else:
            raise FileNotFoundError(f"pagedkv: neither {SINGLE} nor {INDEX} in {folder}: pagedkv reads the "
                                    "safetensors checkpoints save_pretrained writes (not pytorch_model.bin)")
        self._open: dict[pathlib.Path, object] = {}

    def where(self, name: str) -> str:
        """The file that holds `name` (for messages)."""
        return self.files[name].name

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, rows: slice = WHOLE, cols: slice | None = None) -> torch.Tensor:
        part = self._slice(name)
        if not part.get_shape():  # a 0-dim scalar (an FP8 per-tensor scale) takes no slice
            return part[()]
        return part[rows] if cols is None else part[rows, cols]

    def _slice(self, name: str):
        file = self.files.get(name)
        if file is None:
            raise ValueError(f"pagedkv: the checkpoint has no tensor {name!r} ({self.listing} lists "
                             "none by that name); the model's config expects it")
        handle = self._open.get(file)
        if handle is None:
            handle = self._open[file] = self._safe_open(file, framework="pt")
        if name not in handle.keys():
            raise ValueError(f"pagedkv: tensor {name!r} is not in {file.name}, where {self.listing.name} "
                             "says it is")
        return handle.get_slice(name)


def open_checkpoint(path: str | os.PathLike, dtype: torch.dtype) -> tuple[torch.nn.Module, SafetensorsReader]:
    """(the HF model of the folder's config on the meta device, in `dtype`, with its generation
    config; a reader of its safetensors files). Raises ValueError for anything but a local
    folder, FileNotFoundError naming a missing file, UnsupportedModel for a model pagedkv does
    not run."""
    from transformers import AutoConfig, GenerationConfig

    folder = pathlib.Path(path)
    if not folder.is_dir():
        raise ValueError(f"pagedkv: {str(path)!r} is not a local folder; give the folder save_pretrained "
                         f"wrote (config.json, and {SINGLE} or {INDEX} with its files). Hub names are "
                         "not downloaded: fetch one first, e.g. with huggingface_hub.snapshot_download")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"pagedkv: no config.json in {folder}")
    model = empty_model(AutoConfig.from_pretrained(folder), dtype)
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model, SafetensorsReader(folder)


def empty_model(config, dtype: torch.dtype) -> torch.nn.Module:
    """The HF *ForCausalLM of `config` on the meta device (no storage), checked to be one pagedkv
    runs (its weights aside: they are read per rank)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    check_supported(model, placement=False)
    return model.eval()


def read_shard(model, reader: TensorReader, rank: int, world_size: int, device: torch.device | str,
               dtype: torch.dtype) -> DecoderWeights:
    """Rank `rank` of `world_size`'s weights of `model` (a skeleton from empty_model: its names
    and shapes) read through `reader`, cast to `dtype`, on `device`: equal to
    shard_weights(extract_weights(loaded model), rank, world_size, device). Each split weight is
    read 1/world_size per rank; the embedding and norms whole. Raises UnsupportedModel if the
    sizes do not split (before any read), ValueError naming a missing or misshapen tensor."""
    config, inner = model.config, model.model
    params = dict(model.named_parameters())  # a tied LM head is listed once, as the embedding
    tied = model.lm_head.weight is inner.embed_tokens.weight
    attn0 = inner.layers[0].self_attn
    vocab = int(model.lm_head.weight.shape[0])
    s = rank_slices(rank, world_size, config.num_attention_heads, config.num_key_value_heads, attn0.head_dim,
                    int(config.intermediate_size), vocab)

    hd, inter = attn0.head_dim, int(config.intermediate_size)
    q_rows, kv_rows = config.num_attention_heads * hd, config.num_key_value_heads * hd
    # Phi-3's fused tensors as stored: the split's rows of q/k/v (gate/up) at their offsets in them.
    fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", q_rows), "v_proj": ("qkv_proj", q_rows + kv_rows),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", inter)}

    def part(name: str, rows: slice, cols: slice | None) -> torch.Tensor | None:
        if tied and name == "lm_head.weight":
            name = "model.embed_tokens.weight"
        at, _, kind = name.rpartition(".")
        stem, _, proj = at.rpartition(".")
        if name not in params and proj in fused:
            into, offset = fused[proj]
            name = f"{stem}.{into}.{kind}"
            rows = slice(rows.start + offset, rows.stop + offset)  # the split's rows are concrete
        param = params.get(name)
        if param is None:
            return None
        stored = reader.shape(name)
        if stored != tuple(param.shape):
            where = f" in {reader.where(name)}" if hasattr(reader, "where") else ""
            raise ValueError(f"pagedkv: tensor {name!r}{where} has shape {list(stored)}; the config "
                             f"makes it {list(param.shape)}")
        return reader.read(name, rows, cols).to(device=device, dtype=dtype).contiguous()

    return shard_decoder(part, s, len(inner.layers), vocab, attn0.head_dim, norm_eps(model, config.rms_norm_eps),
                         attention_scale(inner.layers), layer_windows(config))
