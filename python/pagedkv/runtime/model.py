"""An HF model as pagedkv runs it: its weights taken once (QKV and gate/up fused in place; one
rank's shard under tensor parallelism), its rotary table, where and in what dtype it runs.
Made on first use and kept on the HF model, so generate() and every pagedkv.LLM of one model
share one copy of the weights; each of them binds its own KV cache to it (runtime/runner.py).

    torch.distributed.init_process_group("nccl")           # e.g. under torchrun
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16)  # on the CPU
    pagedkv.tensor_parallel(model)                         # this rank's shard -> cuda:LOCAL_RANK
    out = pagedkv.generate(model, input_ids.to(f"cuda:{local_rank}"), max_new_tokens=64)
    llm = pagedkv.LLM(model, ...)                          # or serve many requests

A model too large to load whole is sharded from its checkpoint instead: each rank reads only its
part of the safetensors files (models/checkpoint_shards.py) beside an empty HF skeleton:

    model = pagedkv.tensor_parallel_from_pretrained(folder, dtype=torch.bfloat16)

Under tensor parallelism every rank makes the same calls with the same arguments and gets the
same tokens back. Megatron's split (models/sharding.py) costs each layer two all-reduces and no
other exchange; each rank's KV cache holds its own kv heads only; the LM head's logits are
all-gathered, so every rank samples the same token from the same logits. Collectives go
through torch.distributed (NCCL on CUDA, gloo on the CPU), inside CUDA graphs too.

The model may change after pagedkv took its weights. In-place writes (optimizer steps,
load_state_dict, ``p.data.copy_``) need nothing: the weights pagedkv runs are HF's own tensors
(views of the fused ones). Anything else (a new tensor or module, another dtype or device, a
resized vocabulary, a config field or a module's setting such as a norm's epsilon) changes the
model's fingerprint, checked once per generate() call:
generate() then takes the weights again; an LLM, bound to the old ones, and a tensor-parallel
shard, a copy, refuse with ModelChanged. A copy of the model (deepcopy, pickle, torch.save)
carries no PreparedModel and takes its own weights on first use.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from pagedkv.layers.moe import moe_weight_tensors
from pagedkv.layers.rotary import LENGTH_DEPENDENT_ROPE_TYPES, RopeByLength, build_cos_sin_cache, max_length, rope_type
from pagedkv.models.checkpoint_shards import TensorReader, open_checkpoint, read_shard
from pagedkv.models.cohere import COHERE_MODEL_TYPES, CohereWeights, extract_cohere_weights
from pagedkv.models.fallback import FallbackWeights, fallback_weights
from pagedkv.models.gemma import GEMMA_MODEL_TYPES, GemmaWeights, extract_gemma_weights
from pagedkv.models.hf_quantized import QuantizedLinears, find_quantized, quantized_state, read_hf_quantized
from pagedkv.models.interleaved_rope import PERMUTED_ROWS_MODEL_TYPES, interleaved_cos_sin
from pagedkv.models.llama import DecoderWeights, extract_weights
from pagedkv.models.native_weights import NativeWeights
from pagedkv.models.windows import layer_type_cos_sin
from pagedkv.models.olmo2 import OLMO2_MODEL_TYPES, Olmo2Weights, extract_olmo2_weights
# PREPARED_ATTR: the attribute of the HF model that holds its PreparedModel (in the registry: its
# support check lets a skeleton on meta run only with a shard).
from pagedkv.models import registry
from pagedkv.models.registry import (PREPARED_ATTR, SUPPORTED_MODEL_TYPES, UnsupportedModel, check_supported,
                                     support_path)
from pagedkv.models.sharding import shard_weights
from pagedkv.quant.dispatch import linear_tensors
from pagedkv.runtime.fingerprint import describe_change, fingerprint
from pagedkv.runtime.parallel import TensorParallel
from pagedkv.runtime.peer_all_reduce import PeerAllReduce

if TYPE_CHECKING:
    from transformers import PreTrainedModel


M = TypeVar("M", bound=torch.nn.Module)
logger = logging.getLogger(__name__)


class ModelChanged(RuntimeError):
    """The model changed since pagedkv took its weights, and what took them cannot follow: an
    existing pagedkv.LLM, or a tensor-parallel shard (a copy of the weights)."""


def _changed_error(change: str, tp: bool, who: str) -> ModelChanged:
    if tp:
        return ModelChanged(
            f"{who}: pagedkv.tensor_parallel copied this rank's shard of the weights, and the model "
            f"changed since: {change}; a shard cannot follow changes (in-place writes included): "
            "load the new weights into a fresh model and call pagedkv.tensor_parallel on it")
    return ModelChanged(
        f"{who}: the model changed since this engine took its weights: {change}; make a new "
        "pagedkv.LLM for the changed model (in-place writes, e.g. optimizer steps or "
        "load_state_dict, are seen without one)")


@dataclasses.dataclass(eq=False)
class PreparedModel:
    # A native family's (models/native_weights.py), or FallbackWeights (models/fallback.py).
    weights: NativeWeights | FallbackWeights
    # [max_positions, rot_dim] fp32 from the model's rotary (Gemma, OLMo-2/3: [tables, ...]); None: fallback
    cos_sin: torch.Tensor | None
    device: torch.device  # where the forward runs (a shard's device may differ from the HF model's)
    dtype: torch.dtype
    max_positions: int
    tp: TensorParallel | None
    # generate()'s fixed-batch runner with its cache (runtime/fixed_batch.py), made on first call.
    fixed_batch: Any = None
    # generate() calls on one model from several threads run one at a time (they share the cache).
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    fingerprint: tuple = ()  # the model's, once the weights were taken (see fingerprint())
    # "awq"/"gptq": int4 checkpoint weights read by pagedkv (runtime/quantized.py) beside a skeleton
    quant: str | None = None
    # rope "dynamic" / "longrope" (cos_sin None): each step's cos/sin from its tokens' S (layers/rotary.py)
    rope: RopeByLength | None = None
    # linears HF loaded quantized, read repacked (models/hf_quantized.py): their in-place writes count
    hf_quantized: bool = False

    @classmethod
    def of(cls, model, tp: TensorParallel | None = None, reader: TensorReader | None = None) -> PreparedModel:
        """reader (with tp): this rank's shard is read through it; `model` is a skeleton on meta."""
        check_supported(model, placement=reader is None)
        if tp is None and support_path(model) == "fallback":  # HF's modules: nothing to take
            param = next(model.parameters())
            logger.info("runs %s by its own modules (pagedkv's fallback path: decode steps captured as "
                        "CUDA graphs where they allow)", type(model).__name__)
            return cls(fallback_weights(model), None, param.device, param.dtype,
                       int(model.config.max_position_embeddings), None,
                       fingerprint=fingerprint(model, training=True))
        # Not in inference mode (generate() runs in it): HF's parameters become views of the
        # fused tensors, and views of inference tensors could never be trained again.
        with torch.inference_mode(False), torch.no_grad():
            param = next(model.parameters())
            device = param.device if tp is None else tp.device
            found = find_quantized(model, registry.QUANTIZED_MODEL_TYPES) if reader is None else None
            if reader is not None:
                weights = read_shard(model, reader, tp.rank, tp.world_size, tp.device, param.dtype)
            elif isinstance(found, QuantizedLinears):  # the packed tensors, repacked (tensor_parallel refuses)
                weights = read_hf_quantized(model, found)
                param = model.model.embed_tokens.weight  # the activations' dtype (not a packed tensor's)
            elif model.config.model_type in GEMMA_MODEL_TYPES:  # never sharded (tensor_parallel refuses)
                weights = extract_gemma_weights(model)
            elif model.config.model_type in OLMO2_MODEL_TYPES:  # never sharded (tensor_parallel refuses)
                weights = extract_olmo2_weights(model)
            elif model.config.model_type in COHERE_MODEL_TYPES:  # never sharded (tensor_parallel refuses)
                weights = extract_cohere_weights(model)
            else:
                weights = extract_weights(model)
                if tp is not None:
                    weights = shard_weights(weights, tp.rank, tp.world_size, tp.device)
            max_positions = int(model.config.max_position_embeddings)
            # A skeleton's rotary module is on meta too: a fresh one of its class (on the CPU, as HF
            # builds it; the class, since a config's model_type may not name its module: internlm3).
            rotary = model.model.rotary_emb
            rope = None
            if rope_type(model.config) in LENGTH_DEPENDENT_ROPE_TYPES and isinstance(weights, DecoderWeights):
                max_positions = max_length(model.config)
                rope, cos_sin = RopeByLength(rotary, max_positions, device), None
            elif isinstance(weights, (GemmaWeights, Olmo2Weights)):  # Gemma-3, OLMo-3: a table per layer type
                cos_sin = layer_type_cos_sin(model, max_positions, device)
            elif isinstance(weights, CohereWeights):  # its rotary repeats each frequency twice in a row
                cos_sin = interleaved_cos_sin(rotary, max_positions, device)
            else:
                cos_sin = build_cos_sin_cache(model.config, max_positions, device,
                                              rotary_emb=type(rotary)(model.config) if param.is_meta else rotary)
        logger.info("took the weights of %s: %s on %s, %.1f MB%s", type(model).__name__,
                    str(param.dtype).removeprefix("torch."), device, weight_bytes(weights) / 1e6,
                    "" if tp is None else f" (rank {tp.rank} of {tp.world_size}'s shard)")
        packed = quantized_state(model, registry.QUANTIZED_MODEL_TYPES) if isinstance(found, QuantizedLinears) else ()
        return cls(weights, cos_sin, device, param.dtype, max_positions, tp,
                   fingerprint=fingerprint(model, versions=_copies(model, tp), buffer_versions=True) + packed, rope=rope,
                   hf_quantized=bool(packed))

    def change_in(self, model) -> str | None:
        """None if `model` is as these weights were taken from it, else its first change.
        A shard (tp) is a copy: in-place writes count too."""
        # HF's modules run a fallback model: their training flags count too
        fallback = isinstance(self.weights, FallbackWeights)
        now = fingerprint(model, versions=_copies(model, self.tp), training=fallback, buffer_versions=not fallback)
        if self.hf_quantized:  # repacked copies: writes in place count (models/hf_quantized.py)
            now += quantized_state(model, registry.QUANTIZED_MODEL_TYPES)
        return None if now == self.fingerprint else describe_change(self.fingerprint, now)

    def __reduce__(self):
        # copy.deepcopy, pickle and torch.save of the HF model: the copy gets no PreparedModel
        # (a cache manager, locks and CUDA graphs do not copy, and these weights are the
        # original's) and takes its own weights on first use.
        return type(None), ()


def _copies(model, tp: TensorParallel | None) -> bool:  # a shard, or permuted q/k rows: writes count
    return tp is not None or model.config.model_type in PERMUTED_ROWS_MODEL_TYPES


def weight_bytes(weights: NativeWeights | FallbackWeights) -> int:
    """Bytes of the distinct tensors pagedkv runs (a tied LM head counted once)."""
    if isinstance(weights, FallbackWeights):
        return sum(p.numel() * p.element_size() for p in weights.model.parameters())
    tensors = [weights.embed, weights.final_norm, weights.lm_head]
    for layer in weights.layers:
        # W4A16 weights (and parts of a linear): the bytes of their packed tensors
        tensors += [t for f in dataclasses.fields(layer) for t in linear_tensors(getattr(layer, f.name))]
        tensors += moe_weight_tensors(layer.moe) if getattr(layer, "moe", None) is not None else []
    unique = {id(t): t for t in tensors if isinstance(t, torch.Tensor)}
    return sum(t.numel() * t.element_size() for t in unique.values())


_PREPARING = threading.Lock()  # two threads' first calls take a model's weights once


def prepared(model) -> PreparedModel:
    """The model's PreparedModel, made on first use and kept on the model; made again when the
    model changed since (see fingerprint()). A tensor-parallel shard raises ModelChanged."""
    state = getattr(model, PREPARED_ATTR, None)
    if state is not None and state.change_in(model) is None:
        return state
    with _PREPARING:
        state = getattr(model, PREPARED_ATTR, None)
        change = None if state is None else state.change_in(model)
        if state is not None and change is None:
            return state
        if state is not None:
            if state.quant is not None:  # the weights were read from a checkpoint: nothing to take again
                raise ModelChanged(f"pagedkv: the model changed since pagedkv read its {state.quant.upper()} "
                                   f"checkpoint: {change}; load it again with pagedkv.from_pretrained_quantized")
            if state.tp is not None:
                raise _changed_error(change, True, "pagedkv")
            logger.info("the model changed since pagedkv took its weights (%s): taking them again", change)
            with state.lock:  # a generate() still running on the old weights ends first
                state.fixed_batch = None  # its cache and CUDA graphs go with the old weights
            setattr(model, PREPARED_ATTR, None)
            state = None
        state = PreparedModel.of(model)
        setattr(model, PREPARED_ATTR, state)
    return state


def check_unchanged(model, state: PreparedModel) -> None:
    """Raise ModelChanged if `model` changed since `state` took its weights (pagedkv.LLM: its
    cache, CUDA graphs and running requests are bound to them)."""
    change = state.change_in(model)
    if change is not None:
        raise _changed_error(change, state.tp is not None, "pagedkv.LLM")


def device_of(model) -> torch.device:
    """Where pagedkv runs `model`: a tensor-parallel shard's device (may differ from the HF
    model's own), else the model's (where it is now: generate() follows a moved model)."""
    state = getattr(model, PREPARED_ATTR, None)
    if state is not None and (state.tp is not None or state.quant is not None):
        return state.device
    return next(model.parameters()).device


def _default_device(world_rank: int) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", world_rank % torch.cuda.device_count()))
    return torch.device("cuda", local)


def tensor_parallel(model: M, group: dist.ProcessGroup | None = None,
                    device: torch.device | str | None = None, all_reduce: str = "auto",
                    reader: TensorReader | None = None) -> M:
    """Shard `model` over the ranks of `group` (default: the whole world) for pagedkv.generate
    and pagedkv.LLM.

    Every rank calls this, then generate() (input_ids on `device`) or an LLM's methods with the
    same arguments; every rank returns the same tokens. `model` may stay where it was loaded (the CPU, typically): this
    rank's shard is copied to `device` (default cuda:LOCAL_RANK, or the CPU without CUDA). Needs
    torch.distributed initialised. Returns the model.

    all_reduce: how decode steps sum the ranks' partial products. "auto" (default): over peer
    memory (one launch with the add + RMSNorm after it) when every rank is a GPU of this host
    that can address the others, else NCCL; "peer" insists (raises where it cannot); "nccl"
    always NCCL. Prefill chunks and batches of more than
    peer_all_reduce.MAX_BYTES_OVER_RANKS / world_size bytes use NCCL either way.

    reader: read this rank's shard through it (models/checkpoint_shards.py) instead of taking it
    from the model, then an empty skeleton on the meta device (checkpoint_shards.empty_model):
    what tensor_parallel_from_pretrained does with a checkpoint, a benchmark with random values."""
    given, model = model, registry.compiled_original(model)  # a torch.compile wrapper: its original
    check_supported(model, placement=reader is None)
    if model.config.model_type in registry.FALLBACK_MODEL_TYPES:  # read at call time (tests extend it)
        raise UnsupportedModel(f"pagedkv.tensor_parallel: model_type {model.config.model_type!r} runs by "
                               "its own HF modules (pagedkv's fallback path), which pagedkv does not shard; "
                               f"tensor parallelism runs: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model.config.model_type in registry.MOE_MODEL_TYPES:
        raise UnsupportedModel(f"pagedkv.tensor_parallel: model_type {model.config.model_type!r} has "
                               "mixture-of-experts layers, which pagedkv does not shard yet; run it on one "
                               "device with pagedkv.generate or pagedkv.LLM")
    if model.config.model_type in GEMMA_MODEL_TYPES:
        raise UnsupportedModel(f"pagedkv.tensor_parallel: model_type {model.config.model_type!r} (models/gemma.py) "
                               "is not sharded yet; run it on one device with pagedkv.generate or pagedkv.LLM; "
                               f"tensor parallelism runs: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model.config.model_type in OLMO2_MODEL_TYPES + registry.SCALED_MODEL_TYPES + PERMUTED_ROWS_MODEL_TYPES:
        raise UnsupportedModel(f"pagedkv.tensor_parallel: model_type {model.config.model_type!r} is not sharded "
                               "yet (OLMo-2's q/k norms span all heads; Granite's multipliers and the permuted q/k "
                               "rows of interleaved rotary types are not in the shards); run it on one device")
    if reader is None and isinstance(find_quantized(model, registry.QUANTIZED_MODEL_TYPES), QuantizedLinears):
        raise UnsupportedModel("pagedkv.tensor_parallel: a model loaded quantized (models/hf_quantized.py) is not "
                               "sharded; run it on one device with pagedkv.generate or pagedkv.LLM")
    if rope_type(model.config) in LENGTH_DEPENDENT_ROPE_TYPES:
        raise UnsupportedModel(f"pagedkv.tensor_parallel: rope type {rope_type(model.config)!r} (cos/sin per "
                               "sequence length) is not sharded yet; run it on one device")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("pagedkv.tensor_parallel: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group first (e.g. run under torchrun)")
    device = torch.device(device) if device is not None else _default_device(dist.get_rank())
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    backend = dist.get_backend(group)
    allowed = {"cuda": ("nccl",), "cpu": ("gloo",)}.get(device.type)
    if allowed is None or backend not in allowed:
        raise ValueError(f"pagedkv.tensor_parallel: device {device} with the {backend!r} backend is not "
                         "supported; allowed: a CUDA device with 'nccl', or the CPU with 'gloo'")
    if getattr(model, PREPARED_ATTR, None) is not None:
        raise ValueError("pagedkv.tensor_parallel: pagedkv already runs this model (a generate() "
                         "call, an LLM or an earlier tensor_parallel took its weights); shard a "
                         "freshly loaded model instead")
    if all_reduce not in ("auto", "peer", "nccl"):
        raise ValueError(f"pagedkv.tensor_parallel: all_reduce={all_reduce!r}; allowed: 'auto', 'peer', 'nccl'")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds each rank to the current device
    peer = None
    if device.type == "cuda" and all_reduce != "nccl" and dist.get_world_size(group) > 1:
        peer = PeerAllReduce.connect(group, device)
    if all_reduce == "peer" and peer is None:
        raise ValueError("pagedkv.tensor_parallel: all_reduce='peer' needs every rank on a GPU of "
                         "this host that can address every other rank's memory (CUDA peer access)")
    tp = TensorParallel(rank=dist.get_rank(group), world_size=dist.get_world_size(group),
                        device=device, group=group, peer=peer)
    setattr(model, PREPARED_ATTR, PreparedModel.of(model, tp, reader))
    if reader is not None:
        model.register_forward_pre_hook(_skeleton_forward)
    return given


def tensor_parallel_from_pretrained(path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                                    group: dist.ProcessGroup | None = None,
                                    device: torch.device | str | None = None,
                                    **options: Any) -> PreTrainedModel:
    """pagedkv.tensor_parallel of a checkpoint never loaded whole: each rank reads only its shard
    of the safetensors files in `path` (a local folder save_pretrained wrote: config.json, and
    model.safetensors or model.safetensors.index.json with its files), cast to `dtype`, onto
    `device` (default cuda:LOCAL_RANK, or the CPU without CUDA); `options` as tensor_parallel's.
    Every rank calls it; then generate() and LLM run as after tensor_parallel.

    Returns the HF model as an empty skeleton on the meta device (its config, generation config
    and names): HF's own forward and generate cannot run on it and say so; pagedkv.patch(model)
    makes model.generate run pagedkv. Raises ValueError for a path that is not a local folder,
    FileNotFoundError naming a missing file, ValueError naming a missing or misshapen tensor,
    UnsupportedModel for a model pagedkv does not run or sizes that do not split over the ranks."""
    model, reader = open_checkpoint(path, dtype)
    return tensor_parallel(model, group, device, reader=reader, **options)


def _skeleton_forward(module, args):
    raise RuntimeError(f"{type(module).__name__}'s HF modules are empty (meta): its weights are this rank's shard, "
                       "held by pagedkv (tensor_parallel_from_pretrained), so HF's forward and generate cannot "
                       "run; use pagedkv.generate(model, ...), pagedkv.patch(model) (model.generate then runs "
                       "pagedkv) or pagedkv.LLM(model)")
