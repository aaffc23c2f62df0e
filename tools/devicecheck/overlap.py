"""Part 2c, overlap (GPU only): the mask build while a verify-sized forward runs on the GPU.

The stand-in verify forward is the matmul work of a Llama-3-8B-shaped model over
``batch * nodes`` tokens (64 x 16 = 1024), in bf16: 32 layers of
``[T, 4096] @ [4096, 6144]`` (q, k, v with 8 KV heads), ``[T, 4096] @ [4096, 4096]`` (o),
``[T, 4096] @ [4096, 28672]`` (gate and up) and ``[T, 14336] @ [14336, 4096]`` (down), then the
LM head ``[T, 4096] @ [4096, 131072]`` giving the logits (no attention, norms or activations:
the matmuls are 99% of such a forward's FLOPs). One layer's weights are reused by all layers.

Each round, on fresh tree tensors and a fresh batch of requests, the step is timed from the
tree's ``from_device`` to ``torch.cuda.synchronize()`` after the sampler's apply:

``forward + apply``    the GPU work alone (a prebuilt mask): the floor of a step
``build``              ``from_device`` + ``build_grammar_vocab_mask``, synchronized
``serial``             wait for the forward, then build, upload and apply (no overlap)
``library upload``     forward queued, then ``build_grammar_vocab_mask`` (the library's
                       upload), then ``apply_vocab_mask``
``same-stream upload`` forward queued, then ``build_host_bitmask`` into a pinned buffer and
                       ``host.to(device, non_blocking=True)`` on the current stream, then apply

``hidden = (serial - overlapped) / build`` is the share of the build the forward hid, and
``exposed = overlapped - (forward + apply)`` the host time a step pays beyond the GPU work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tools.bench.build import warm_matchers
from tools.bench.timing import Method, cuda_event_timer, host_timer, median, run_rounds
from tools.bench.workloads import synthetic_setup
from tools.devicecheck.profiles import Profile
from tools.devicecheck.results import PartRecorder, SkipSection
from tools.devicecheck.workload import describe, json_pool, tiled_mask

__all__ = ["LAYER_MATMULS", "VerifyStandIn", "measure_overlap", "run"]

HIDDEN = 4096
LAYERS = 32
#: (in, out) of each matmul of one layer; the next matmul reads the first ``in`` columns
LAYER_MATMULS = ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096))


class VerifyStandIn:
    """The stand-in verify forward: ``forward()`` queues the matmuls on the current CUDA
    stream and returns the ``[tokens, vocab]`` bf16 logits at once (asynchronous on a GPU).

    ``hidden``, ``layers`` and ``matmuls`` default to the 8B shapes above (smaller ones let
    the measurement's code run on a CPU in the tests).
    """

    def __init__(
        self,
        tokens: int,
        vocab: int,
        device: Any,
        *,
        hidden: int = HIDDEN,
        layers: int = LAYERS,
        matmuls: tuple[tuple[int, int], ...] = LAYER_MATMULS,
    ) -> None:
        import torch

        gen = torch.Generator(device=device).manual_seed(3)

        def weight(fan_in: int, fan_out: int) -> Any:
            w = torch.randn((fan_in, fan_out), generator=gen, device=device, dtype=torch.bfloat16)
            return w / fan_in**0.5

        self.hidden, self.layers = hidden, layers
        self.weights = [weight(i, o) for i, o in matmuls]
        self.head = weight(hidden, vocab)
        self.x = torch.randn((tokens, hidden), generator=gen, device=device, dtype=torch.bfloat16)
        per_layer = sum(i * o for i, o in matmuls)
        self.flops = 2 * tokens * (layers * per_layer + hidden * vocab)

    def forward(self) -> Any:
        """Queue the forward; returns the logits tensor (not yet computed on a GPU)."""
        x = self.x
        for _ in range(self.layers):
            for w in self.weights:
                x = x[:, : w.shape[0]] @ w
        return x[:, : self.hidden] @ self.head


def run(rec: PartRecorder, profile: Profile) -> None:
    """The overlap section (skipped without CUDA)."""
    import torch

    with rec.section("overlap"):
        if not torch.cuda.is_available():
            raise SkipSection("no CUDA device")
        measure_overlap(rec, profile, torch.device("cuda"))


def measure_overlap(
    rec: PartRecorder, profile: Profile, device: Any, model: VerifyStandIn | None = None
) -> None:
    """Time the five methods on ``device`` and add one record to the ``overlap`` section.

    ``model``: the stand-in forward (default: the 8B shapes over ``batch * nodes`` tokens).
    On a CPU device everything runs synchronously, so nothing overlaps; the tests use it to
    run this code without a GPU.
    """
    import torch

    import portable_spec as ps

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else lambda: None
    batch, nodes, vocab = profile.overlap_batch, profile.nodes, profile.vocab
    setup = synthetic_setup(vocab)
    pool = json_pool(setup, nodes, batch)
    warm_matchers(pool, vocab)
    rows = batch * nodes
    model = model or VerifyStandIn(rows, vocab, device)
    premask = torch.from_numpy(tiled_mask(pool, vocab, rows)).to(device)
    pinned = torch.empty((rows, setup.words), dtype=torch.int32, pin_memory=cuda)
    pinned_np = pinned.numpy()
    rec.note(
        "workload",
        {
            **describe(setup, pool),
            "batch": batch,
            "forward": f"Llama-3-8B-shaped matmuls, {model.layers} layers + LM head, "
            f"{rows} tokens, bf16, {model.flops / 1e12:.1f} TFLOP",
            "library_threads": ps.get_num_threads(),
        },
    )

    def inputs(_r: int) -> tuple[list[Any], tuple[Any, ...]]:
        sample = pool.sample(batch)
        host = (sample.next_token, sample.next_sibling, sample.draft_tokens)
        arrays = tuple(torch.from_numpy(a).to(device) for a in host)
        sync()
        return sample.matchers, arrays

    def step(body: Callable[[list[Any], tuple[Any, ...]], Any]) -> Callable[[Any], Any]:
        def prepare(data: Any) -> Callable[[], Any]:
            def call() -> Any:
                out = body(*data)
                sync()
                return out

            return call

        return prepare

    def forward_apply(_m: list[Any], _a: tuple[Any, ...]) -> Any:
        return ps.apply_vocab_mask(model.forward(), premask)

    def build(matchers: list[Any], arrays: tuple[Any, ...]) -> Any:
        return ps.build_grammar_vocab_mask(matchers, ps.GrammarTree.from_device(*arrays), vocab)

    def serial(matchers: list[Any], arrays: tuple[Any, ...]) -> Any:
        tree = ps.GrammarTree.from_device(*arrays)
        logits = model.forward()
        sync()
        return ps.apply_vocab_mask(logits, ps.build_grammar_vocab_mask(matchers, tree, vocab))

    def library(matchers: list[Any], arrays: tuple[Any, ...]) -> Any:
        tree = ps.GrammarTree.from_device(*arrays)
        logits = model.forward()
        return ps.apply_vocab_mask(logits, ps.build_grammar_vocab_mask(matchers, tree, vocab))

    def same_stream(matchers: list[Any], arrays: tuple[Any, ...]) -> Any:
        tree = ps.GrammarTree.from_device(*arrays)
        logits = model.forward()
        ps.build_host_bitmask(matchers, tree, vocab, out=pinned_np)
        return ps.apply_vocab_mask(logits, pinned.to(device, non_blocking=True))

    methods = [
        Method("forward + apply", step(forward_apply)),
        Method("build", step(build)),
        Method("serial", step(serial)),
        Method("library upload", step(library)),
        Method("same-stream upload", step(same_stream)),
    ]
    agree: list[bool] = []

    def on_warmup(_data: Any, results: dict[str, Any]) -> None:
        # the banned pattern, not the values: matmul results need not be bit-reproducible
        banned = [torch.isneginf(results[k]) for k in ("library upload", "serial")]
        banned.append(torch.isneginf(results["same-stream upload"]))
        agree.append(all(torch.equal(banned[0], b) for b in banned[1:]))

    seconds, _ = run_rounds(methods, inputs, profile.plan, on_warmup=on_warmup)
    med = {k: median(v) for k, v in seconds.items()}
    timer = cuda_event_timer() if cuda else host_timer
    forward_s = float(np.median([timer(model.forward) for _ in range(5)]))
    build_s = med["build"]
    rec.check("overlap", "the three steps ban the same logits", all(agree))
    record: dict[str, Any] = {
        "batch": batch,
        "nodes": nodes,
        "tokens": rows,
        "rounds": len(seconds["build"]),
        "seconds": med,
        "forward_event_seconds": forward_s,
        "forward_tflops": model.flops / forward_s / 1e12,
        "threads": ps.get_num_threads(),
    }
    for name in ("library upload", "same-stream upload"):
        record[name] = {
            "hidden": (med["serial"] - med[name]) / build_s,
            "exposed_s": med[name] - med["forward + apply"],
        }
    rec.add("overlap", record)
