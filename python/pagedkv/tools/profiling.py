"""Where a decode step's time goes, from torch.profiler (Kineto) traces: the numbers
`python -m pagedkv.tools.profile` prints side by side for HF and pagedkv.

Per-step numbers come from two profiled runs of the same generate call, with `short` and `long`
new tokens: (long - short) / (long - short steps), so the prefill and the per-call set-up cancel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
import time
import warnings
from typing import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function

# Host calls that wait for the device (cudaMemcpy without Async blocks the host).
SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                        "cudaMemcpy"})
PHASES = ("prefill", "decode_step", "sample", "metadata", "cache_update")
# Lines Kineto (torch.profiler's C++ half) logs straight to fd 2 on every profiler start and stop,
# and on a machine without a GPU: not errors of the run, and dozens of them over the table.
KINETO_NOISE = ("USDT:", "STAGE:", "gpuGetDeviceCount failed", "SyncActivityProfilerHandler")
# Phases that run once per generate call: the long-minus-short difference would cancel them, so
# they are reported per call (from the long run) instead of per step.
ONCE_PER_CALL = frozenset({"prefill"})


@dataclasses.dataclass(slots=True)
class RunTrace:
    """What one profiled generate call did."""

    wall_ms: float
    # GPU: the kernels' busy time, each overlap counted once (_busy_per_kernel); CPU: time of the
    # top-level ops
    kernel_ms: float
    busy_ms: float  # union of GPU kernel intervals (CPU: = kernel_ms)
    kernels: int  # GPU kernel launches, graph-replayed ones included (CPU: top-level ops)
    allocs: int  # allocations of the caching allocator (CPU: ops that allocated)
    alloc_bytes: int
    syncs: int  # host calls that wait for the device
    kernel_table: dict[str, tuple[float, int]]  # name -> (ms, calls)
    phases_ms: dict[str, float]  # record_function label -> host ms, labels seen in the trace only
    phase_counts: dict[str, int]  # record_function label -> times it was entered
    # kernel name -> (ms the device sat idle right before its launches, launches): where the
    # idle gap goes (CUDA only; empty on the CPU)
    gap_table: dict[str, tuple[float, int]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(slots=True)
class StepProfile:
    """Per decode step, the difference of a long and a short run divided by the extra steps."""

    system: str
    wall_ms: float  # under the profiler, whose per-launch cost inflates launch-heavy systems
    unprofiled_wall_ms: float  # the same step timed without the profiler: the speed to quote
    kernel_ms: float
    # Device idle between kernels (CUDA: read off the device timeline, so host noise before the
    # first kernel and after the last does not enter; CPU: wall time minus the ops' time)
    gap_ms: float
    gap_share: float  # of the step's time: busy + idle on CUDA, wall on the CPU
    kernels: float
    allocs: float
    alloc_bytes: float
    syncs: float
    top_kernels: list[tuple[str, float, float]]  # (name, ms per step, calls per step)
    # (kernel name, idle ms per step right before it, launches per step), largest first
    top_gaps: list[tuple[str, float, float]]
    # label -> host ms per step (per call for ONCE_PER_CALL); None: the system has no such label,
    # or none that repeats per step
    phases_ms: dict[str, float | None]
    # category (CATEGORIES: matmul, attention, ...) -> kernel (CPU: op) ms per step
    categories_ms: dict[str, float] = dataclasses.field(default_factory=dict)


# (category, name fragments), first match wins: where a step's kernel or op time goes. Names are
# aten/pagedkv ops on the CPU and kernel symbols on CUDA (cuBLAS gemm, at::native elementwise...).
CATEGORIES = (
    ("attention", ("attention", "attn", "sdpa", "flash", "fmha", "softmax")),
    ("matmul", ("linear", "gemm", "gemv", "matmul", "mm", "gate_up", "cutlass", "xmma", "nvjet",
                "splitkreduce")),  # nvjet: cuBLAS's Hopper GEMM kernels
    ("norm", ("norm", "rms", "mean", "rsqrt")),
    ("rotary", ("rotary", "rope", "cos", "sin")),
    ("embed / sample", ("embedding", "argmax", "topk", "sample", "max")),
    ("copy / cache", ("copy", "cat", "index", "cache", "memcpy", "fill", "clone", "contiguous")),
    ("elementwise", ("add", "mul", "sub", "div", "silu", "neg", "pow", "elementwise", "where")),
)


def category(name: str) -> str:
    """The CATEGORIES entry a kernel or op name falls in ("other" if none)."""
    lowered = name.lower().removeprefix("aten::").removeprefix("pagedkv::")
    for label, fragments in CATEGORIES:
        if any(f in lowered for f in fragments):
            return label
    return "other"


def _is_op(name: str) -> bool:
    return name.startswith(("aten::", "pagedkv::"))


def _is_top_level_op(e) -> bool:
    """A CPU op not called from inside another op: its total time is the work it stands for."""
    return e.device_type == torch.autograd.DeviceType.CPU and _is_op(e.name) and (
        e.cpu_parent is None or not _is_op(e.cpu_parent.name))


def _gaps_before(kernels: list[tuple[float, float, str]]) -> dict[str, tuple[float, int]]:
    """kernels: (start us, end us, name). The idle time before each kernel (from the latest end
    of the kernels before it to its start; 0 where they overlap), summed per kernel name."""
    table: dict[str, tuple[float, int]] = {}
    end = None
    for start, stop, name in sorted(kernels):
        idle = 0.0 if end is None else max(start - end, 0.0) / 1e3
        total, calls = table.get(name, (0.0, 0))
        table[name] = (total + idle, calls + 1)
        end = stop if end is None else max(end, stop)
    return table


def _busy_per_kernel(kernels: list[tuple[float, float, str]]) -> dict[str, tuple[float, int]]:
    """kernels: (start us, end us, name). The device time each kernel name holds alone, summed:
    a kernel is charged from its start, or the latest end of the kernels before it if later, to
    its end. A kernel launched early by programmatic dependent launch starts while its
    predecessor runs and waits for it (griddepcontrol.wait); its profiled duration includes that
    wait, so plain durations would count the overlap twice (an H100 profile of W1 showed 8.0 ms
    of kernels in a 5.2 ms step, 1.7 ms of it "norm" waiting on the matmul before it)."""
    table: dict[str, tuple[float, int]] = {}
    end = float("-inf")
    for start, stop, name in sorted(kernels):
        held = max(stop - max(start, end), 0.0) / 1e3
        total, calls = table.get(name, (0.0, 0))
        table[name] = (total + held, calls + 1)
        end = max(end, stop)
    return table


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total / 1e3


@contextlib.contextmanager
def label_hf_cache_updates():
    """Wraps HF's DynamicCache layer updates in record_function("cache_update") while active."""
    from transformers import cache_utils

    layer_cls = getattr(cache_utils, "DynamicLayer", None)
    if layer_cls is None:
        yield
        return
    original = layer_cls.update

    def update(self, *args, **kwargs):
        with record_function("cache_update"):
            return original(self, *args, **kwargs)

    layer_cls.update = update
    try:
        yield
    finally:
        layer_cls.update = original


@contextlib.contextmanager
def quiet_kineto() -> Iterator[None]:
    """Drops Kineto's KINETO_NOISE lines. Kineto writes them from C++ to the process's fd 2, past
    sys.stderr (and KINETO_LOG_LEVEL, read once per process, would hide real errors with them):
    fd 2 goes to a temporary file while the block runs, and every other line is passed on."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no fd 2 to redirect (an embedding host): let it print
        yield
        return
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            with warnings.catch_warnings():  # torch's per-cycle note when a schedule is not used
                warnings.filterwarnings("ignore", message=".*Profiler clears events")
                yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            kept = [line for line in sink.read().decode(errors="replace").splitlines(keepends=True)
                    if not any(n in line for n in KINETO_NOISE)]
            if kept:
                sys.stderr.write("".join(kept))


def trace_run(fn: Callable[[], object], device: torch.device, trace_path: str | None = None) -> RunTrace:
    """Profile one call of fn (already warmed up), Kineto's log lines silenced."""
    with quiet_kineto():
        return _trace_run(fn, device, trace_path)


def _trace_run(fn: Callable[[], object], device: torch.device, trace_path: str | None) -> RunTrace:
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()
    with profile(activities=activities, profile_memory=not cuda) as prof:
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3
    if trace_path:
        prof.export_chrome_trace(trace_path)
    events = prof.events()
    kernel_table: dict[str, tuple[float, int]] = {}
    kernel_spans = []  # (start us, end us, name) of each GPU kernel
    phases: dict[str, float] = {}
    phase_counts: dict[str, int] = {}
    syncs = 0
    for e in events:
        if e.name in PHASES and e.device_type == torch.autograd.DeviceType.CPU:
            phases[e.name] = phases.get(e.name, 0.0) + (e.time_range.end - e.time_range.start) / 1e3
            phase_counts[e.name] = phase_counts.get(e.name, 0) + 1
        if e.name in SYNC_CALLS and e.device_type == torch.autograd.DeviceType.CPU:
            syncs += 1
        # On the device timeline, record_function labels show up too: they are not kernels.
        if cuda and e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name \
                and "Memset" not in e.name and e.name not in PHASES:
            kernel_spans.append((e.time_range.start, e.time_range.end, e.name))
        elif not cuda and _is_top_level_op(e):
            total, calls = kernel_table.get(e.name, (0.0, 0))
            kernel_table[e.name] = (total + e.cpu_time_total / 1e3, calls + 1)
    if cuda:
        kernel_table = _busy_per_kernel(kernel_spans)
    kernel_ms = sum(ms for ms, _ in kernel_table.values())
    kernels = sum(calls for _, calls in kernel_table.values())
    if cuda:
        after = torch.cuda.memory_stats()
        allocs = after.get("allocation.all.allocated", 0) - before.get("allocation.all.allocated", 0)
        alloc_bytes = (after.get("allocated_bytes.all.allocated", 0)
                       - before.get("allocated_bytes.all.allocated", 0))
        busy_ms = _union_ms([(start, stop) for start, stop, _ in kernel_spans])
    else:
        allocating = [e for e in events if e.self_cpu_memory_usage > 0]
        allocs = len(allocating)
        alloc_bytes = sum(e.self_cpu_memory_usage for e in allocating)
        busy_ms = kernel_ms
    return RunTrace(wall_ms, kernel_ms, busy_ms, kernels, allocs, alloc_bytes, syncs, kernel_table, phases,
                    phase_counts, _gaps_before(kernel_spans))


def idle_ms(trace: RunTrace) -> float:
    """Device idle between the kernels of one run (0 on the CPU, which has no device timeline)."""
    return sum(ms for ms, _ in trace.gap_table.values())


def quietest(traces: list[RunTrace]) -> RunTrace:
    """Of repeated runs of one call, the one the host disturbed least (least device idle on CUDA,
    least wall time on the CPU): a single run's stray host pause (Python's GC, a page fault) can
    be larger than a whole step's idle time, and would pass for it in a difference of two runs."""
    return min(traces, key=lambda t: (idle_ms(t), t.wall_ms) if t.gap_table else (t.wall_ms,))


def time_run(fn: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    """Best wall ms of `repeats` calls of fn, not profiled (the device drained before and after).
    HF's host-bound steps vary by tens of percent from call to call: the best is the comparable."""
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) * 1e3)
    return best


def per_step(system: str, short: RunTrace, long: RunTrace, extra_steps: int,
             unprofiled_ms: tuple[float, float] = (float("nan"), float("nan")),
             top: int = 8) -> StepProfile:
    """The steady-state decode step: (long - short) / extra_steps for every number.
    unprofiled_ms: wall ms of the short and the long call timed without the profiler."""
    d = float(extra_steps)
    wall = (long.wall_ms - short.wall_ms) / d
    busy = (long.busy_ms - short.busy_ms) / d
    if long.gap_table:  # CUDA: the idle time between kernels, host-caused idle included
        gap = max((idle_ms(long) - idle_ms(short)) / d, 0.0)
        span = busy + gap
    else:
        gap = max(wall - busy, 0.0)
        span = wall

    def per_step_rows(long_table, short_table):
        """Names the extra steps ran (an op run as often in both calls is per call, and the
        difference of its times only noise), largest time first."""
        rows = []
        for name, (ms, calls) in long_table.items():
            ms0, calls0 = short_table.get(name, (0.0, 0))
            if calls > calls0:
                rows.append((name, (ms - ms0) / d, (calls - calls0) / d))
        return sorted(rows, key=lambda r: -r[1])

    categories: dict[str, float] = {}
    for name, ms, _ in per_step_rows(long.kernel_table, short.kernel_table):
        categories[category(name)] = categories.get(category(name), 0.0) + ms
    return StepProfile(
        system=system, wall_ms=wall, unprofiled_wall_ms=(unprofiled_ms[1] - unprofiled_ms[0]) / d,
        kernel_ms=(long.kernel_ms - short.kernel_ms) / d, gap_ms=gap,
        gap_share=gap / span if span > 0 else float("nan"),
        kernels=(long.kernels - short.kernels) / d, allocs=(long.allocs - short.allocs) / d,
        alloc_bytes=(long.alloc_bytes - short.alloc_bytes) / d, syncs=(long.syncs - short.syncs) / d,
        top_kernels=per_step_rows(long.kernel_table, short.kernel_table)[:top],
        top_gaps=per_step_rows(long.gap_table, short.gap_table)[:top],
        phases_ms={p: _phase_ms(p, short, long, d) for p in PHASES}, categories_ms=categories,
    )


def _phase_ms(phase: str, short: RunTrace, long: RunTrace, steps: float) -> float | None:
    if phase not in long.phases_ms:
        return None
    if phase in ONCE_PER_CALL:
        return long.phases_ms[phase]
    # A label the extra steps never entered (e.g. "sample" inside a replayed CUDA graph runs on
    # the host only for the first token) has no per-step time: the difference would be noise.
    if long.phase_counts.get(phase, 0) <= short.phase_counts.get(phase, 0):
        return None
    return (long.phases_ms[phase] - short.phases_ms.get(phase, 0.0)) / steps


def fmt_ms(ms: float) -> str:
    """A time with its unit: 18.5 ms, 178 us."""
    if ms != ms:
        return "-"
    return f"{ms:.3g} ms" if abs(ms) >= 1 else f"{1e3 * ms:.3g} us"


def fmt_count(n: float) -> str:
    """A count per step: "12" when whole (differences of whole counts over whole steps), else 2 decimals."""
    return str(round(n)) if abs(n - round(n)) < 1e-6 else f"{n:.2f}"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def side_by_side(profiles: list[StepProfile], cuda: bool) -> str:
    """A plain-text table, one column per system. cuda: the profiles hold GPU kernels (else CPU
    ops, and the gap is host time outside them)."""
    op = "kernel" if cuda else "op"
    gap = "idle gap" if cuda else "host time outside ops"
    rows = [
        ("wall / step, not profiled", [fmt_ms(p.unprofiled_wall_ms) for p in profiles]),
        ("wall / step, profiled", [fmt_ms(p.wall_ms) for p in profiles]),
        (f"{op} time / step", [fmt_ms(p.kernel_ms) for p in profiles]),
        (f"{gap} / step", [fmt_ms(p.gap_ms) for p in profiles]),
        (f"{gap} share", [f"{100 * p.gap_share:.1f}%" for p in profiles]),
        ("kernel launches / step" if cuda else "ops / step", [fmt_count(p.kernels) for p in profiles]),
        ("allocations / step", [fmt_count(p.allocs) for p in profiles]),
        ("allocated / step", [fmt_bytes(p.alloc_bytes) for p in profiles]),
        ("host syncs / step", [fmt_count(p.syncs) for p in profiles]),
    ]
    rows += [(f"phase {name} / {'call' if name in ONCE_PER_CALL else 'step'}",
              ["-" if p.phases_ms[name] is None else fmt_ms(p.phases_ms[name]) for p in profiles])
             for name in PHASES]
    width = max(len(r[0]) for r in rows) + 2
    cols = [max(18, len(p.system) + 2) for p in profiles]
    lines = ["".ljust(width) + "".join(p.system.rjust(c) for p, c in zip(profiles, cols))]
    lines += [name.ljust(width) + "".join(v.rjust(c) for v, c in zip(values, cols)) for name, values in rows]
    for p in profiles:
        lines.append(f"\ntop {op}s per step, {p.system}:")
        lines += [f"  {fmt_ms(ms):>9}  {fmt_count(calls):>5} x  {name[:90]}" for name, ms, calls in p.top_kernels]
    for p in profiles:
        if p.top_gaps:
            lines.append(f"\nidle time before these kernels per step, {p.system}:")
            lines += [f"  {fmt_ms(ms):>9}  {fmt_count(calls):>5} x  {name[:90]}" for name, ms, calls in p.top_gaps]
    return "\n".join(lines)
