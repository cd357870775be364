"""Every causal-LM model type of the installed transformers and how pagedkv runs it: natively,
by the model's own HF modules (the fallback path), or not, with the reason. Writes the Markdown
table kept as docs/model_types.md (`python -m pagedkv.tools.model_types > docs/model_types.md`;
tests/test_model_types.py checks the file against the installed transformers of the same version).

A type is native or fallback by registry's lists; each such type is also built from its default
config with one layer on the meta device (no weights, nothing runs) and asked
`unsupported_reason(model, placement=False)`. A checkpoint's own config can still differ (a
window, a softcap, a head size).
"""

from __future__ import annotations

import sys

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from pagedkv.models import registry

# Config fields whose defaults are None in these types' configs, which their modules cannot build from.
DEFAULTS_MISSING = {"hunyuan_v1_dense": dict(head_dim=128), "hunyuan_v1_moe": dict(head_dim=128),
                    "ministral": dict(head_dim=128),
                    "nemotron": dict(head_dim=128, num_key_value_heads=8)}


def default_model(model_type: str):
    """The type's *ForCausalLM from its default config, one layer, on meta."""
    with torch.device("meta"):
        config = AutoConfig.for_model(model_type, num_hidden_layers=1, **DEFAULTS_MISSING.get(model_type, {}))
        return AutoModelForCausalLM.from_config(config)


def how_it_runs(model_type: str) -> tuple[str, str]:
    """(path, note): path "native" or "fallback" (the type's list in models/registry.py) or
    "refused"; note what refuses the type, or its default config, else empty."""
    if model_type in registry.NATIVE_MODEL_TYPES:
        path = "native"
    elif model_type in registry.FALLBACK_MODEL_TYPES:
        path = "fallback"
    else:
        differs = registry.OTHER_DECODERS.get(model_type)
        return "refused", differs or "no native decoder, and not on the fallback path's tested list"
    try:
        model = default_model(model_type)
    except Exception as err:  # noqa: BLE001 (any error of HF's own constructor is the answer)
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        return path, f"its default config does not build here ({type(err).__name__}: {first[:120]})"
    reason = registry.unsupported_reason(model, placement=False)
    return path, "" if reason is None else f"its default config is refused: {reason}"


def table() -> str:
    """The Markdown document: a header naming the transformers version, then one row per type."""
    rows = [how_it_runs(t) for t in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)]
    counts = {p: sum(1 for path, _ in rows if path == p) for p in ("native", "fallback", "refused")}
    lines = [
        "# Model types",
        "",
        f"Every causal-LM model type of transformers {transformers.__version__} and how pagedkv runs it "
        "(`python -m pagedkv.tools.model_types`). native: pagedkv's own fused decoder, CUDA graphs; "
        "fallback: the model's own HF modules over pagedkv's cache (CUDA graphs where they allow); refused: "
        "`pagedkv.UnsupportedModel`, naming what differs where that is known. Each native and "
        "fallback type is also built from its default config (one layer, no weights): a note says "
        "what of that config is refused (e.g. a head size the CUDA kernels lack). "
        f"{counts['native']} native, {counts['fallback']} fallback, {counts['refused']} refused. "
        "A checkpoint's config may differ from the default (see docs/limits.md).",
        "",
        "| model_type | path | note |",
        "|---|---|---|",
    ]
    for model_type, (path, note) in zip(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), rows):
        lines.append(f"| {model_type} | {path} | {note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    sys.stdout.write(table())


if __name__ == "__main__":
    main()
