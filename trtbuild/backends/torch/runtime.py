"""Running an AOTInductor entry: weights and KV cache handed to the packages, decode in CUDA graphs.

Each decode bucket runs through `decode_graphs.DecodeGraphs` (one captured graph a cache window), the
prefill through `prefill_graphs.PrefillGraphs` (captured only where asked for). The packages are loaded
with `run_single_threaded=True`; without it capture fails and poisons the process.

Two ways to drive it: `generate` (a batch of same-length prompts, greedy, timed: `trtbuild run` and the
benchmark) and the slot API a scheduler uses (`prefill` one prompt into a cache row, `decode` any set of
rows each at its own position, `release`), with sampling (trtbuild/backends/sampling.py) on the logits the graphs
return. Both use the one cache: a `generate` call uses rows 0..bucket-1, so it must not run while slots
are in use.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from trtbuild.backends import Generation
from trtbuild.backends.torch.decode_graphs import DecodeGraphs
from trtbuild.backends.torch.graph_runners import Package, graph_runner
from trtbuild.backends.torch.paged_slots import PagedSlots
from trtbuild.backends.torch.prefill_graphs import PrefillGraphs, prefill_graph_limit
from trtbuild.errors import InputError, TrtbuildError
from trtbuild.backends.sampling import GREEDY, Sampling, sample
from trtbuild.timing import StepClock, sync


class TorchEngine(PagedSlots):
    def __init__(self, entry: Path) -> None:
        self.entry = entry
        self.spec: dict[str, Any] = json.loads((entry / "engine.json").read_text())
        self.device = "cuda:0" if self.spec["device"] == "cuda" else "cpu"
        self.max_batch_size: int = self.spec["max_batch_size"]
        self.buckets: list[int] = sorted(self.spec["buckets"])
        self._packages: dict[str, Any] = {}
        self._decoders: dict[int, DecodeGraphs] = {}
        self.weight_bytes = 0
        self.load_note = ""  # how the weights arrived, for the run report's load row
        # where the load's time went (graphs_s, weights_s, constants_s), each part synchronized: once the
        # weights are read during start-up, what is left of a restart's load is the other two
        self.load_parts: dict[str, float] = {}
        self._preloaded: Any = None  # weights_preload.Preloaded, when the weights came from it
        # programmatic dependent launch in the captured decode graphs (pdl_mode); TRTBUILD_PDL=0 turns it off
        self.pdl_allowed = os.environ.get("TRTBUILD_PDL", "1") != "0"
        self.prefill_graph_limit = prefill_graph_limit()  # 0: the prefill is called, not replayed (prefill_graphs.py)
        self._prefill: PrefillGraphs | None = None
        self.max_input_len: int = self.spec["max_input_len"]
        self.max_seq_len: int = self.spec["max_seq_len"]
        self.vocab_size: int = int(self.spec["hf_config"]["vocab_size"])
        # the slot API's bookkeeping, on the host: each busy row's prompt and generated tokens (the penalties'
        # inputs; a row without a penalty keeps them too, at the cost of a list append a step)
        self._prompts: dict[int, list[int]] = {}
        self._generated: dict[int, list[int]] = {}
        self.paged: Any = None  # paged_runtime.PagedCache, once `open_pool` has made the pools
        self._launched = None  # paged_slots.LaunchedStep: the last step launch_paged launched

    def __enter__(self) -> "TorchEngine":
        import torch
        from safetensors.torch import load_file

        from trtbuild.backends.torch import weights_preload
        from trtbuild.backends.torch.weights_reader import load_threads, read_safetensors
        from trtbuild.models.llama import LlamaConfig, kv_cache_shape, rope_table

        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise TrtbuildError(f"{self.entry} was built for CUDA and this process sees no GPU")
        self.cfg = LlamaConfig.from_hf(self.spec["hf_config"])
        threads = load_threads(self.device)
        t0 = time.perf_counter()
        # The graphs' runners first: they need no weights, a preload still reading from a cold disk goes on
        # meanwhile, and a graph that cannot load fails before 15 GB are read.
        models = {name: graph_runner(self.entry, name, graph, self.device) for name, graph in self.spec["graphs"].items()}
        path = self.entry / "weights.safetensors"
        t1 = time.perf_counter()
        preloaded = weights_preload.take(path, self.device) if threads else None
        if preloaded is not None:  # read onto the GPU while torch was imported, from this very file
            weights, self._preloaded = preloaded.tensors, preloaded
            self.load_note = (f"weights read onto the GPU during start-up ({preloaded.seconds:.2f} s of reading, "
                              f"{preloaded.waited_s:.2f} s of it waited for here)")
        elif threads:
            weights = read_safetensors(path, self.device, threads)
        else:
            weights = load_file(str(path), device=self.device)
        if self.spec["tied_output"]:
            weights["output.weight"] = weights["tok_embeddings.weight"]
        sync(self.device)
        t2 = time.perf_counter()
        # Bytes a decode step must read: every weight but the embedding table (a decode step
        # gathers a few rows of it), unless the table doubles as the LM head.
        # A tied LM head is the embedding tensor under a second name: counted once.
        read = {id(t): t for k, t in weights.items() if k != "tok_embeddings.weight" or self.spec["tied_output"]}
        self.weight_bytes = sum(t.numel() * t.element_size() for t in read.values())
        dtype = weights["tok_embeddings.weight"].dtype
        c, shapes = self.cfg, self.spec
        cache_shape = kv_cache_shape(c, shapes["max_batch_size"], shapes["max_seq_len"])
        consts: dict[str, Any] = {f"model.{k}": v for k, v in weights.items()}
        consts["model.rope"] = rope_table(c, shapes["max_seq_len"]).to(self.device)
        for i in range(c.num_layers):
            consts[f"model.k_cache_{i}"] = torch.zeros(cache_shape, dtype=dtype, device=self.device)
            consts[f"model.v_cache_{i}"] = torch.zeros(cache_shape, dtype=dtype, device=self.device)
        self._consts = consts
        for name, model in models.items():
            missing = [n for n in model.fqns() if n not in consts]
            if missing:
                raise TrtbuildError(f"{self.entry}: the compiled graph '{name}' expects constants "
                                    f"trtbuild does not have: {', '.join(missing[:3])}",
                                    hint="rebuild the engine (`trtbuild cache rm`)")
            model.load_constants(consts)
            self._packages[name] = model
        sync(self.device)  # the caches' zeros
        self.load_parts = {"graphs_s": t1 - t0, "weights_s": t2 - t1, "constants_s": time.perf_counter() - t2}
        return self

    def __exit__(self, *exc: object) -> None:
        self._decoders.clear()
        self._prefill = None
        self._packages.clear()
        # AOTInductor's runner keeps a handle to every user-managed constant after it is destroyed (torch
        # 2.13 here: all of them stay alive; pytorch/pytorch PR 194480 fixes it in the runner's headers), so
        # dropping the graphs does not free the weights and caches. Now that no graph can run, free the
        # memory under them: a process that opens engine after engine (the benchmark) would fill the GPU.
        for t in self._consts.values():
            storage = t.untyped_storage()
            if storage.resizable():  # torch's own allocations; the preload's are freed below
                storage.resize_(0)
        if self._preloaded is not None:
            self._preloaded.free()
            self._preloaded = None
        self._consts = {}

    def constants(self) -> dict[str, Any]:
        """The tensors every graph runs on, by their constant names ("model.<param>", the caches, the rope
        table): what a graph compiled later (`score_graph.py`) is exported from and handed."""
        return dict(self._consts)

    def attach_graph(self, name: str, so: Path) -> None:
        """Load one more compiled graph over this engine's weights and caches (the scoring graph)."""
        model = Package(so, self.device)
        missing = [n for n in model.fqns() if n not in self._consts]
        if missing:
            raise TrtbuildError(f"{so}: the compiled graph expects constants this engine does not have: "
                                f"{', '.join(missing[:3])}")
        model.load_constants(self._consts)
        self._packages[name] = model

    def score(self, tokens: Any) -> Any:
        """Every position's logits (B, T, V) of prompts (B, T) from position 0, through the scoring graph
        (`attach_graph("score", ...)`), on the engine's device; the prompts are written into cache rows
        0..B-1, so this must not run while slots are in use."""
        import torch

        if "score" not in self._packages:
            raise TrtbuildError("this engine has no scoring graph loaded (backends/torch/score_graph.attach)")
        b, t = tokens.shape
        if not 0 < b <= self.max_batch_size or not 0 < t <= self.max_seq_len:
            raise InputError(f"score: {b} prompts of {t} tokens do not fit the engine (at most {self.max_batch_size} "
                             f"of {self.max_seq_len})")
        tokens = tokens.to(self.device)
        with torch.no_grad():
            return self._packages["score"](tokens, torch.arange(t, device=self.device),
                                           torch.arange(b, device=self.device))[0]

    def bucket_for(self, batch: int) -> int:
        for b in self.buckets:
            if b >= batch:
                return b
        raise InputError(f"batch size {batch} exceeds the engine's max_batch_size {self.max_batch_size}")

    def warmup(self, batch_size: int, input_len: int, output_len: int) -> None:
        """Run a short generation of the same shape: first-call costs and graph capture happen here."""
        self.generate([[0] * input_len] * batch_size, max(2, min(output_len, 4)))

    def generate(self, input_ids: list[list[int]], max_new_tokens: int) -> Generation:
        import torch

        n, t = len(input_ids), len(input_ids[0]) if input_ids else 0
        if n == 0 or t == 0 or any(len(row) != t for row in input_ids):
            raise InputError("input_ids: expected a non-empty batch of prompts of equal, non-zero length")
        s = self.spec
        if t > s["max_input_len"] or t + max_new_tokens > s["max_seq_len"] or max_new_tokens < 1:
            raise InputError(f"a prompt of {t} tokens with {max_new_tokens} new tokens does not fit the engine "
                             f"(max_input_len {s['max_input_len']}, max_seq_len {s['max_seq_len']})")
        vocab = self.cfg.vocab_size
        if any(not 0 <= tok < vocab for row in input_ids for tok in row):
            raise InputError(f"input_ids: token ids must be in [0, {vocab})")
        bucket = self.bucket_for(n)
        rows = input_ids + [input_ids[0]] * (bucket - n)  # padding rows compute and are dropped
        tokens = torch.tensor(rows, dtype=torch.long, device=self.device).contiguous()
        positions = torch.arange(t, device=self.device)
        slots = torch.arange(bucket, device=self.device)
        decoder = self._decoder(bucket)
        decoder.prepare(t, t + max_new_tokens - 1)  # graph capture, before the prefill and untimed
        prefill = self._prefill_graphs()
        prefill.prepare(tokens, positions, slots)  # the same for the prefill's graph, where asked for
        clock = StepClock(self.device)
        with torch.no_grad():
            clock.mark()
            first = prefill(tokens, positions, slots)[0][:, 0]  # the graphs return greedy tokens (and logits)
            decoder.start(first, t)
            clock.mark()
            for _ in range(max_new_tokens - 1):
                decoder.step()
                clock.mark()
        times = clock.intervals()
        out = decoder.out[:n, t - 1 : t - 1 + max_new_tokens].tolist()
        return Generation(output_ids=out, prefill_s=times[0], decode_step_s=times[1:],
                          bytes_per_decode_step=self._decode_bytes(bucket, t + max_new_tokens / 2),
                          prefill_flops=self._prefill_flops(bucket, t),
                          prefill_bytes=self._decode_bytes(bucket, t))  # the cache it writes is the one a step reads

    def _decoder(self, bucket: int) -> "DecodeGraphs":
        if bucket not in self._decoders:
            name = f"decode_b{bucket}"
            self._decoders[bucket] = DecodeGraphs(self._packages[name], bucket, self.spec["max_seq_len"], self.device,
                                                  pdl_mode(self.spec["graphs"][name], self.device, self.pdl_allowed),
                                                  scratch=self.max_batch_size)
        return self._decoders[bucket]

    def _prefill_graphs(self) -> PrefillGraphs:
        if self._prefill is None:
            self._prefill = PrefillGraphs(self._packages["prefill"], self.device, self.prefill_graph_limit,
                                          self.max_input_len, self.max_seq_len)
        return self._prefill

    def capture_prefill(self) -> int:
        """Capture the one-prompt prefill's graph of every padded length up to max_input_len now (CUDA, where
        prefill graphs are on), so that no request of a server pays a capture; how many graphs there are. The
        limit on kept graphs is raised to hold them (one memory pool: it grows with the longest, not the
        count). The captures write the scratch cache row only."""
        import torch

        from trtbuild.backends.torch.prefill_graphs import graph_length

        graphs = self._prefill_graphs()
        if not graphs.capturable:
            return 0
        lengths = sorted({graph_length(t, graphs.longest) for t in range(1, graphs.longest + 1)})
        graphs.limit = max(graphs.limit, len(lengths))
        slots = torch.tensor([self.max_batch_size], dtype=torch.long, device=self.device)  # the scratch row
        for n in lengths:
            graphs.prepare(torch.zeros((1, n), dtype=torch.long, device=self.device),
                           torch.arange(n, device=self.device), slots)
        return len(graphs.graphs)

    def prefill(self, slot: int, prompt: list[int], sampling: Sampling = GREEDY) -> int:
        """Write the prompt's KV into cache row `slot` (positions 0..len-1); return the first generated token."""
        import torch

        if not 0 <= slot < self.max_batch_size:
            raise InputError(f"slot {slot} is not a cache row of this engine (0..{self.max_batch_size - 1})")
        if not 0 < len(prompt) <= self.max_input_len or len(prompt) >= self.max_seq_len:
            raise InputError(f"a prompt of {len(prompt)} tokens does not fit the engine (1 to max_input_len "
                             f"{self.max_input_len}, below max_seq_len {self.max_seq_len})")
        if any(not 0 <= tok < self.vocab_size for tok in prompt):
            raise InputError(f"prompt: token ids must be in [0, {self.vocab_size})")
        sampling.checked()
        t = len(prompt)
        tokens = torch.tensor([prompt], dtype=torch.long, device=self.device)
        positions = torch.arange(t, device=self.device)
        slots = torch.tensor([slot], dtype=torch.long, device=self.device)
        graphs = self._prefill_graphs()
        with torch.no_grad():
            graphs.prepare(tokens, positions, slots)
            greedy, logits = graphs(tokens, positions, slots)
            self._prompts[slot], self._generated[slot] = list(prompt), []
            token = int(greedy[0, 0]) if sampling.greedy else int(self._sample(logits, [slot], [t - 1], [sampling])[0])
        self._generated[slot].append(token)
        return token

    def decode(self, slots: list[int], tokens: list[int], positions: list[int], sampling: list[Sampling]) -> list[int]:
        """One decode step for these rows (any subset of slots, any order, each at its own position, the
        position of the token being fed); return the next token of each row. Runs the smallest batch bucket
        that holds len(slots); its other rows are padding, in the scratch cache row."""
        import torch

        n = len(slots)
        if not n or len(tokens) != n or len(positions) != n or len(sampling) != n:
            raise InputError(f"decode: expected as many tokens, positions and samplings as slots ({n}), got "
                             f"{len(tokens)}, {len(positions)} and {len(sampling)}")
        if len(set(slots)) != n or any(not 0 <= s < self.max_batch_size for s in slots):
            raise InputError(f"decode: slots must be distinct cache rows 0..{self.max_batch_size - 1}, got {slots}")
        if any(not 0 < p < self.max_seq_len for p in positions):
            raise InputError(f"decode: positions must be in [1, max_seq_len {self.max_seq_len}), got {positions}")
        if any(not 0 <= tok < self.vocab_size for tok in tokens):
            raise InputError(f"decode: token ids must be in [0, {self.vocab_size})")
        bucket = self.bucket_for(n)
        pad = bucket - n
        rows = torch.tensor([list(tokens) + [0] * pad, list(positions) + [0] * pad,
                             list(slots) + [self.max_batch_size] * pad], dtype=torch.long).to(self.device)
        with torch.no_grad():
            greedy, logits = self._decoder(bucket).run(rows, max(positions))
            if all(s.greedy for s in sampling):
                out = greedy[:n].tolist()
            else:
                picked = self._sample(logits[:n], slots, positions, sampling)
                both = torch.stack([greedy[:n], picked]).tolist()  # one copy back for both
                out = [g if s.greedy else p for g, p, s in zip(both[0], both[1], sampling)]
        for slot, tok in zip(slots, out):
            self._generated.setdefault(slot, []).append(tok)
        return out

    def release(self, slot: int) -> None:
        """The row is free (cheap; no device work: its next prefill overwrites what a step reads)."""
        self._prompts.pop(slot, None)
        self._generated.pop(slot, None)

    def _sample(self, logits: Any, slots: list[int], positions: list[int], params: list[Sampling]) -> Any:
        for p in params:
            p.checked()
        generated = [self._generated.get(s, []) for s in slots]
        seen = [self._prompts.get(s, []) + g for s, g in zip(slots, generated)]
        return sample(logits, params, positions, seen, generated)

    def capture_all(self) -> None:
        """Capture every decode graph of every bucket now (CUDA), so that no step of a server pays a capture;
        safe while slots are in use (a capture writes only the scratch row). Nothing on the CPU."""
        for b in self.buckets:
            decoder = self._decoder(b)
            decoder.prepare(0, self.max_seq_len)

    def launch_report(self) -> dict[str, Any]:
        """How each captured decode graph launches its kernels: PDL (with the edge counts of the last
        capture) or serialized, and why."""
        return {f"decode_b{b}": d.pdl_report for b, d in sorted(self._decoders.items())}

    def prefill_report(self) -> dict[str, Any]:
        """Whether the last prefill replayed a captured graph (prefill_graphs.py), and why not."""
        return self._prefill.report() if self._prefill is not None else {"on": False, "why": "no prefill run yet"}

    def timed_matmuls(self, batch: int) -> dict[str, Any] | None:
        """The matmuls of one step of the decode graph serving `batch`, as the build's selection timed them
        (each shape over its own weights in a CUDA graph, nothing between them): {"graph", "ms", and
        "fused_outside": the call sites whose fusion Inductor's kernels do}, or None where the build planned
        none (CPU, tactics none, an engine built before it was recorded)."""
        name = f"decode_b{self.bucket_for(batch)}"
        graph = self.spec["graphs"].get(name, {})
        us = graph.get("matmuls_timed_us")
        return None if us is None else {"graph": name, "ms": us / 1e3, "fused_outside": graph.get("fused_outside", [])}

    def _decode_bytes(self, batch: int, mean_len: float) -> float:
        c = self.cfg
        elem = next(iter(self._consts.values())).element_size()
        kv = 2 * c.num_layers * batch * c.num_kv_heads * c.head_dim * mean_len * elem
        from trtbuild.models.families import unread_expert_parameters  # a mixture of experts reads the chosen ones

        return self.weight_bytes - unread_expert_parameters(c, batch) * elem + kv

    def _prefill_flops(self, batch: int, t: int) -> float:
        from trtbuild.models.families import token_matmul_flops

        c = self.cfg
        dense = token_matmul_flops(c) * batch * t
        attention = 2 * 2 * c.num_layers * batch * c.num_heads * c.head_dim * t * (t + 1) / 2  # causal QK^T and PV
        head = 2 * c.hidden_size * c.vocab_size * batch  # last position only
        return dense + attention + head


def pdl_mode(graph: dict[str, Any], device: str, allowed: bool = True) -> dict[str, Any]:
    """Whether the captured graphs of one decode package use programmatic dependent launch
    (trtbuild/backends/torch/pdl.py): {"on": bool, "inductor": bool, "trtbuild": bool, "why"}. On for CUDA where
    the GPU and driver support it, for the kernels the engine spec's graph says were compiled with the
    wait: Inductor's (`"pdl"`) and trtbuild's (`"trtbuild_wait"`). Not `allowed`: TRTBUILD_PDL=0 (A/B
    runs and diagnosis)."""
    if not allowed:  # the switch first: the most specific reason
        return {"on": False, "why": "TRTBUILD_PDL=0"}
    if not device.startswith("cuda"):
        return {"on": False, "why": "CPU"}
    import torch

    from trtbuild.backends.torch import pdl

    why = pdl.available(lambda: torch.cuda.get_device_capability(device))
    if why is not None:
        return {"on": False, "why": why}
    inductor, own = bool(graph.get("pdl")), bool(graph.get("trtbuild_wait"))
    if not (inductor or own):
        return {"on": False, "why": "the package's kernels were compiled without the wait (built on a GPU before "
                                    "Hopper, or by a trtbuild without PDL)"}
    waiting = [who for who, on in (("trtbuild's kernels", own), ("Inductor's", inductor)) if on]
    return {"on": True, "inductor": inductor, "trtbuild": own, "why": " and ".join(waiting) + " may start early"}
