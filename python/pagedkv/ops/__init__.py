"""Typed wrappers over ``torch.ops.pagedkv.*`` with fake (meta) implementations for torch.compile.

Every op writes into tensors it is given and returns nothing, so it allocates nothing and can be
captured in a CUDA graph. Wrappers that return a tensor allocate it only when ``out`` is None.
Shapes and dtypes are checked in C++; a bad call raises RuntimeError naming the argument.

One module per concept, each op's fake beside its wrapper; importing this package imports them all,
so every fake is registered before anything traces an op. ``from pagedkv import ops; ops.linear``
and ``from pagedkv.ops import linear`` both keep working: the names are re-exported here.
"""

from __future__ import annotations

import torch  # noqa: F401  (kept: `pagedkv.ops.torch` was importable)

from pagedkv.ops._common import _C, _kv_scales, _ops  # noqa: F401
from pagedkv.ops.activation import _silu_and_mul_fake, silu_and_mul  # noqa: F401
from pagedkv.ops.attention import (  # noqa: F401
    _num_sms,
    _paged_decode_attention_fake,
    _paged_prefill_attention_fake,
    paged_decode_attention,
    paged_decode_num_splits,
    paged_decode_workspace,
    paged_prefill_attention,
    paged_prefill_num_splits,
    paged_prefill_workspace,
)
from pagedkv.ops.cache import (  # noqa: F401
    _copy_blocks_fake,
    _rope_and_write_kv_fake,
    copy_blocks,
    rope_and_write_kv,
)
from pagedkv.ops.lookup import _lookup_accept_fake, _lookup_propose_fake, lookup_accept, lookup_propose  # noqa: F401
from pagedkv.ops.matmul import _gate_up_silu_fake, _linear_fake, gate_up_silu, linear  # noqa: F401
from pagedkv.ops.norm import (  # noqa: F401
    _fused_add_rms_norm_fake,
    _rms_norm_fake,
    fused_add_rms_norm,
    rms_norm,
)
from pagedkv.ops.peer import _peer_all_reduce_add_rms_norm_fake, peer_all_reduce_add_rms_norm  # noqa: F401
from pagedkv.ops.sampling import (  # noqa: F401
    _advance_decode_rows_fake,
    _sample_fake,
    advance_decode_rows,
    sample,
)
