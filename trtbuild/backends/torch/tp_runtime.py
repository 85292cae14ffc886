"""Running a tensor-parallel entry of the torch backend (built by `tensor_parallel.py`, which describes the
layout): one process a rank, each with its `runtime.TorchEngine` over its shards and the shared graphs, and
one engine in the calling process that drives them together.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from trtbuild import parallel
from trtbuild.backends import Generation
from trtbuild.backends.torch.tensor_parallel import group
from trtbuild.errors import TrtbuildError
from trtbuild.models.llama import LlamaConfig
from trtbuild.backends.sampling import GREEDY, Sampling
from trtbuild.timing import percentiles, sync

import torch
import torch.distributed as dist


class RankEngine:
    """What runs in rank r's process: its `runtime.TorchEngine` over `rank<r>/`, entered at once, with
    its generations kept for the report and a timing of the collectives a decode step makes."""

    def __init__(self, rank: int, tp: int, entry: str) -> None:
        from trtbuild.backends.torch.runtime import TorchEngine

        root = Path(entry)
        spec = json.loads((root / "engine.json").read_text())
        expected = spec["parallel"]["group_name"]
        if str(group().group_name) != expected:  # the graphs call their collectives on the group by name
            raise TrtbuildError(f"{root}: the graphs were compiled for process group '{expected}', this rank's "
                                f"is '{group().group_name}'", hint="rebuild the engine (`trtbuild cache rm`)")
        self.rank, self.tp = rank, tp
        # every rank creates it, now, in the same order: the replay of the collectives uses it (collectives_s)
        self.probe_group = dist.new_group(backend=dist.get_backend())
        self.engine = TorchEngine(root / f"rank{rank}")
        if self.engine.device.startswith("cuda"):
            self.engine.device = f"cuda:{rank}"
            # Programmatic launch lets a kernel start before the one it follows has finished, which only
            # kernels compiled with the wait tolerate; NCCL's are not, so the ranks' graphs launch serialized.
            self.engine.pdl_allowed = False
        t = time.perf_counter()
        self.engine.__enter__()
        sync(self.engine.device)
        self.load_s = time.perf_counter() - t
        if os.environ.get("TRTBUILD_TP_GRAPHS", "1") == "0":  # docs/diagnostics.md: steps launched from the host
            for package in self.engine._packages.values():
                package.graph_safe = False
        self.generations: list[Generation] = []

    def info(self) -> dict[str, Any]:
        return {"rank": self.rank, "device": self.engine.device, "load_s": self.load_s,
                "load_parts": dict(self.engine.load_parts)}

    def warmup(self, batch_size: int, input_len: int, output_len: int) -> None:
        self.generations = []  # a report covers what ran after its warm-up, as `runner.run_report`'s figures do
        self.engine.warmup(batch_size, input_len, output_len)

    def generate(self, input_ids: list[list[int]], max_new_tokens: int) -> Generation:
        gen = self.engine.generate(input_ids, max_new_tokens)
        self.generations = [*self.generations[-99:], gen]  # what the next report sums up; bounded
        return gen

    def prefill(self, slot: int, prompt: list[int], sampling: Sampling) -> int:
        return self.engine.prefill(slot, prompt, sampling)

    def decode(self, slots: list[int], tokens: list[int], positions: list[int], sampling: list[Sampling]) -> list[int]:
        return self.engine.decode(slots, tokens, positions, sampling)

    def release(self, slot: int) -> None:
        self.engine.release(slot)

    def capture_all(self) -> None:
        self.engine.capture_all()

    def collectives_s(self, batch: int, reps: int = 20) -> float:
        """The median time of one decode step's collectives replayed alone, with the step's shapes and
        dtype: an all-reduce of (B, 1, hidden) after the embedding and after each row-parallel projection
        (2 a layer), and the all-gather of the logits. Each replay ends in a device sync, so it counts the
        wait for the slowest rank, as the step does. On a process group of its own (same ranks, same
        library): on gloo, eager collectives on the graphs' group made their next collectives hang now and then."""
        c, dev = self.engine.cfg, self.engine.device
        dtype = next(iter(self.engine._consts.values())).dtype
        x = torch.zeros(batch, 1, c.hidden_size, dtype=dtype, device=dev)
        logits = torch.zeros(batch, parallel.vocab_shard(c.vocab_size, self.tp), dtype=dtype, device=dev)
        out = torch.empty(self.tp * batch, logits.shape[1], dtype=dtype, device=dev)
        times = []
        for i in range(reps + 2):
            dist.barrier(group=self.probe_group)
            sync(dev)
            t = time.perf_counter()
            for _ in range(2 * c.num_layers + 1):
                dist.all_reduce(x, group=self.probe_group)
            dist.all_gather_into_tensor(out, logits, group=self.probe_group)
            sync(dev)
            if i >= 2:  # the first two set the connections up
                times.append(time.perf_counter() - t)
        return float(percentiles(times)["p50"])

    def report(self, batch: int) -> dict[str, Any]:
        gens, self.generations = self.generations, []
        steps = [s for g in gens for s in g.decode_step_s]
        return {"rank": self.rank, "device": self.engine.device, "load_s": self.load_s,
                "ttft_ms": percentiles([g.prefill_s for g in gens])["p50"] * 1e3 if gens else None,
                "tpot_ms": percentiles(steps)["p50"] * 1e3 if steps else None,
                "allreduce_ms_per_step": self.collectives_s(batch) * 1e3}

    def close(self) -> None:
        self.engine.__exit__(None, None, None)


def _open_rank(rank: int, tp: int, entry: str) -> RankEngine:
    return RankEngine(rank, tp, entry)


class TensorParallelEngine:
    """A tensor-parallel entry as one engine (the `backends.Engine` protocol): entering it starts one
    process a rank (`parallel.Ranks`; gloo on the CPU, NCCL on GPUs), each loading its shards and the
    shared graphs; every call runs on all ranks together and answers with rank 0's result (every rank
    computes the same tokens: the logits are all-gathered before the greedy choice and the sampling)."""

    def __init__(self, entry: Path) -> None:
        self.entry = entry
        self.spec: dict[str, Any] = json.loads((entry / "engine.json").read_text())
        self.tp: int = self.spec["parallel"]["tp"]
        self.device = "cuda:0" if self.spec["device"] == "cuda" else "cpu"
        self.max_batch_size: int = self.spec["max_batch_size"]
        self.max_input_len: int = self.spec["max_input_len"]
        self.max_seq_len: int = self.spec["max_seq_len"]
        self.buckets: list[int] = sorted(self.spec["buckets"])
        self.cfg = LlamaConfig.from_hf(self.spec["hf_config"])
        self.vocab_size = self.cfg.vocab_size
        self.load_note = ""
        self.load_parts: dict[str, float] = {}
        self._ranks: parallel.Ranks | None = None
        self._last_batch = 1
        self._merged: list[Generation] = []  # the engine's generations since the last report, for its "all" row

    def __enter__(self) -> "TensorParallelEngine":
        t = time.perf_counter()
        self._ranks = parallel.Ranks(self.tp, self.spec["device"], _open_rank, (str(self.entry),)).__enter__()
        infos = self._ranks.call("info")
        self.rank_info = infos
        self.load_parts = {"ranks_start_s": time.perf_counter() - t - max(i["load_s"] for i in infos),
                           "slowest_rank_load_s": max(i["load_s"] for i in infos)}
        self.load_note = f"{self.tp} ranks ({parallel.distributed_backend(self.spec['device'])})"
        return self

    def __exit__(self, *exc: object) -> None:
        if self._ranks is not None:
            with contextlib.suppress(TrtbuildError):
                self._ranks.call("close")
            self._ranks.__exit__()
            self._ranks = None

    @property
    def ranks(self) -> parallel.Ranks:
        if self._ranks is None:
            raise RuntimeError("the engine is not open; use it in a `with` block")
        return self._ranks

    def _all(self, method: str, *args: Any) -> Any:
        results = self.ranks.call(method, *args)
        return results[0]

    def warmup(self, batch_size: int, input_len: int, output_len: int) -> None:
        self._merged = []
        self._all("warmup", batch_size, input_len, output_len)

    def generate(self, input_ids: list[list[int]], max_new_tokens: int) -> Generation:
        gens: list[Generation] = self.ranks.call("generate", input_ids, max_new_tokens)
        if any(g.output_ids != gens[0].output_ids for g in gens[1:]):
            raise TrtbuildError("tensor-parallel ranks generated different tokens (a bug: they share the logits)")
        self._last_batch = len(input_ids)
        first = gens[0]
        # The step of the whole engine is the slowest rank's; the bytes and FLOPs stay one rank's (one GPU's),
        # so the roofline compares them with one GPU's peak.
        merged = Generation(output_ids=first.output_ids, prefill_s=max(g.prefill_s for g in gens),
                          decode_step_s=[max(s) for s in zip(*(g.decode_step_s for g in gens))],
                          bytes_per_decode_step=first.bytes_per_decode_step, prefill_flops=first.prefill_flops,
                          prefill_bytes=first.prefill_bytes)
        self._merged = [*self._merged[-99:], merged]
        return merged

    def prefill(self, slot: int, prompt: list[int], sampling: Sampling = GREEDY) -> int:
        return int(self._all("prefill", slot, prompt, sampling))

    def decode(self, slots: list[int], tokens: list[int], positions: list[int], sampling: list[Sampling]) -> list[int]:
        return list(self._all("decode", slots, tokens, positions, sampling))

    def release(self, slot: int) -> None:
        self._all("release", slot)

    def capture_all(self) -> None:
        """Capture every decode graph on every rank now (CUDA), as `runtime.TorchEngine.capture_all`."""
        self._all("capture_all")

    def parallel_report(self) -> dict[str, Any]:
        """Per rank and in all: load, TTFT and TPOT (p50) of the generations since the last warm-up or report, the
        time of one decode step's collectives replayed alone (RankEngine.collectives_s). "all" is the engine:
        each step as long as its slowest rank's (what `generate` reports), the slowest load and collectives."""
        ranks = self.ranks.call("report", self._last_batch)
        merged, self._merged = self._merged, []
        steps = [s for g in merged for s in g.decode_step_s]
        every = {"load_s": max(r["load_s"] for r in ranks),
                 "ttft_ms": percentiles([g.prefill_s for g in merged])["p50"] * 1e3 if merged else None,
                 "tpot_ms": percentiles(steps)["p50"] * 1e3 if steps else None,
                 "allreduce_ms_per_step": max(r["allreduce_ms_per_step"] for r in ranks)}
        return {"tp": self.tp, "backend": parallel.distributed_backend(self.spec["device"]), "ranks": ranks,
                "all": every,
                "allreduce_method": "one decode step's collectives (2 x layers + 1 all-reduces of batch x hidden, "
                                    "one all-gather of the logits) replayed alone, median of 20"}

