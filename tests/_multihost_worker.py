"""One process of the multi-process JAX test (``tests/test_multihost_jax.py``).

Run as ``python _multihost_worker.py PROCESS_ID PORT`` with ``JAX_PLATFORMS=cpu`` and
``XLA_FLAGS=--xla_force_host_platform_device_count=2``: two such processes join through
``jax.distributed`` into one mesh of 4 CPU devices. Every process builds the same global
test data, holds the matchers of its own requests only (the rows its devices hold), and
checks the masks it can address against the oracle. Exit codes: 0 passed, 1 failed,
``SKIP`` (77) when ``jax.distributed`` cannot start here.
"""

from __future__ import annotations

import contextlib
import faulthandler
import inspect
import os
import string
import sys
import traceback
from typing import Any

SKIP = 77
PROCESSES, LOCAL_DEVICES = 2, 2
BATCH, NODES, VOCAB = 8, 4, 4096  # 2 requests per device; the tokenizer knows 772 tokens


def start(process_id: int, port: int) -> Any:
    import jax

    # cross-process collectives on the CPU (the default in some JAX versions, absent in others)
    with contextlib.suppress(Exception):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    options: dict[str, Any] = {}
    if "initialization_timeout" in inspect.signature(jax.distributed.initialize).parameters:
        options["initialization_timeout"] = 60
    try:
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=PROCESSES,
            process_id=process_id,
            **options,
        )
        assert jax.process_count() == PROCESSES
        assert len(jax.devices()) == PROCESSES * LOCAL_DEVICES
    except Exception as exc:  # any failure to start: skip
        print(f"SKIP: jax.distributed cannot start here: {type(exc).__name__}: {exc}")
        sys.stdout.flush()
        os._exit(SKIP)
    return jax


def vocabulary() -> tuple[Any, list[str]]:
    import xgrammar as xgr

    tokens = ["</s>", *string.printable[:95]]
    tokens += [a + b for a in string.ascii_lowercase for b in string.ascii_lowercase]
    info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[0])
    return xgr.GrammarCompiler(info), tokens


def main(process_id: int, port: int) -> None:
    jax = start(process_id, port)
    import jax.numpy as jnp
    import numpy as np
    from _oracle import ProtocolMatcher, Request, expected_mask
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import portable_spec as ps

    me = jax.process_index()
    mesh = Mesh(np.array(jax.devices()), ("data",))  # 4 devices, 2 per process
    rows = NamedSharding(mesh, PartitionSpec("data"))
    compiler, tokens = vocabulary()
    json_grammar = compiler.compile_builtin_json_grammar()
    regex = compiler.compile_regex(r"[a-z]+(,[0-9]+)*")
    words = VOCAB // 32

    # the global batch, built identically everywhere: root -> 1 -> 2, root -> 3 (a sibling)
    rng = np.random.default_rng(0)
    nt = np.tile([1, 2, -1, -1], (BATCH, 1))
    ns = np.tile([-1, 3, -1, -1], (BATCH, 1))
    dt = np.zeros((BATCH, NODES), np.int64)
    firsts = [tokens.index(t) for t in ("{", "[", "a", "x", '"')]
    dt[:, 1:] = rng.choice(firsts, size=(BATCH, NODES - 1))
    dt[:, 2] = [tokens.index(t) for t in ('"', "1", "b", ",", "}", "]", "a", "z")]
    kinds = [json_grammar, regex, None, json_grammar, regex, json_grammar, None, regex]
    requests = [None if k is None else Request(k) for k in kinds]
    want = expected_mask(requests, nt, ns, dt, VOCAB, words)
    mine = slice(me * BATCH // PROCESSES, (me + 1) * BATCH // PROCESSES)  # my requests
    local_rows = (mine.start * NODES, mine.stop * NODES)

    def global_tree_arrays() -> list[Any]:
        return [
            jax.make_array_from_process_local_data(rows, a[mine].astype(np.int32), (BATCH, NODES))
            for a in (nt, ns, dt)
        ]

    def matchers(constrained: bool = True) -> list[Any]:
        return [r.fresh() if r is not None and constrained else None for r in requests[mine]]

    def check_rows(mask: Any, expected: np.ndarray, per_shard: int, own: int) -> None:
        """Every addressable row shard: its requests' expected rows, then -1 padding."""
        for shard in mask.addressable_shards:
            assert shard.device.process_index == me
            block = shard.index[0].start // per_shard
            got = np.asarray(shard.data)
            np.testing.assert_array_equal(got[:own], expected[block * own : (block + 1) * own])
            assert (got[own:] == -1).all()

    checks = []

    # 1. the global tree: each process reads its own requests; the mask is global, sharded
    #    like the trees. The engine donates the tree arrays right after from_device.
    arrays = global_tree_arrays()
    tree = ps.GrammarTree.from_device(*arrays)
    assert (tree.batch, tree.nodes) == (BATCH // PROCESSES, NODES)
    jax.jit(lambda *xs: tuple(x + 1 for x in xs), donate_argnums=(0, 1, 2))(*arrays)
    assert all(a.is_deleted() for a in arrays)
    mask = ps.build_grammar_vocab_mask(matchers(), tree, VOCAB)
    assert mask.shape == (BATCH * NODES, words) and not mask.is_fully_addressable
    assert mask.sharding == rows, mask.sharding
    check_rows(mask, want, NODES * 2, NODES * 2)
    checks.append("global mask")

    # 2. apply inside a jit over the global mesh, and a reduction across processes
    logits_host = rng.standard_normal((BATCH * NODES, VOCAB)).astype(np.float32)
    logits = jax.make_array_from_process_local_data(
        rows, logits_host[local_rows[0] : local_rows[1]], logits_host.shape
    )

    @jax.jit
    def step(logits: Any, mask: Any) -> tuple[Any, Any]:  # an engine's sampling step
        masked = ps.apply_vocab_mask(logits, mask)
        return masked, jnp.isfinite(masked).sum()

    masked, kept = step(logits, mask)
    bits = np.unpackbits(want.view(np.uint8), axis=1, bitorder="little")[:, :VOCAB]
    reference = np.where(bits == 1, logits_host, -np.inf).astype(np.float32)
    for shard in masked.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), reference[shard.index])
    assert int(kept) == int(bits.sum()), (int(kept), int(bits.sum()))
    checks.append("apply in jit")

    # 3. item 13: process 1's requests have no grammar this step; both still get the mask
    #    and run the same program (a global reduction over it); no process hangs.
    tree = ps.GrammarTree.from_device(*global_tree_arrays())
    mask = ps.build_grammar_vocab_mask(matchers(constrained=me == 0), tree, VOCAB)
    assert mask is not None and mask.sharding == rows
    partly = want.copy()
    partly[BATCH // PROCESSES * NODES :] = -1
    check_rows(mask, partly, NODES * 2, NODES * 2)
    total = jax.jit(lambda m: (m == -1).sum())(mask)
    assert int(total) == int((partly == -1).sum())
    nothing = ps.build_grammar_vocab_mask([None] * (BATCH // PROCESSES), tree, VOCAB)
    assert nothing is not None and (np.asarray(nothing.addressable_shards[0].data) == -1).all()
    checks.append("no grammar on one process")

    # 4. item 14: row_capacity counts the global rows; every device: its rows, then padding
    tree = ps.GrammarTree.from_device(*global_tree_arrays())
    mask = ps.build_grammar_vocab_mask(matchers(), tree, VOCAB, row_capacity=48)
    assert mask.shape == (48, words) and mask.sharding == rows
    check_rows(mask, want, 12, NODES * 2)
    recorded = [None if m is None else ProtocolMatcher(m) for m in matchers()]
    try:
        ps.build_grammar_vocab_mask(recorded, tree, VOCAB, row_capacity=50)
        raise AssertionError("row_capacity = 50 over 4 row shards was accepted")
    except ValueError as exc:
        assert "multiple of 4" in str(exc), exc
    assert all(m is None or m.calls == [] for m in recorded)
    # a tree the host derived itself (NGRAM-like), placed on the global mesh by device=
    host_tree = ps.GrammarTree.from_host(nt[mine], ns[mine], dt[mine])
    mask = ps.build_grammar_vocab_mask(matchers(), host_tree, VOCAB, device=rows, row_capacity=48)
    assert mask.shape == (48, words) and mask.sharding == rows
    check_rows(mask, want, 12, NODES * 2)
    checks.append("row capacity")

    # 5. item 15: device strings name this process's devices
    tree = ps.GrammarTree.from_device(*global_tree_arrays())
    mask = ps.build_grammar_vocab_mask(matchers(), tree, VOCAB, device="cpu:1")
    (device,) = mask.devices()
    assert device == jax.local_devices(backend="cpu")[1] and device.process_index == me
    np.testing.assert_array_equal(np.asarray(mask), want[local_rows[0] : local_rows[1]])
    checks.append("device strings")

    print(f"OK process {me}: {', '.join(checks)}")
    sys.stdout.flush()
    jax.distributed.shutdown()  # a barrier: both processes leave together


if __name__ == "__main__":
    faulthandler.dump_traceback_later(150, exit=True)  # never outlive a hung peer for long
    try:
        main(int(sys.argv[1]), int(sys.argv[2]))
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip jax.distributed's exit barrier: the peer may be gone
    sys.stdout.flush()
    os._exit(0)
