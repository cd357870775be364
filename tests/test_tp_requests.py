"""pagedkv.LLM under tensor parallelism: every rank must add the same requests in the same order
(prompt ids, SamplingParams, request id), as generate() checks its calls; ranks that differ
would wait on each other forever in the next step's collectives. A mismatch raises ValueError on
every rank naming the ranks, queues nothing, and the engine runs the next matching request."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

import tp_worker
from models import tiny_model


def test_ranks_adding_different_requests_refuse_together(tmp_path):
    mp.spawn(tp_worker.run_request_mismatch, args=(2, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2,
             join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    prompt = [5, 6, 7, 8]
    hf = tiny_model("llama").generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    for r in ranks:
        assert len(r["errors"]) == 6
        for error in r["errors"]:
            assert error.startswith("pagedkv.LLM: rank(s) [1] of the tensor-parallel group got other requests"), error
        assert not r["queued"]
        assert r["tokens"] == [hf]
        assert r["batch"][0] == hf
        assert r["free"] == r["blocks"]
    assert ranks[0]["request_id"] == ranks[1]["request_id"]
    assert ranks[0]["batch"] == ranks[1]["batch"]
