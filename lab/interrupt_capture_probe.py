"""Probe (CUDA): inject a KeyboardInterrupt at each line event of the engine's step path, as
tests/test_interrupts.py does, and after each check that CUDA still works; at the first point
that breaks it, print where the interrupt landed, the stack it interrupted and what the
interrupted run raised. Run from the repo root: python3 lab/interrupt_capture_probe.py"""

import sys
import traceback

sys.path.insert(0, "tests")
import torch  # noqa: E402

import time  # noqa: E402

from interrupts import Interrupter, interrupt_points  # noqa: E402
from test_interrupts import batch, count_events, new_llm, step_loop  # noqa: E402


def healthy() -> str | None:
    try:
        torch.zeros(4, device="cuda").add_(1)
        torch.cuda.synchronize()
        return None
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"


def main(api: str) -> None:
    llm = new_llm("cuda")
    run = (lambda: step_loop(llm)) if api == "step" else (lambda: batch(llm, api))
    sites = count_events(run)
    print(f"{api}: {len(sites)} events", flush=True)
    start = time.perf_counter()
    points = interrupt_points(sites, sample=0)  # the test's points on CUDA
    for at in points:
        llm = new_llm("cuda")
        tracer = Interrupter(at)
        raised = None
        try:
            if api == "step":
                step_loop(llm, tracer)
            else:
                try:
                    with tracer:
                        batch(llm, api)
                except KeyboardInterrupt as error:
                    raised = error
                    batch(llm, api)
        except BaseException:  # noqa: BLE001
            raised = traceback.format_exc()
        broken = healthy()
        if broken:
            print(f"BROKEN after interrupt {at} at {tracer.where}; stack {tracer.stack[:12]}")
            print(f"  health: {broken}")
            print(f"  the run raised: {raised}")
            return
        if raised is not None and not isinstance(raised, KeyboardInterrupt):
            print(f"interrupt {at} at {tracer.where}: the run raised\n{raised}", flush=True)
    print(f"{api}: all {len(points)} points left CUDA healthy "
          f"({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    for api in sys.argv[1:] or ["step", "generate"]:
        main(api)
