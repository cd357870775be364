"""Quick start: what pagedkv was built with, and its ops on the GPU if there is one, else the CPU.

Run it with `scripts/demo.sh` (which sets the machine up first) or `python examples/quickstart.py`.
"""

from __future__ import annotations

import torch

import pagedkv
from pagedkv import ops


def main() -> None:
    device = "cuda" if torch.cuda.is_available() and pagedkv.with_cuda else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    print(f"pagedkv {pagedkv.__version__}: {pagedkv.build_info}")
    print(f"torch {torch.__version__}; running on {device} ({dtype})")

    hidden = 3584  # Qwen2.5-7B's hidden size
    x = torch.randn(8, hidden, device=device, dtype=dtype)
    residual = torch.randn_like(x)
    weight = torch.rand(hidden, device=device, dtype=dtype) + 0.5

    expected_residual = x + residual
    h = expected_residual.float()
    expected = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)

    ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    print(
        f"fused_add_rms_norm on [8, {hidden}]: max |pagedkv - PyTorch| = "
        f"{(x.float() - expected.float()).abs().max().item():.3g} (output), "
        f"{(residual.float() - expected_residual.float()).abs().max().item():.3g} (residual)"
    )


if __name__ == "__main__":
    main()
