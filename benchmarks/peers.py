"""The variants the benchmark runs side by side, each behind one small interface.

Every peer answers `generate(prompts, new_tokens) -> (prefill_s, decode_step_s)`: greedy decoding
of a batch of equal-length prompts, timed on the device (CUDA events through trtbuild's StepClock,
perf_counter on the CPU). The first interval is the time to the first token; each later one is one
decode step. The benchmark warms every peer up with the exact shapes it then times.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from trtbuild.timing import StepClock

Timings = tuple[float, list[float]]


class Peer(Protocol):
    label: str  # what ran, in words (mode, fallbacks)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> Timings: ...

    def close(self) -> None: ...


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# -- (1) our engine, as a user runs it: a cache hit through open_session ------------------------------
class EnginePeer:
    def __init__(self, recipe: Any, engines: str) -> None:
        from trtbuild.runner import open_session

        self.engines = engines  # the store it was found in
        self.session = open_session(recipe, engines, build=False).__enter__()
        self.label = f"trtbuild {recipe.backend} engine (cache hit, open_session(build=False))"
        if kernels := decode_kernels(self.session.outcome.entry.manifest):
            self.label += f"; {kernels}"

    def generate(self, prompts: list[list[int]], new_tokens: int) -> Timings:
        gen = self.session.engine.generate(prompts, new_tokens)
        return gen.prefill_s, list(gen.decode_step_s)

    def close(self) -> None:
        self.session.__exit__(None, None, None)
        free_device_memory()


def decode_kernels(manifest: dict[str, Any]) -> str:
    """Which decode matmuls the engine runs through trtbuild's kernel, and which attention kernels, from its
    manifest, in a few words."""
    from trtbuild.backends.torch.decode_kernels import fused_outside, timed_step_us
    from trtbuild.backends.torch.export import bucket

    record = manifest.get("tactics", {}).get("decode_matmuls") or {}
    parts = []
    for graph, shapes in sorted(record.items()):
        if isinstance(shapes, dict) and "note" not in shapes:
            # each with the configuration chosen: the run's record is then enough to compare two builds' plans
            routed = sorted(f"{shape} {r['used']}" for shape, r in shapes.items() if r.get("used", "cublas") != "cublas")
            timed = timed_step_us(record, bucket(graph))
            outside = fused_outside(record, bucket(graph))
            parts.append(f"{graph}: decode kernel for {len(routed)} of {len(shapes)} weight shapes"
                         + (f" ({', '.join(routed)})" if routed else "")
                         + (f", the fusion of {', '.join(outside)} outside it" if outside else "")
                         + (f", the step's matmuls {timed / 1e3:.3f} ms as the build timed them" if timed else ""))
    attention = manifest.get("tactics", {}).get("decode_attention", {}).get("used")
    if attention:
        label = "trtbuild kernel (with rope and the cache writes)" if attention == "kernel" else "aten"
        parts.append(f"decode attention: {label}")
    prompt = manifest.get("tactics", {}).get("prefill_attention", {})
    if prompt.get("used"):
        parts.append(f"prefill attention: {prompt['used']} ({prompt.get('note', '')})")
    return "; ".join(parts) or str(record.get("note", ""))


# -- (2) eager PyTorch and (3) torch.compile on the same model code -----------------------------------
def load_transformer(folder: Path, dtype: torch.dtype, device: str, max_batch: int, max_seq: int) -> Any:
    """trtbuild's Transformer with the checkpoint's weights, the way the backend builds it."""
    from trtbuild.models.checkpoint import convert_hf_state_dict, load_weights, read_config
    from trtbuild.models.llama import Transformer

    _, cfg = read_config(folder)
    state = convert_hf_state_dict(load_weights(folder, cfg, dtype), cfg)
    with torch.device(device):
        model = Transformer(cfg, max_batch, max_seq, dtype)
    model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=False, assign=True)
    return model.eval().requires_grad_(False)


def _prefill_step(model: Any, tokens: Tensor, pos: Tensor) -> Tensor:
    return model(tokens, pos, from_start=True).argmax(-1, keepdim=True)


def _decode_step(model: Any, tok: Tensor, pos: Tensor) -> Tensor:
    return model(tok, pos).argmax(-1, keepdim=True)


class TransformerPeer:
    """Prefill then one decode call per token; `compiled` = the gpt-fast recipe."""

    def __init__(self, model: Any, device: str, compiled: bool, cpu_mode: str = "default") -> None:
        self.model, self.device, self.compiled = model, device, compiled
        self.prefill: Callable[..., Tensor] = _prefill_step
        self.decoders: dict[int, Callable[..., Tensor]] = {}
        if not compiled:
            self.label = "eager PyTorch, trtbuild's Transformer (no CUDA graph)"
            return
        cuda = device.startswith("cuda")
        self.mode = "max-autotune" if cuda else cpu_mode
        # gpt-fast: decode compiled whole (fullgraph), static shapes, CUDA graphs from the mode;
        # prefill compiled once with a dynamic length, no CUDA graphs.
        self.prefill = torch.compile(_prefill_step, fullgraph=True, dynamic=True)
        self.label = (f"torch.compile(mode={self.mode!r}, fullgraph) decode per batch, dynamic prefill"
                      + ("; CUDA graphs from the mode" if cuda else "; CPU: no CUDA graphs"))

    def _decoder(self, batch: int) -> Callable[..., Tensor]:
        if batch not in self.decoders:
            self.decoders[batch] = (torch.compile(_decode_step, mode=self.mode, fullgraph=True, dynamic=False)
                                    if self.compiled else _decode_step)
        return self.decoders[batch]

    def generate(self, prompts: list[list[int]], new_tokens: int) -> Timings:
        tokens = torch.tensor(prompts, dtype=torch.long, device=self.device)
        t = tokens.shape[1]
        decode = self._decoder(tokens.shape[0])
        clock = StepClock(self.device)
        out = []
        with torch.no_grad():
            clock.mark()
            nxt = self.prefill(self.model, tokens, torch.arange(t, device=self.device)).clone()
            clock.mark()
            out.append(nxt)
            pos = torch.tensor([t], dtype=torch.long, device=self.device)
            for _ in range(new_tokens - 1):
                nxt = decode(self.model, nxt, pos).clone()
                pos += 1
                clock.mark()
                out.append(nxt)
        times = clock.intervals()
        return times[0], times[1:]

    def close(self) -> None:
        self.decoders.clear()
        if self.compiled:
            torch._dynamo.reset()  # drops compiled graphs and their CUDA-graph pools
        self.model = None
        free_device_memory()


# -- (4) Hugging Face transformers generate() ---------------------------------------------------------
class HFPeer:
    """`generate()` with a static cache (auto-compiled decode on CUDA), or eager with DynamicCache.

    The time marks come from a logits processor, which generate() calls once per step right after
    the forward pass: the first interval is prefill (with generate's own set-up), each later one a
    decode step including generate's per-step host work, as a user experiences it.
    """

    def __init__(self, folder: Path, dtype: torch.dtype, device: str, mode: str) -> None:
        from transformers import AutoModelForCausalLM, LogitsProcessor

        self.device = device
        model: Any = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
        self.model = model.to(device).eval()
        self.model.generation_config.eos_token_id = None  # random weights: never stop early
        self.model.generation_config.pad_token_id = 0
        self.mode = mode
        peer = self

        class Marker(LogitsProcessor):
            def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
                peer.clock.mark()
                return scores

        self.marker = Marker()
        self.clock = StepClock(device)

    @property
    def label(self) -> str:
        if self.mode == "static":
            compiled = hasattr(self.model, "_compiled_call")
            return ("transformers generate(), static cache, " +
                    ("auto torch.compile of decode (reduce-overhead, CUDA graphs)" if compiled else "not compiled"))
        return "transformers generate(), eager, DynamicCache"

    def generate(self, prompts: list[list[int]], new_tokens: int) -> Timings:
        from transformers import LogitsProcessorList

        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        kwargs: dict[str, Any] = {"cache_implementation": "static"} if self.mode == "static" else {"disable_compile": True}
        self.clock = StepClock(self.device)
        with torch.no_grad():
            self.clock.mark()
            self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False,
                                logits_processor=LogitsProcessorList([self.marker]), **kwargs)
        times = self.clock.intervals()
        return times[0], times[1:]

    def close(self) -> None:
        self.model = None
        torch._dynamo.reset()
        free_device_memory()


def hf_peer(folder: Path, dtype: torch.dtype, device: str, mode: str, probe: list[list[int]],
            new_tokens: int) -> tuple[HFPeer, list[str]]:
    """The fastest HF mode that works here: try static(+compile) first unless told, fall back to eager."""
    notes: list[str] = []
    order = {"auto": ["static", "eager"], "static": ["static"], "eager": ["eager"]}[mode]
    peer = HFPeer(folder, dtype, device, order[0])
    for i, m in enumerate(order):
        peer.mode = m
        try:
            for _ in range(3):  # compiles and records the CUDA graphs for this exact total length
                peer.generate(probe, new_tokens)
            return peer, notes
        except Exception as exc:  # noqa: BLE001 - any failure means "this mode does not work here"
            notes.append(f"HF mode {m!r} failed: {type(exc).__name__}: {str(exc)[:300]}")
            if i == len(order) - 1:
                raise
            torch._dynamo.reset()
    raise AssertionError("unreachable")


# -- report: the PNG and the table printed last -------------------------------------------------------
def plot(report: dict[str, Any], path: Path) -> str:
    """Time per token against batch, prefill time against prompt length; every variant, floors dashed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "[bench] matplotlib is not importable here: no plot written (the JSON has every number)"
    recipes = list(report["recipes"].values())
    fig, axes = plt.subplots(len(recipes), 2, figsize=(12, 4.5 * len(recipes)), squeeze=False)
    for row, rec in zip(axes, recipes, strict=True):
        floors = rec["floors"]
        for ax, kind, xlabel in ((row[0], "decode", "batch size"), (row[1], "prefill", "prompt tokens (batch 1)")):
            xs = sorted(int(x) for x in floors[f"{kind}_s"])
            ax.plot(xs, [floors[f"{kind}_s"][str(x)] * 1e3 for x in xs], "k--", label="floor")
            for name, v in rec.get("variants", {}).items():
                pts = sorted((int(x), d["p50"] * 1e3) for x, d in v.get(kind, {}).items())
                if pts:
                    ax.plot(*zip(*pts, strict=True), "o-", label=name)
            ax.set(xlabel=xlabel, ylabel="ms per token" if kind == "decode" else "ms", yscale="log",
                   title=f"{rec['recipe']}: {'decode, median' if kind == 'decode' else 'prefill, median'}")
            ax.set_xticks(xs)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"{report['device']}, torch {report['torch']}, {report['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"[bench] plot written: {path}"


def _ms(d: dict[str, Any] | None, key: str = "p50") -> str:
    if not d:
        return "-"
    x = f" ({d['x_floor']:.2f}x)" if "x_floor" in d and key == "p50" else ""
    return f"{d[key] * 1e3:.3f}{x}"


def _variant_lines(rec: dict[str, Any], report: dict[str, Any]) -> list[str]:
    """The floors and one row per variant, then each variant's label."""
    lines: list[str] = []
    fl = rec["floors"]
    batches, lens = sorted(fl["decode_s"], key=int), sorted(fl["prefill_s"], key=int)
    head = ["variant"] + [f"decode b{b} p50 ms (xfloor)" for b in batches] + [f"b{b} p90" for b in batches]
    head += [f"prefill {t} ms (xfloor)" for t in lens]
    rows = [["floor"] + [f"{fl['decode_s'][b] * 1e3:.3f}" for b in batches] + ["-"] * len(batches)
            + [f"{fl['prefill_s'][t] * 1e3:.3f}" for t in lens]]
    for name, v in rec.get("variants", {}).items():
        if not v.get("decode"):
            rows.append([name, v.get("skipped") and f"skipped: {v['skipped']}" or
                         f"error: {v.get('error') or 'cut off before its first figure'}"])
            continue
        d, p = v["decode"], v.get("prefill", {})
        rows.append([name] + [_ms(d.get(b)) for b in batches] + [_ms(d.get(b), "p90") for b in batches]
                    + [_ms(p.get(t)) for t in lens])
    widths = [max(len(r[i]) for r in [head] + rows if i < len(r) and len(r) > 2) for i in range(len(head))]
    lines += ["", f"== {rec['recipe']} ({rec['precision']}); decode after a {report['plan']['prompt_len']}-token "
              f"prompt, n = samples"]
    for r in [head] + rows:
        lines.append("  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)) if len(r) > 2 else "  ".join(r))
    if bound := fl.get("prefill_bound"):  # bench.json files before the memory bound have none
        lines.append("  floors: decode reads the weights and the filled cache once; prefill is the larger of its "
                     "FLOPs at the measured matmul rate and its bytes (weights read once, its cache written) at "
                     f"the copy rate: {', '.join(f'{t} {bound[t]}-bound' for t in lens)}")
    if rec.get("prefill_lengths_skipped"):
        lines.append(f"  {rec['prefill_lengths_skipped']}")
    for name, v in rec.get("variants", {}).items():
        if v.get("decode"):
            n = next(iter(v["decode"].values()))["n"]
            cut = "" if v.get("complete") else "; CUT OFF: the figures missing from its row were not measured"
            lines.append(f"  {name}: {v['label']} (n={n} steps per batch){cut}"
                         f"{'; ' + '; '.join(v['notes']) if v['notes'] else ''}")
            spread = [f"b{b} {' / '.join(f'{x * 1e3:.3f}' for x in d['p50_by_position'])}"
                      for b, d in v["decode"].items() if d.get("p50_by_position")]
            if spread:
                lines.append(f"    {name} decode p50 ms by quarter of the generated positions, first to last: "
                             f"{'; '.join(spread)}")
    return lines


def _first_token(t: dict[str, Any]) -> str:
    """A restart's time to the first token (with its samples where it is a median of several), or its error."""
    if "error" in t:
        return t["error"][:160]
    samples = t.get("samples_s")
    return f"{t['start_to_first_token_s']:.2f} s" + (
        f" (median of {len(samples)}: {', '.join(f'{x:.2f}' for x in samples)})" if samples else "")


def _restart_line(label: str, t: dict[str, Any], ratio: float) -> str:
    """One restart of the engine in a new process: to the first token, start-up, the load and its parts."""
    got = _first_token(t)
    preloaded = "; weights preloaded" if "start-up" in t.get("load_note", "") else ""
    phases = t.get("phases", {})
    parts = ", ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in t.get("load_parts", {}).items())
    return (f"    {label}: start -> first token {got}; start-up {phases.get('startup_s', float('nan')):.2f} s, load "
            f"{phases.get('load_s', float('nan')):.2f} s{f' ({parts})' if parts else ''}; ratio {ratio:.2f}{preloaded}")


def table(report: dict[str, Any]) -> str:
    c = report["ceilings"]
    lines = [f"device {report['device']}, torch {report['torch']}: copy {c['copy_Bps'] / 1e12:.3f} TB/s (read+write), "
             f"{c['matmul_dtype']} {c['matmul_n']}^3 matmul {c['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s"]
    for rec in report["recipes"].values():
        if "floors" in rec:
            lines += _variant_lines(rec, report)
        else:  # a run cut off in its build section
            lines += ["", f"== {rec.get('recipe', '?')}: no variant measured (cut off before them)"]
        for cache in ("cold", "warm"):
            r = rec.get("restart", {}).get(cache)
            if r:
                e, f = r["engine"], r["read_weights_to_device"]
                got = _first_token(e)
                reader = f", {f['reader']}" if "reader" in f else ""
                lines.append(f"  restart ({cache} page cache): start -> first token {got}; read weights to device "
                             f"{f['s']:.3f} s ({f['Bps'] / 1e9:.2f} GB/s{reader}); ratio {r['ratio_to_floor']:.2f}")
                if ready := r.get("torch_process_floor"):
                    got = (f"{ready['start_to_ready_s']:.2f} s, ratio {ready['ratio_to_floor']:.2f}" if "error" not in ready
                           else ready["error"][:160])
                    lines.append(f"    a new process that only imports torch and makes one tensor on the device: {got}")
                starts = [(label, r[f"engine_{key}"], r[f"ratio_to_floor_{key}"])
                          for key, label in (("load_threads", "with TRTBUILD_LOAD_THREADS, TRTBUILD_PRELOAD=0"),
                                             ("load_threads_preload", "the same, preloaded (the default)"))
                          if r.get(f"engine_{key}")]
                starts += [(f"the same, preloaded with {n} threads", t, t["ratio_to_floor"])
                           for n, t in r.get("engine_preload_by_threads", {}).items()]
                lines += [_restart_line(label, t, ratio) for label, t, ratio in starts]
        b = rec.get("build")
        if b:
            def one(x: dict[str, Any]) -> str:
                return (f"{x['build_s']:.1f} s " + str({k: round(v, 1) for k, v in x["phases"].items()})
                        if "error" not in x else x["error"][:160])
            reused = b["cold"].get("compiled_graphs_reused")
            lines.append(f"  build {'with graphs reused from the tactic cache ' + str(reused) if reused else 'cold'}: "
                         f"{one(b['cold'])}")
            if "rebuild_kept_tactics" in b:
                lines.append(f"  rebuild (engine deleted, tactics kept): {one(b['rebuild_kept_tactics'])}; "
                             f"ratio {b.get('ratio', float('nan')):.2f}")
    return "\n".join(lines)
