"""Each Triton kernel against its PyTorch reference on random ragged batches (Triton's interpreter on CPU,
the compiled kernels on a GPU): paged attention, the tree walk, Lyanna's token-info expansion, KV commit."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch

from engines.attention import SequenceLayout, build_attention_metadata, paged_attention, reference_paged_attention
from engines.draft_tree import DraftTree, merge_trees
from engines.drafters.token_info import TokenInfoEmbedding
from engines.drafters.token_info_sampling import build_subtrees, expand_depth
from engines.kv_cache import PagedKVCache, copy_slots
from engines.sampling import SamplingParams
from engines.verification import VerifyItem, follow_target, verify_batch, walk_trees
from lyanna_kernels import dispatch

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def mode():
    """Set the kernel mode for the test; back to "auto" afterwards."""
    yield dispatch.set_kernel_mode
    dispatch.set_kernel_mode("auto")


def random_parents(rng: random.Random, n: int) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def layouts(specs, block_size: int, num_blocks: int, rng: random.Random) -> list[SequenceLayout]:
    """(cached, new, parents or None) per sequence, blocks scattered over the cache."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    out = []
    for cached, new, parents in specs:
        need = -(-(cached + new) // block_size)
        table, free = free[:need], free[need:]
        out.append(SequenceLayout(table, cached, new, parents))
    return out


ATTENTION_CASES = {
    "one decode, nothing cached": lambda r: [(0, 1, None)],
    "decodes of several lengths": lambda r: [(7, 1, None), (30, 1, None), (2, 1, None), (64, 1, None)],
    "prefill from scratch and chunks after a cache": lambda r: [(0, 70, None), (40, 80, None), (3, 3, None)],
    "trees of several shapes": lambda r: [
        (12, 5, [-1, 0, 0, 1, 1]),
        (17, 1, [-1]),
        (0, 6, random_parents(r, 6)),
        (33, 40, random_parents(r, 40)),  # two mask words
        (5, 70, [-1, *range(69)]),  # a chain: three mask words
    ],
    "mixed: decode, prefill, tree": lambda r: [(9, 1, None), (0, 37, None), (16, 9, random_parents(r, 9))],
    "block boundaries": lambda r: [(15, 1, None), (16, 1, None), (16, 16, None), (31, 2, [-1, 0]), (32, 17, None)],
}


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "head_dim", "block_size"),
    [
        (torch.float32, 6, 2, 16, 16),
        (torch.float32, 9, 3, 64, 4),  # the embedded model's GQA: 3 query heads per KV head
        (torch.bfloat16, 4, 4, 32, 8),
        (torch.float16, 8, 1, 16, 16),
    ],
)
def test_paged_attention_kernel_equals_reference(mode, case, dtype, heads, kv_heads, head_dim, block_size):
    rng = random.Random(hash(case) % 1000)
    torch.manual_seed(0)
    seqs = layouts(ATTENTION_CASES[case](rng), block_size, 400, rng)
    T = sum(s.num_new for s in seqs)
    slots = 400 * block_size
    k_cache = torch.randn(slots, kv_heads, head_dim, device=DEVICE).to(dtype)
    v_cache = torch.randn(slots, kv_heads, head_dim, device=DEVICE).to(dtype)
    q = torch.randn(T, heads, head_dim, device=DEVICE)
    scale = head_dim**-0.5
    mode("triton")
    meta = build_attention_metadata(seqs, block_size, DEVICE)
    assert not meta.groups  # the kernel needs no CPU grouping
    out = paged_attention(q, k_cache, v_cache, meta, scale)
    assert out.dtype == dtype and out.shape == (T, heads * head_dim)
    want = reference_paged_attention(q.to(dtype).float(), k_cache.float(), v_cache.float(), seqs, block_size, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)
    mode("torch")
    cpu_path = paged_attention(q, k_cache, v_cache, build_attention_metadata(seqs, block_size, DEVICE), scale)
    torch.testing.assert_close(out.float(), cpu_path.float(), rtol=tol, atol=tol)


def random_trees(rng: random.Random, count: int, vocab: int) -> list[DraftTree]:
    """Trees of several shapes: a lone root, chains, wide and random trees, duplicate tokens among
    siblings, and a fused tree."""
    shapes = []
    for i in range(count):
        kind = i % 5
        n = rng.randrange(2, 40)
        if kind == 0:
            parents = [-1]
        elif kind == 1:
            parents = [-1, *range(n - 1)]
        elif kind == 2:
            parents = [-1] + [0] * (n - 1)
        else:
            parents = random_parents(rng, n)
        tokens = [rng.randrange(vocab) for _ in parents]
        if kind == 4 and len(parents) > 2:
            tokens[2] = tokens[1] if parents[2] == parents[1] else tokens[2]  # equal siblings: the first wins
        shapes.append(DraftTree(tokens, parents))
    a = DraftTree([3, 5, 6, 7], [-1, 0, 0, 1])
    shapes.append(merge_trees(a, DraftTree([3, 5, 9, 1], [-1, 0, 1, 0])))
    return shapes


def flatten(trees: list[DraftTree], targets: list[list[int]]):
    offsets = [0]
    for t in trees:
        offsets.append(offsets[-1] + t.size)

    def cat(rows):
        return torch.tensor([x for row in rows for x in row], dtype=torch.int64, device=DEVICE)

    return (
        cat(targets),
        cat([t.tokens for t in trees]),
        cat([t.parents for t in trees]),
        torch.tensor(offsets, device=DEVICE),
        max(t.depth for t in trees) + 1,
        max(t.size for t in trees),
    )


def test_tree_walk_kernel_equals_reference(mode):
    rng = random.Random(4)
    vocab = 20
    for trial in range(4):
        trees = random_trees(rng, 12, vocab)
        # The target often agrees with one of a node's children, so walks go deep.
        targets = []
        for t in trees:
            kids = t.child_lists()
            targets.append(
                [t.tokens[rng.choice(c)] if c and rng.random() < 0.8 else rng.randrange(vocab) for c in kids]
            )
        args = flatten(trees, targets)
        mode("triton")
        path, bonus = walk_trees(*args)
        mode("torch")
        ref_path, ref_bonus = walk_trees(*args)
        assert torch.equal(path.cpu(), ref_path.cpu()) and torch.equal(bonus.cpu(), ref_bonus.cpu())
        for r, (t, target) in enumerate(zip(trees, targets, strict=True)):
            want = follow_target(t, target.__getitem__)
            assert [n for n in path[r].tolist() if n >= 0] == want.path and bonus[r].item() == want.bonus
        assert trial < 1 or path.shape[1] > 2  # some walks were deep


def test_tree_walk_of_no_trees(mode):
    mode("triton")
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    path, bonus = walk_trees(empty, empty, empty, torch.zeros(1, dtype=torch.int64, device=DEVICE), 1, 1)
    assert path.shape == (0, 1) and bonus.shape == (0,)


def test_verification_with_the_walk_kernel_equals_the_batched_reference(mode):
    """verify_batch on the kernel path (draws at every node, one walk) against the level-by-level walk:
    greedy and seeded sampled trees (top-k, min-p, top-p) and a stochastic chain, same paths and bonuses."""
    rng = random.Random(7)
    vocab = 30
    trees = random_trees(rng, 10, vocab)
    trees.append(DraftTree.chain(4, [9, 10], draft_probs=torch.softmax(torch.randn(3, vocab), -1)))
    kinds = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=1.3, top_p=0.9),
    ]
    params = [kinds[i % len(kinds)] for i in range(len(trees))]
    params[-1] = SamplingParams(temperature=1.0)
    for seed in range(3):
        torch.manual_seed(seed)
        logits = (torch.randn(sum(t.size for t in trees), vocab) * 3).to(DEVICE)
        also = torch.arange(5, device=DEVICE)

        def items(seed=seed):
            return [
                VerifyItem(t, p, 1000 * seed + i, 3 * i) for i, (t, p) in enumerate(zip(trees, params, strict=True))
            ]

        mode("triton")
        got, got_also = verify_batch(items(), logits, "block", also)
        mode("torch")
        want, want_also = verify_batch(items(), logits, "block", also)
        assert got == want and got_also == want_also == list(range(5))


def token_info_inputs(seed: int, n: int, f: int, vocab: int, target_vocab: int):
    torch.manual_seed(seed)
    embedding = torch.randn(target_vocab, 16)
    info = TokenInfoEmbedding(embedding, rank=4, vocab_out=vocab).to(DEVICE)
    hot = torch.randperm(target_vocab)[: target_vocab // 2].sort().values.to(DEVICE)  # half the tokens are cold
    table = info.collapse(hot)
    raw = (torch.randn(n, vocab) * 2).to(DEVICE)
    frontier = torch.randint(0, target_vocab, (n, f), device=DEVICE)
    scores = torch.rand(n, f, device=DEVICE)
    return raw, frontier, scores, table


@pytest.mark.parametrize(
    ("k", "frontier", "vocab", "hot_vocab", "info"),
    [
        (1, 1, 700, False, True),
        (2, 2, 3000, False, True),  # the vocabulary spans several kernel passes
        (4, 4, 1500, True, True),  # a hot draft vocabulary: columns map to target tokens
        (3, 1, 2100, False, False),  # no token info: every frontier node shares the logits
        (4, 4, 900, True, False),
    ],
)
def test_token_info_expansion_kernel_equals_reference(mode, k, frontier, vocab, hot_vocab, info):
    target_vocab = 4000
    raw, tokens, scores, table = token_info_inputs(k * 10 + frontier, 5, frontier, vocab, target_vocab)
    d2t = torch.randperm(target_vocab)[:vocab].sort().values.to(DEVICE) if hot_vocab else None
    table = table if info else None
    mode("triton")
    got = expand_depth(raw, tokens, scores, table, k, d2t)
    mode("torch")
    want = expand_depth(raw, tokens, scores, table, k, d2t)
    assert torch.equal(got[0], want[0])  # candidate tokens
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-7)  # joint probabilities
    assert torch.equal(got[2], want[2])  # next frontier


def test_token_info_expansion_kernel_of_no_requests(mode):
    raw, tokens, scores, table = token_info_inputs(0, 0, 2, 300, 500)
    mode("triton")
    out_tokens, joint, keep = expand_depth(raw, tokens, scores, table, 2)
    assert out_tokens.shape == (0, 4) and joint.shape == (0, 4) and keep.shape == (0, 2)


def test_trees_built_with_the_expansion_kernel_equal_the_reference(mode):
    """Algorithm 1 end to end over requests of two widths and several depths (one a lone root)."""
    *_, table = token_info_inputs(1, 1, 1, 800, 1200)
    torch.manual_seed(2)
    steps = [3, 1, 4, 0, 2]
    logits = [torch.randn(s, 800, device=DEVICE) * 2 for s in steps]
    roots, widths = [5, 17, 900, 3, 1100], [2, 2, 3, 2, 3]
    mode("triton")
    got = build_subtrees(logits, roots, table, widths)
    mode("torch")
    want = build_subtrees(logits, roots, table, widths)
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens and g.parents == w.parents
        torch.testing.assert_close(torch.tensor(g.scores), torch.tensor(w.scores), rtol=1e-5, atol=1e-7)


def commit_cache(dtype: torch.dtype, layers: int = 3, kv_heads: int = 2, head_dim: int = 24) -> PagedKVCache:
    kv = PagedKVCache(layers, kv_heads, head_dim, 64, 4, dtype, DEVICE)
    kv.k.copy_(torch.randn(kv.k.shape))
    kv.v.copy_(torch.randn(kv.v.shape))
    return kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_commit_kernel_equals_reference_for_accepted_paths(mode, dtype):
    """Accepted paths of several requests whose trees cross block boundaries; a path [0, 2, 3] moves
    node 3 onto node 2's slot after node 2 moved away (overlapping moves)."""
    torch.manual_seed(0)
    commits = [("a", 3, [0, 2, 3]), ("b", 6, [0, 1, 5, 9]), ("c", 0, [0]), ("d", 14, [0, 4, 7, 8, 12])]
    before = commit_cache(dtype)
    for seq, base, path in commits:
        before.allocate(seq, base + max(path) + 1)
    results = []
    for kind in ("triton", "torch"):
        kv = commit_cache(dtype)
        for seq, base, path in commits:  # the same allocations give the same block tables
            kv.allocate(seq, base + max(path) + 1)
        assert kv.block_tables == before.block_tables
        kv.k.copy_(before.k)
        kv.v.copy_(before.v)
        mode(kind)
        kv.commit_paths(commits)
        results.append(kv)
    assert torch.equal(results[0].k, results[1].k) and torch.equal(results[0].v, results[1].v)
    for seq, base, path in commits:  # node path[i] now at base + i
        for i, node in enumerate(path):
            dst = before.slots(seq, base + i, base + i + 1)
            src = before.slots(seq, base + node, base + node + 1)
            assert torch.equal(results[0].k[:, dst], before.k[:, src]) and torch.equal(
                results[0].v[:, dst], before.v[:, src]
            )


def test_kv_commit_kernel_gathers_before_it_scatters(mode):
    """Arbitrary overlapping moves (a cycle and a chain of moves) behave like a gather then a scatter."""
    torch.manual_seed(1)
    src = torch.tensor([5, 9, 2, 7, 8], device=DEVICE)
    dst = torch.tensor([9, 2, 5, 8, 30], device=DEVICE)
    kv = commit_cache(torch.float32, layers=2)
    want_k, want_v = kv.k.clone(), kv.v.clone()
    want_k[:, dst], want_v[:, dst] = kv.k[:, src], kv.v[:, src]
    mode("triton")
    copy_slots(kv.k, kv.v, src, dst)
    assert torch.equal(kv.k, want_k) and torch.equal(kv.v, want_v)
    copy_slots(kv.k, kv.v, src[:0], dst[:0])  # no moves: nothing changes
    assert torch.equal(kv.k, want_k)


def test_kv_commit_kernel_on_path_moves_whose_destinations_are_other_moves_sources(mode):
    """`path_moves` of paths that skip a node: every later node moves one index down, onto the slot the
    move before it reads (a chain of 40 overlapping moves across blocks, and a shorter one beside it). The
    kernel's result equals the PyTorch reference's and node path[i] lands at base + i."""
    torch.manual_seed(2)
    commits = [("long", 5, [0, *range(2, 42)]), ("short", 2, [0, 1, 3, 4, 6])]
    kv = commit_cache(torch.float32)
    for seq, base, path in commits:
        kv.allocate(seq, base + max(path) + 1)
    tables = {s: list(t) for s, t in kv.block_tables.items()}
    src, dst = kv.path_moves(commits)
    assert len(src) == 40 + 3 and len(set(src) & set(dst)) == 39 + 2  # the overlapping case
    before_k, before_v = kv.k.clone(), kv.v.clone()
    moves = torch.tensor([src, dst], device=DEVICE)
    results = []
    for kind in ("triton", "torch"):
        k, v = before_k.clone(), before_v.clone()
        mode(kind)
        copy_slots(k, v, moves[0], moves[1])
        results.append((k, v))
    (k, v), (ref_k, ref_v) = results
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)
    for seq, base, path in commits:
        bs = kv.block_size
        for i, node in enumerate(path):
            a, b = base + i, base + node
            to, frm = tables[seq][a // bs] * bs + a % bs, tables[seq][b // bs] * bs + b % bs
            assert torch.equal(k[:, to], before_k[:, frm]) and torch.equal(v[:, to], before_v[:, frm])


KV_COMMIT_PTX = """
import json
import triton
from triton.backends import backends
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lyanna_kernels.kv_commit import _kv_commit_kernel

if "nvidia" not in backends:
    print(json.dumps(None))
else:
    signature = {"k_ptr": "*bf16", "v_ptr": "*bf16", "src_ptr": "*i64", "dst_ptr": "*i64", "num_moves": "i32",
                 "layer_stride": "i64", "row": "i32", "BLOCK_MOVES": "constexpr", "BLOCK_ROW": "constexpr"}
    source = ASTSource(fn=_kv_commit_kernel, signature=signature, constexprs={"BLOCK_MOVES": 64, "BLOCK_ROW": 128})
    print(json.dumps(triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]))
"""


def test_kv_commit_kernel_compiled_for_a_gpu_loads_then_syncs_then_stores():
    """On a GPU a program's moves run on different threads (with no order between warps), unlike Triton's
    interpreter: compiled for an H100 (no GPU needed), every global load of the kernel comes before its one
    barrier and every store after it, so no move overwrites a slot another move has yet to read. (Compiled in a
    process of its own: kernels this suite ran in Triton's interpreter leave its language objects patched.)"""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", KV_COMMIT_PTX], env=env, capture_output=True, text=True, check=True)
    ptx = json.loads(out.stdout.strip().splitlines()[-1])
    if ptx is None:
        pytest.skip("this Triton has no NVIDIA backend")
    ptx = ptx.splitlines()
    loads = [i for i, line in enumerate(ptx) if "ld.global" in line]
    stores = [i for i, line in enumerate(ptx) if "st.global" in line]
    barriers = [i for i, line in enumerate(ptx) if "bar.sync" in line or "barrier.sync" in line]
    assert loads and stores and len(barriers) == 1
    assert max(loads) < barriers[0] < min(stores)


def test_dispatch_modes(mode, monkeypatch):
    cpu = torch.zeros(1)
    mode("auto")
    assert not dispatch.use_triton(cpu)  # CPU tensors take the reference unless forced
    mode("torch")
    assert not dispatch.use_triton(cpu)
    mode("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (the suite turns it on only where there is no GPU)
    assert dispatch.use_triton(cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        dispatch.use_triton(cpu)
    with pytest.raises(ValueError, match="kernels must be one of"):
        dispatch.set_kernel_mode("cuda")
    assert Counter(dispatch.KERNEL_MODES) == Counter(["auto", "triton", "torch"])


@pytest.mark.slow
def test_kernel_benchmark_prints_one_json_line_with_every_kernel(capsys):
    from lyanna_kernels import bench

    bench.main(["--device", DEVICE, "--scale", "0.03", "--reps", "1"])
    line = capsys.readouterr().out.strip()
    assert "\n" not in line
    result = json.loads(line)
    assert result["interpreter"] == (DEVICE == "cpu")
    rows = {r["kernel"]: r for r in result["kernels"]}
    assert set(rows) == {
        "paged_attention_decode",
        "paged_attention_prefill",
        "paged_attention_tree",
        "tree_walk",
        "token_info_expansion",
        "kv_commit",
    }
    for r in rows.values():
        assert r["triton_ms"] > 0 and r["reference_ms"] > 0
        assert r["max_error"] <= (0.02 if r["kernel"].startswith("paged_attention") else 1e-6)
    assert dispatch.kernel_mode() == "auto"
