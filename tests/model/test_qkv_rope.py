"""The fused QKV split + KV shift + RoPE node (``kvtrain.model.qkv_rope``).

Its Triton kernels run in Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, a
process of its own: the interpreter is chosen when ``triton.jit`` decorates the
kernels, at import). Against a reference made of the existing pieces in fp64 (the
split, ``shift_tokens`` with the coefficients rounded to the dtype, megatron's
``_apply_rotary_pos_emb_bshd``): the three outputs and the gradients of ``mixed``
and of both coefficients; the in-place contract; what the node keeps for its
backward. Compilation for a GPU and speed are not checked here.
"""

from __future__ import annotations

import pytest
import torch

from .interpreter import run_interpreted

CHECK = r'''
import json, torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd as rope
from kvtrain.model import triton_qkv_rope
from kvtrain.model.kv_shift import shift_tokens
from kvtrain.model.qkv_rope import qkv_rope

torch.manual_seed(0)
default_block = triton_qkv_rope.tokens_per_block
small_block = lambda d, window: 16  # several blocks (and a lag across them) on short sequences


def documents(s, b):  # [s, b]: one-token documents, starts inside and right after blocks
    ids = torch.zeros(s, b, dtype=torch.int64)
    for row, starts in enumerate(([5, 6, 17, 30], [13, s - 1])):
        for t in starts:
            if t < s:
                ids[t:, row % b] += 1
    return ids


def make(s, b, g, d, r_q, window, docs, strided=False):
    width = (r_q + 2) * d
    mixed = torch.randn(b, s, g, width).transpose(0, 1) if strided else torch.randn(s, b, g, width)
    f = torch.randn(s + 3, 1, 1, d // 2) * 3  # longer than s: the first s rows count
    coefs = [torch.randn(g, window + 1) for _ in range(2)] if window else None
    # as SDPA's backward hands them: [b, h, s, d] permuted to [s, b, h, d]
    grads = [torch.randn(b, h, s, d).permute(2, 0, 1, 3) for h in (g * r_q, g, g)]
    return mixed, torch.cat([f, f], dim=-1), coefs, documents(s, b) if docs else None, grads


def reference(mixed, freqs, r_q, d, coefs, ids, grads, used, dtype):
    """Outputs, gradients (mixed, coefficients) and the coefficients' |.|-sums in fp64."""
    s, b, g, _ = mixed.shape
    m = mixed.to(dtype).double().requires_grad_()
    cs = [c.to(dtype).double().requires_grad_() for c in coefs] if coefs else []
    q, k, v = m.split([r_q * d, d, d], dim=-1)
    raw_k = k
    if cs:
        k, v = shift_tokens(k, cs[0], ids), shift_tokens(v, cs[1], ids)
    f = freqs[:s].double()
    outs = (rope(q.reshape(s, b, g * r_q, d), f), rope(k, f), v)
    gs = [grads[i].to(dtype).double() for i in used]
    got = torch.autograd.grad([outs[i] for i in used], [m, *cs], gs, materialize_grads=True)
    mags = []
    if cs:  # sum_t |dK^_t| |K_t-i|: what rounding errors of dcoef scale with
        zero = torch.zeros_like(raw_k, requires_grad=True)
        dkh = torch.autograd.grad(rope(zero, f), zero, gs[used.index(1)])[0] if 1 in used \
            else torch.zeros_like(raw_k)
        dvh = gs[used.index(2)] if 2 in used else torch.zeros_like(raw_k)
        for x, dy, c in ((raw_k, dkh, cs[0]), (m[..., -d:], dvh, cs[1])):
            c1 = c.detach().requires_grad_()
            mags.append(torch.autograd.grad(shift_tokens(x.detach().abs(), c1, ids), c1,
                                            dy.abs())[0])
    return [o.detach() for o in outs], got, mags


def err(a, r):
    return (a.double() - r).abs().max().item()


def ulps(a, r):
    """max |a - r| in bf16 ulps of each reference value (of 2^-16 of the largest
    at least: fp32 arithmetic, not rounding, decides the error of values near 0)."""
    floor = r.abs().max() * 2 ** -16
    ulp = 2.0 ** (torch.floor(torch.log2(r.abs().clamp_min(floor))) - 7)
    return ((a.double() - r).abs() / ulp).max().item()


def run_case(s=37, b=2, g=2, d=16, r_q=1, window=0, docs=False, dtype=torch.float32,
             used=(0, 1, 2), block=small_block, strided=False, learn=True, through=True,
             kept=True):
    """``through``: mixed is an intermediate (as the QKV projection's output in a
    layer, where the backward may write the gradient over it), else a leaf; ``kept``:
    the caller's attention keeps value (``attention_keeps_value``, the layer's case)."""
    triton_qkv_rope.tokens_per_block = block
    used = list(used)
    mixed, freqs, coefs, ids, grads = make(s, b, g, d, r_q, window, docs, strided)
    leaf = mixed.to(dtype, copy=True).requires_grad_()  # a copy: the shift writes into it
    m = leaf * 1 if through else leaf  # * 1 keeps the strides
    where = []  # did the gradient of m come in m's own memory?
    if through:
        m.register_hook(lambda grad, ptr=m.data_ptr(): where.append(grad.data_ptr() == ptr))
    cs = [c.clone().requires_grad_(learn) for c in coefs] if coefs else [None, None]
    outs = qkv_rope(m, freqs, r_q * d, *cs, ids, attention_keeps_value=kept)
    wrt = [leaf] + ([c for c in cs if c is not None] if learn else [])
    values = [o.detach().clone() for o in outs]  # value, a view of m, is gone after backward
    new = [outs[0].is_contiguous(), outs[1].is_contiguous()]
    got = torch.autograd.grad([outs[i] for i in used], wrt,
                              [grads[i].to(dtype) for i in used])
    shapes = [list(o.shape) for o in values]
    outs = values
    ref_outs, ref_got, mags = reference(mixed, freqs, r_q, d, coefs, ids, grads, used, dtype)
    res = {"s": s, "d": d, "r_q": r_q, "window": window, "docs": docs, "dtype": str(dtype),
           "used": used, "strided": strided and not m.is_contiguous(), "learn": learn,
           "through": through, "kept": kept, "in_place": where == [True],
           "block": block(d, window), "noncontiguous_grads": not grads[0].is_contiguous(),
           "shapes": shapes, "new": new,
           "scale": [r.abs().max().item() for r in ref_outs],
           "err": [err(o, r) for o, r in zip(outs, ref_outs)],
           "ulps": max(ulps(o, r) for o, r in zip((*outs, got[0]), (*ref_outs, ref_got[0]))),
           "dmixed": err(got[0], ref_got[0]), "dmixed_scale": ref_got[0].abs().max().item(),
           "dcoef": [], "dcoef_abs": []}
    for a, r, mag in zip(got[1:], ref_got[1:], mags):
        res["dcoef"].append(((a.double() - r).abs() / mag.clamp_min(1e-30)).max().item())
        res["dcoef_abs"].append(err(a, r))
    return res


cases = []
for window in (0, 1, 2, 3):  # every window with every query width, documents alternating:
    for i, r_q in enumerate((1, 2, 4)):  # every pair of the three (what a case varies)
        cases.append(run_case(window=window, docs=(window + i) % 2 == 1, r_q=r_q,
                              d=(16, 8, 12)[r_q % 3]))
for window in (0, 1, 3):
    cases.append(run_case(window=window, docs=True, r_q=2, dtype=torch.bfloat16))
for window in (0, 2):
    for used in ((1, 2), (0, 2), (0, 1)):  # no dq, no dk, no dv
        cases.append(run_case(window=window, docs=True, r_q=2, used=used))
cases += [run_case(s=2, window=3, docs=True, r_q=2),  # shorter than the window
          run_case(s=1, window=2, r_q=1),
          run_case(window=1, docs=True, r_q=4, block=default_block),  # one block, masked
          run_case(window=0, r_q=2, block=default_block),
          run_case(window=2, docs=True, r_q=2, strided=True),  # mixed [b, s]-major
          run_case(window=1, docs=True, r_q=2, learn=False),  # fixed coefficients
          run_case(window=1, docs=True, r_q=2, through=False),  # mixed a leaf
          run_case(window=3, r_q=1, through=False),
          run_case(window=0, r_q=2, kept=False),  # value not kept by the caller:
          run_case(window=1, docs=True, r_q=2, learn=False, kept=False),  # nor mixed
          run_case(window=2, r_q=2, kept=False)]  # (but for the raw K/V)
triton_qkv_rope.tokens_per_block = small_block

# The in-place contract.
contract = {}
for name, window in (("vanilla", 0), ("shift", 2)):
    mixed, freqs, coefs, ids, _ = make(37, 2, 2, 16, 2, window, True)
    m = mixed.clone().requires_grad_()
    before, version = mixed.clone(), m._version
    cs = [c.requires_grad_() for c in coefs] if coefs else [None, None]
    q, k, v = qkv_rope(m, freqs, 32, *cs, ids)
    contract[name] = {
        "untouched": torch.equal(m.detach(), before),
        "kv_untouched": torch.equal(m.detach()[..., 32:], before[..., 32:]),
        "other_q_untouched": torch.equal(m.detach()[..., 16:32], before[..., 16:32]),
        "value_in_mixed": v.untyped_storage().data_ptr() == m.untyped_storage().data_ptr()
                          and v._base is m,
        "value_columns": (v.data_ptr() - m.data_ptr()) // m.element_size(),
        "version_bumped": m._version > version,
        "query_key_new": q.untyped_storage().data_ptr() != m.untyped_storage().data_ptr()
                         and k.untyped_storage().data_ptr() != m.untyped_storage().data_ptr()}

# What the node keeps for its backward (counted through saved_tensors_hooks).
saved = {}
for name, window, learn, through in (("vanilla", 0, False, False), ("shift", 1, True, False),
                                     ("fixed", 1, False, False), ("vanilla kept", 0, False, True),
                                     ("fixed kept", 1, False, True)):
    mixed, freqs, coefs, ids, _ = make(37, 2, 2, 16, 2, window, True)
    m = mixed.clone().requires_grad_()
    m = m * 1 if through else m
    cs = [c.requires_grad_(learn) for c in coefs] if coefs else [None, None]
    kept = []
    def pack(t):
        kept.append({"shape": list(t.shape), "numel": t.numel(), "is_mixed": t is m})
        return t.detach()  # a saved output itself would keep its graph (and groups) alive
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        qkv_rope(m, freqs, 32, *cs, ids, attention_keeps_value=True)
    saved[name] = {"kept": kept, "kv_numel": 37 * 2 * 2 * 16}

# A second backward (retain_graph) gives the first one's gradients where mixed is a
# leaf (or nothing keeps it), and is refused where the first wrote over an
# intermediate mixed; create_graph (a gradient of the gradient) is refused.
mixed, freqs, coefs, ids, grads = make(37, 2, 2, 16, 2, 2, True)
twice = {}
for name, through, learn, kept in (("leaf", False, True, True), ("fixed", True, False, False),
                                   ("fixed kept", True, False, True),
                                   ("intermediate", True, True, False)):
    leaf = mixed.clone().requires_grad_()
    m = leaf * 1 if through else leaf
    cs = [c.detach().requires_grad_(learn) for c in coefs]
    outs = qkv_rope(m, freqs, 32, *cs, ids, attention_keeps_value=kept)
    wrt = [leaf, *cs] if learn else [leaf]
    first = torch.autograd.grad(outs, wrt, grads, retain_graph=True)
    for part, n in (("", 3), (" without value", 2)):  # autograd checks value (a view) first
        try:
            second = torch.autograd.grad(outs[:n], wrt, grads[:n], retain_graph=True)
            twice[name + part] = all(torch.equal(a, b) for a, b in zip(first, second)) \
                if n == 3 else True
        except RuntimeError as e:
            twice[name + part] = str(e)
cs = [c.detach().requires_grad_() for c in coefs]
outs = qkv_rope(mixed.clone().requires_grad_(), freqs, 32, *cs, ids)
try:
    torch.autograd.grad(outs, cs, grads, create_graph=True)
    twice["create_graph"] = "allowed"
except RuntimeError as e:
    twice["create_graph"] = str(e)
print(json.dumps({"cases": cases, "contract": contract, "saved": saved, "twice": twice}))
'''


@pytest.fixture(scope="module")
def interpreted():
    """The check's results from a process with ``TRITON_INTERPRET=1``."""
    return run_interpreted(CHECK)


FP32 = 1e-6  # of the largest reference value: a few fp32 roundings (see the test)
# A bf16 ulp of the largest value: rounded once. Triton's interpreter truncates fp32 to
# bf16 (error < 1 ulp) where a GPU rounds to nearest (<= 1/2 ulp).
BF16 = 2 ** -7


def _within(c, tol):
    for e, scale in zip(c["err"], c["scale"]):
        assert e <= tol * scale, c
    assert c["dmixed"] <= tol * c["dmixed_scale"], c


def test_values_and_gradients_match_the_split_shift_and_rope(interpreted):
    """fp32 against fp64 composed of the existing pieces: vanilla and windows 1-3,
    with and without documents (several per row, starts inside blocks and back to
    back), 1, 2 and 4 query heads per group (every pair of the three), d = 8, 12 (half not a power of two),
    16; s = 37 over blocks of 16 (a lag across blocks), s below the window, the
    default block (one, masked), mixed [b, s]-major, fixed coefficients, attention
    keeping value or not (the gradient in place or not). Outputs and
    dmixed within 1e-6 of scale (fp32 rotation of values < 4 and shift sums of at
    most 4 terms: a few ulps of 2^-24 relative; measured <= 1.4e-7); the coefficients'
    gradients within 1e-6 of the sum of |dK^_t|·|K_{t-i}| they are rounded against
    (tree sums of <= 1184 products: ~log2(n) + 3 roundings; measured <= 5e-8)."""
    fp32 = [c for c in interpreted["cases"] if c["dtype"] == "torch.float32"]
    assert len(fp32) == 29
    assert any(c["strided"] for c in fp32) and {c["block"] for c in fp32} == {16, 128}
    grid = [(c["window"], c["docs"], c["r_q"]) for c in fp32[:12]]
    for pairs in ({(w, r) for w, _, r in grid}, {(w, docs) for w, docs, _ in grid},
                  {(docs, r) for _, docs, r in grid}):  # every pair of values
        assert pairs == {(x, y) for x in {p[0] for p in pairs} for y in {p[1] for p in pairs}}
    assert {w for w, _, _ in grid} == set(range(4)) and {r for _, _, r in grid} == {1, 2, 4}
    assert {docs for _, docs, _ in grid} == {False, True}
    for c in fp32:
        assert c["new"] == [True, True], c
        assert c["noncontiguous_grads"] or c["s"] == 1, c  # one token: any view is contiguous
        s, b, g, d, r_q = c["s"], 2, 2, c["d"], c["r_q"]
        assert c["shapes"] == [[s, b, g * r_q, d], [s, b, g, d], [s, b, g, d]], c
        _within(c, FP32)
        assert len(c["dcoef"]) == (2 if c["window"] and c["learn"] else 0), c
        assert all(e <= 1e-6 for e in c["dcoef"]), c


def test_bf16_is_rounded_once(interpreted):
    """bf16 (vanilla, windows 1 and 3): fp32 inside and one rounding, so every element
    of the outputs and of dmixed is within one bf16 ulp of its own fp64 value (1.1:
    fp32 noise on values near 0; two roundings, as shift then RoPE in bf16, reach
    ~2 ulps); the coefficients' gradients stay fp32 sums (fp32 parameters)."""
    bf16 = [c for c in interpreted["cases"] if c["dtype"] == "torch.bfloat16"]
    assert len(bf16) == 3 and {c["window"] for c in bf16} == {0, 1, 3}
    for c in bf16:
        _within(c, BF16)
        assert c["ulps"] <= 1.1, c
        assert all(e <= 1e-6 for e in c["dcoef"]), c


def test_absent_gradients_count_as_zero(interpreted):
    """dq, dk or dv None (an output unused downstream): its part of dmixed is zero and
    the coefficients' gradients come from the rest."""
    partial = [c for c in interpreted["cases"] if len(c["used"]) == 2]
    assert {tuple(c["used"]) for c in partial} == {(1, 2), (0, 2), (0, 1)}
    assert {c["window"] for c in partial} == {0, 2}
    for c in partial:
        _within(c, FP32)


def test_vanilla_writes_nothing_and_value_is_a_view(interpreted):
    c = interpreted["contract"]["vanilla"]
    assert c["untouched"] and c["value_in_mixed"] and c["query_key_new"], c
    assert c["value_columns"] == 32 + 16 and not c["version_bumped"], c


def test_the_shift_writes_v_over_the_first_query_columns_only(interpreted):
    """V̂ goes over the first d query columns (value is that view); the other query
    head's columns and K/V stay as they were; the version counter says mixed changed."""
    c = interpreted["contract"]["shift"]
    assert not c["untouched"] and c["kv_untouched"] and c["other_q_untouched"], c
    assert c["value_in_mixed"] and c["value_columns"] == 0 and c["query_key_new"], c
    assert c["version_bumped"], c


def test_the_node_keeps_no_copy_of_k_or_v(interpreted):
    """Saved: angles, coefficients, document ids, and mixed itself only where the
    coefficients learn or, an intermediate, attention keeps its value view anyway;
    nothing else of K's or V's size."""
    want_mixed = {"vanilla": 0, "shift": 1, "fixed": 0, "vanilla kept": 1, "fixed kept": 1}
    for name, s in interpreted["saved"].items():
        kept = s["kept"]
        assert sum(k["is_mixed"] for k in kept) == want_mixed[name], (name, kept)
        assert all(k["is_mixed"] or k["numel"] < s["kv_numel"] for k in kept), (name, kept)
    assert len(interpreted["saved"]["vanilla"]["kept"]) == 1  # the angles


def test_a_second_backward_matches_or_is_refused_and_create_graph_is_refused(interpreted):
    """retain_graph: a leaf mixed, or fixed coefficients where nothing keeps mixed, give
    the first gradients again; an intermediate mixed the node kept (learned
    coefficients, or attention keeping its value view), whose memory the first backward
    took for the gradient, is refused in one line that names the way out."""
    t = interpreted["twice"]
    assert t["leaf"] is True and t["fixed"] is True, t
    assert t["leaf without value"] is True and t["fixed without value"] is True, t
    for name in ("intermediate", "fixed kept"):
        # through V̂ (a view of mixed) autograd refuses by itself; without it, the node
        assert "modified inplace" in t[name] and "\n" not in t[name], t
        refused = t[name + " without value"]
        assert "ran twice" in refused and "model.rope_kernel: torch" in refused, t
        assert "\n" not in refused, t
    assert "create_graph=True" in t["create_graph"] and "\n" not in t["create_graph"], t


def test_the_gradient_is_written_over_mixed_where_the_node_keeps_it(interpreted):
    """An intermediate mixed (the layer's case) that the node keeps, for learned
    coefficients or because attention keeps its value view anyway: the gradient of mixed
    comes in mixed's own memory, vanilla and shift alike, so the backward holds no second
    buffer of its size and both arms make the same requests (vanilla allocating its
    gradient moved the allocator's packing of what followed: 1.5 MiB at the small
    shape, replayed). Not where nothing keeps mixed, nor a leaf (the caller's memory);
    the values are checked with the others."""
    cases = interpreted["cases"]
    for c in cases:
        want = c["through"] and (c["kept"] or (c["learn"] and c["window"] > 0))
        assert c["in_place"] == want, c
    assert sum(c["in_place"] for c in cases) >= 20
    assert any(c["in_place"] and c["window"] == 0 for c in cases)  # vanilla
    assert any(not c["in_place"] and c["through"] and not c["kept"] for c in cases)
    assert any(not c["through"] and c["window"] for c in cases)


def _inputs(s=5, b=2, g=2, d=8, r_q=2):
    mixed = torch.randn(s, b, g, (r_q + 2) * d)
    freqs = torch.randn(s, 1, 1, d)
    return mixed, freqs, r_q * d


@pytest.mark.parametrize("change, words", [
    (lambda m, f, q: (m[0], f, q, None, None, None), "mixed [s, b, g, q + 2d]"),
    (lambda m, f, q: (m.transpose(2, 3).contiguous().transpose(2, 3), f, q, None, None, None),
     "unit stride"),
    (lambda m, f, q: (m, f, q + 2, None, None, None), "query_width"),
    (lambda m, f, q: (m, f[..., :4], q, None, None, None), "all of an even head dim"),
    (lambda m, f, q: (m, f[:3], q, None, None, None), "[>= 5, 1, 1, 8]"),
    (lambda m, f, q: (m[..., :28], f[..., :7], 14, None, None, None), "all of an even head dim"),
    (lambda m, f, q: (m, f.requires_grad_(), q, None, None, None), "fixed angles"),
    (lambda m, f, q: (m, f, q, torch.ones(2, 2), None, None), "both coefficients"),
    (lambda m, f, q: (m, f, q, torch.ones(3, 2), torch.ones(3, 2), None), "[g = 2, w+1]"),
    (lambda m, f, q: (m, f, q, None, None, torch.zeros(5, 3, dtype=torch.long)), "doc_ids"),
    (lambda m, f, q: (m, f, q, None, None, torch.zeros(5, 2)), "integer doc_ids"),
])
def test_shapes_it_cannot_take_are_refused_in_one_line(change, words):
    from kvtrain.model.qkv_rope import qkv_rope

    with pytest.raises(ValueError) as e:
        qkv_rope(*change(*_inputs()))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_launcher_refuses_partial_rotary():
    """Called without the node: ValueError before any kernel (rotary_percent < 1)."""
    from kvtrain.model import triton_qkv_rope

    mixed, freqs, q = _inputs()
    with pytest.raises(ValueError, match="all of an even head dim"):
        triton_qkv_rope.forward(mixed, freqs[..., :4], q)


def test_the_launcher_writes_in_place_only_over_a_mixed_with_a_unit_stride():
    """``in_place`` without a mixed, or over one without a unit last stride: ValueError
    before any kernel."""
    from kvtrain.model import triton_qkv_rope

    mixed, freqs, q = _inputs()
    grads = [torch.randn(5, 2, 4, 8), torch.randn(5, 2, 2, 8), torch.randn(5, 2, 2, 8)]
    coefs = [torch.rand(2, 2), torch.rand(2, 2)]
    strided = mixed.transpose(2, 3).contiguous().transpose(2, 3)
    for m, cs, need in ((None, (None, None), False), (strided, coefs, True),
                        (strided, (None, None), False)):
        with pytest.raises(ValueError, match="in place only over a mixed it is given"):
            triton_qkv_rope.backward(m, freqs, q, *cs, None, *grads, need_coef=need,
                                     in_place=True)
