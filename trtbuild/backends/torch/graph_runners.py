"""A torch entry's compiled graphs, loaded and called: each graph's AOTInductor runner (`Package`), a graph
compiled by regions as the chain of its layers' runners (`Regional`, models/regions.py), and a CPU engine's
prompt through its one step program (`PromptStep`, export.shared_step). Each takes the engine's weights and
caches as user-managed constants and is called with the graph's inputs; `runtime.TorchEngine` holds them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


class Package:
    """One compiled graph, loaded from its .so with AOTInductor's container runner.

    The runner is used directly rather than through `aoti_load_package`: loading the unpacked .so
    skips the package's zip reader and the CPU compiler probes `aoti_load_package` runs before it
    loads anything, and a restart unpacks nothing. On CUDA the runner is
    created single-threaded, without which a CUDA-graph capture of it fails and poisons the process.
    """

    def __init__(self, so: Path, device: str) -> None:
        import torch

        from trtbuild.backends.torch import cxx

        aoti = torch._C._aoti
        cxx.check_symbols(str(so))  # a clear error where the graph would otherwise segfault
        self.graph_safe = True
        if device.startswith("cuda"):
            torch.zeros(1, device=device)  # a CUDA context on this device before the runner's constructor
            try:
                # (model .so, containers, device, cubin dir, run_single_threaded): newer than the stubs
                runner_cls: Any = aoti.AOTIModelContainerRunnerCuda
                self.runner = runner_cls(str(so), 1, device, str(so.parent), True)
            except TypeError:  # an older binding without run_single_threaded: no graph capture then
                self.runner = aoti.AOTIModelContainerRunnerCuda(str(so), 1, device, str(so.parent))
                self.graph_safe = False
        else:
            self.runner = aoti.AOTIModelContainerRunnerCpu(str(so), 1)
        self.names = dict(self.runner.get_constant_names_to_original_fqns())  # internal name -> FQN

    def fqns(self) -> list[str]:
        return list(self.names.values())

    def load_constants(self, consts: dict[str, Any], named: Callable[[str], str] = lambda fqn: fqn) -> None:
        """The graph's constants from `consts`, each found under `named(its FQN)` (a region's: the layer's)."""
        # user_managed: the runner uses these very tensors (no copy), so every graph shares one
        # KV cache and one set of weights.
        self.runner.update_constant_buffer({k: consts[named(f)] for k, f in self.names.items()}, False, True, True)

    def __call__(self, *inputs: Any) -> Any:
        """The graph's outputs: (greedy token ids (B, 1), logits (B, V))."""
        return tuple(self.runner.run([t.contiguous() for t in inputs]))


class Regional:
    """One graph compiled by regions (models/regions.py), called as one: the embedding gathered, then each
    layer's region, loaded once a layer it runs with that layer's weights and KV cache as its constants, each
    on the hidden states the one before returned; the last returns the graph's outputs. Inside a CUDA graph the
    whole chain is one replay, as a whole graph's step is. `runner` is the chain (`.run(inputs)`), which the
    CPU profile swaps for an eager one as it does a whole graph's."""

    def __init__(self, entry: Path, graph: dict[str, Any], device: str, paged: bool) -> None:
        self.device, self.paged, self.scale = device, paged, float(graph["embed_scale"])
        self.regions = [(entry / r["so"], list(r["layers"])) for r in graph["regions"]]
        self.first = [Package(so, device) for so, _ in self.regions]  # each region's first copy: fails early
        self.graph_safe = all(m.graph_safe for m in self.first)
        self.runner: Any = None

    def fqns(self) -> list[str]:
        from trtbuild.models.regions import constant_name

        return sorted({"model.tok_embeddings.weight"} | {constant_name(f, layer) for model, (_, layers) in
                                                          zip(self.first, self.regions) for layer in layers
                                                          for f in model.fqns()})

    def load_constants(self, consts: dict[str, Any]) -> None:
        from trtbuild.models.regions import constant_name

        by_layer: dict[int, Package] = {}
        for model, (so, layers) in zip(self.first, self.regions):
            for i, layer in enumerate(layers):
                copy = model if i == 0 else Package(so, self.device)
                copy.load_constants(consts, lambda fqn, layer=layer: constant_name(fqn, layer))
                by_layer[layer] = copy
        self.runner = _Chain(consts["model.tok_embeddings.weight"], self.scale,
                             [by_layer[i].runner for i in range(len(by_layer))], self.paged)

    def __call__(self, *inputs: Any) -> Any:
        return tuple(self.runner.run([t.contiguous() for t in inputs]))


class _Chain:
    """The embedding and the layers' runners in order, as one runner: `run(inputs)` with a whole graph's inputs
    (tokens, positions, cache rows or block tables, then a decode step's span or every layer's two pools) and
    its outputs."""

    def __init__(self, table: Any, scale: float, runners: list[Any], paged: bool) -> None:
        self.table, self.scale, self.runners, self.paged = table, scale, runners, paged

    def run(self, inputs: list[Any]) -> list[Any]:
        from trtbuild.models.llama import embed

        x, rest = embed(self.table, self.scale, inputs[0]), inputs[1:]
        pools = rest[2:] if self.paged else []
        rest = rest[:2] if self.paged else rest
        out: list[Any] = []
        for i, runner in enumerate(self.runners):
            out = runner.run([x, *rest, *pools[2 * i:2 * i + 2]])
            x = out[0]
        return out


class PromptStep:
    """A prompt through the one step program of a CPU engine (export.shared_step), called as a prefill graph is:
    (tokens (B, T), positions (T,), cache rows (B,)), each row at the prompt's positions, attending over slots
    0..T-1 of its cache row as it writes them (the step's causal mask, from the positions). `runner` is the
    step's, which the CPU profile swaps for an eager one."""

    def __init__(self, step: "Package | Regional") -> None:
        self.step = step
        self.graph_safe = False  # a CPU program: nothing is captured

    def fqns(self) -> list[str]:
        return self.step.fqns()

    def load_constants(self, consts: dict[str, Any]) -> None:
        self.step.load_constants(consts)

    @property
    def runner(self) -> Any:
        return self.step.runner

    @runner.setter
    def runner(self, value: Any) -> None:
        self.step.runner = value

    def __call__(self, tokens: Any, positions: Any, slots: Any) -> Any:
        import torch

        b, t = tokens.shape
        span = torch.arange(max(t, 2), device=tokens.device)  # the step's span has at least two slots (export)
        return self.step(tokens, positions.expand(b, t), slots, span)


def graph_runner(entry: Path, name: str, graph: dict[str, Any], device: str) -> "Package | Regional | PromptStep":
    """The runner of the entry's graph `name`: its one .so, or its regions'; on the CPU, the prefill through the
    decode buckets' one step program (export.shared_step)."""
    paged = name == "paged"  # export.PAGED, not imported: the export module is the build's
    runner = Regional(entry, graph, device, paged) if "regions" in graph else Package(entry / graph["so"], device)
    return PromptStep(runner) if name == "prefill" and graph.get("step") else runner
