"""W3 shapes (32 q / 8 kv heads, head_dim 128, block 16) timed with a bf16 cache and with an fp8
one at every forced split count (0 = the automatic plan), to see whether more splits (more warps
per SM) help the fp8 loop: python3 lab/fp8_decode_splits.py (GPU)."""
import torch
from pagedkv import ops
torch.manual_seed(0)
dev = "cuda"
def run(batch, ctx, fp8, splits=0):
    hq, hkv, d, bs = 32, 8, 128, 16
    nb = batch * ctx // bs + 8
    k = torch.randn(nb, bs, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kw = {}
    if fp8:
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        one = torch.ones(1, device=dev)
        kw = dict(k_scale=one, v_scale=one.clone())
    table = torch.randperm(nb - 8, device=dev, dtype=torch.int32)[: batch * ctx // bs].view(batch, -1)
    lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    q = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16)
    ws = ops.paged_decode_workspace(q, k, table, splits)
    out = torch.empty_like(q)
    f = lambda: ops.paged_decode_attention(q, k, v, table, lens, d ** -0.5, out=out, workspace=ws, num_splits=splits, **kw)
    for _ in range(3): f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20): f()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    g.replay(); torch.cuda.synchronize()
    s.record()
    for _ in range(5): g.replay()
    e.record(); torch.cuda.synchronize()
    us = s.elapsed_time(e) * 1e3 / 100
    nbytes = batch * ctx * hkv * d * 2 * k.element_size()
    return us, nbytes / us / 1e3
for batch, ctx in [(16, 4096), (64, 2048), (256, 1024), (1, 32768), (4, 8192)]:
    nb = batch * ctx // 16 + 8
    q = torch.empty(batch, 32, 128, device=dev, dtype=torch.bfloat16)
    auto = ops.paged_decode_num_splits(q, torch.empty(nb, 16, 8, 128, device=dev, dtype=torch.bfloat16),
                                       torch.empty(batch, ctx // 16, device=dev, dtype=torch.int32))
    b = run(batch, ctx, False)
    row = [f"{batch}x{ctx} (auto {auto}): bf16 {b[0]:.1f} us {b[1]:.0f} GB/s | fp8"]
    for sp in [0, 1, 2, 3, 4, 6, 8, 16]:
        if sp > ctx // 16:
            continue
        f = run(batch, ctx, True, sp)
        row.append(f"s{sp} {f[0]:.1f} us {f[1]:.0f}")
    print(" ".join(row), flush=True)
