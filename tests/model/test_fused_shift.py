"""The fused shift (kvtrain.model.shift_kernels) against the reference ``shift_tokens``:
values and gradients for every variant, on both CPU kernels (``torch`` ops and the
``native`` C++ operators), and what it keeps for backward."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

import kvtrain.model.kv_shift as kv_shift_module
from kvtrain.config import ModelConfig
from kvtrain.config.schema import KVShiftConfig
from kvtrain.model.builder import build_gpt, transformer_config
from kvtrain.model.kv_shift import effective_coefficients, shift_tokens
from kvtrain.model.shift_kernels import FusedShift, QKVShift, fused_shift, fused_shift_qkv
from tests.asserts import assert_close_to_scale

FP32 = dict(atol=1e-6, rtol=1e-6)
CPU_KERNELS = ["torch", "native"]


@pytest.fixture(autouse=True)
def _seeded():
    """Each test draws the same data whatever ran before it."""
    torch.manual_seed(0)


def documents(s: int, b: int, kind: str):
    """``[s, b]`` document ids; ``starts`` puts a one-token document at position 0,
    consecutive one-token documents, and a different layout in each batch row."""
    if kind == "none":
        return None
    ids = torch.zeros(s, b, dtype=torch.int64)
    starts = {0: [1, 2, 3, 7], 1: [4, 5, s - 1]}  # batch row -> token positions starting a document
    for row in range(b):
        for t in starts[row % 2]:
            ids[t:, row] += 1
    return ids


def values_and_grads(fn, x, coef, doc_ids, seed=0):
    x = x.detach().requires_grad_()
    coef = coef.detach().requires_grad_()
    y = fn(x, coef, doc_ids)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed))
    dy = dy.to(device=y.device, dtype=y.dtype)  # drawn on the CPU: the same values anywhere
    dx, dcoef = torch.autograd.grad(y, (x, coef), dy)
    return y, dx, dcoef


@pytest.mark.parametrize("impl", CPU_KERNELS)
@pytest.mark.parametrize("docs", ["none", "starts"])
@pytest.mark.parametrize("window", [1, 2, 3])
def test_matches_shift_tokens_fp32(window, docs, impl):
    s, b, h, d = 11, 2, 3, 8
    x = torch.randn(s, b, h, d)
    coef = torch.randn(h, window + 1)
    assert_shift_matches(impl, x, coef, documents(s, b, docs))


def assert_shift_matches(impl, x, coef, doc_ids):
    """``fused_shift`` (``impl``) against ``shift_tokens``: values and dx in fp32; dcoef
    sums s·b·d products, whose fp32 order differs from autograd's, so it is held
    against the float64 reference."""
    y, dx, dcoef = values_and_grads(partial(fused_shift, impl=impl), x, coef, doc_ids)
    y_ref, dx_ref, _ = values_and_grads(shift_tokens, x, coef, doc_ids)
    torch.testing.assert_close(y, y_ref, **FP32)
    torch.testing.assert_close(dx, dx_ref, **FP32)
    dcoef_64 = values_and_grads(shift_tokens, x.double(), coef.double(), doc_ids)[2]
    torch.testing.assert_close(dcoef.double(), dcoef_64, atol=1e-5, rtol=1e-6)


def qkv_reference(mixed, coef_k, coef_v, doc_ids=None, query_width=0, impl=None):
    """Q, and K and V shifted one by one with ``shift_tokens``, from ``mixed [s, b, g, q+2d]``."""
    d = (mixed.shape[-1] - query_width) // 2
    q, k, v = mixed.split([query_width, d, d], dim=-1)
    return q, shift_tokens(k, coef_k, doc_ids), shift_tokens(v, coef_v, doc_ids)


def qkv_run(fn, mixed, coefs, doc_ids, query_width, grads, impl=None):
    """Outputs and the gradients of (mixed, coef_k, coef_v) for output gradients ``grads``."""
    mixed = mixed.detach().requires_grad_()
    coefs = [c.detach().requires_grad_() for c in coefs]
    out = fn(mixed, *coefs, doc_ids, query_width, impl=impl)
    used = [(o, g.to(o.dtype)) for o, g in zip(out, grads) if g is not None]
    return (*out, *torch.autograd.grad([o for o, _ in used], (mixed, *coefs),
                                       [g for _, g in used]))


@pytest.mark.parametrize("impl", CPU_KERNELS)
@pytest.mark.parametrize("docs", ["none", "starts"])
@pytest.mark.parametrize("window", [1, 2, 3])
def test_qkv_shift_matches_shift_tokens_fp32(window, docs, impl):
    """Q, K and V from the QKV output in one node: values, the QKV output's gradient
    (the query's copied in) and the coefficients' (against fp64)."""
    s, b, g, q, d = 13, 2, 2, 16, 8
    mixed = torch.randn(s, b, g, q + 2 * d)
    coefs = [torch.randn(g, window + 1) for _ in range(2)]
    doc_ids = documents(s, b, docs)
    # the query's gradient through a reshape, V's through a transpose (as from SDPA)
    grads = [torch.randn(s, b, g, q), torch.randn(s, b, g, d),
             torch.randn(b, s, g, d).transpose(0, 1)]
    assert_qkv_matches(impl, mixed, coefs, doc_ids, q, grads, coef_atol=1e-5)


def assert_qkv_matches(impl, mixed, coefs, doc_ids, q, grads, coef_atol):
    """``fused_shift_qkv`` (``impl``) against ``qkv_reference``: outputs and the QKV
    output's gradient in fp32, the coefficients' gradients against fp64."""
    got = qkv_run(fused_shift_qkv, mixed, coefs, doc_ids, q, grads, impl)
    want = qkv_run(qkv_reference, mixed, coefs, doc_ids, q, grads)
    for mine, ref in zip(got[:4], want[:4]):
        torch.testing.assert_close(mine, ref, **FP32)
    want_64 = qkv_run(qkv_reference, mixed.double(), [c.double() for c in coefs], doc_ids, q,
                      grads)
    for mine, ref in zip(got[4:], want_64[4:]):
        torch.testing.assert_close(mine.double(), ref, atol=coef_atol, rtol=1e-6)


@pytest.mark.parametrize("impl", CPU_KERNELS)
def test_qkv_shift_saves_only_the_raw_key_value_and_coefficients(impl):
    mixed = torch.randn(16, 2, 2, 32, requires_grad=True)
    coefs = [torch.randn(2, 2, requires_grad=True) for _ in range(2)]
    doc_ids = documents(16, 2, "starts")
    (q, k, v), seen, packed = saved_storages(
        lambda: fused_shift_qkv(mixed, *coefs, doc_ids, 16, impl=impl))
    small = {p.untyped_storage().data_ptr() for p in (*coefs, doc_ids)}
    assert packed == 4 and small < set(seen) and mixed.untyped_storage().data_ptr() not in seen
    raw_bytes = 16 * 2 * 2 * 2 * 8 * 4  # [s, b, g, 2, d] fp32: a copy of the raw K and V
    assert sum(n for ptr, n in seen.items() if ptr not in small) == raw_bytes
    assert q.data_ptr() == mixed.data_ptr()  # the query is a view of the QKV output
    # the shifted K and V do not share a storage (K's is freed after RoPE)
    assert k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()
    # gradients missing (e.g. only V used downstream) count as zero
    dmixed, dck, dcv = torch.autograd.grad(v.sum(), (mixed, *coefs))
    assert dck.abs().sum() == 0 and dcv.abs().sum() > 0
    assert dmixed[..., :24].abs().sum() == 0 and dmixed[..., 24:].abs().sum() > 0


def test_qkv_shift_native_and_torch_nodes():
    mixed = torch.randn(4, 1, 2, 24, requires_grad=True)
    coef = torch.rand(2, 2, requires_grad=True)
    assert isinstance(fused_shift_qkv(mixed, coef, coef, None, 8, impl="torch")[1].grad_fn,
                      QKVShift._backward_cls)
    assert "ShiftQKV" in fused_shift_qkv(mixed, coef, coef, None, 8, impl="native")[1].grad_fn.name()
    with pytest.raises(ValueError, match="expected mixed"):
        fused_shift_qkv(mixed, coef, coef, None, 9)


@pytest.mark.parametrize("impl", CPU_KERNELS)
def test_window_longer_than_sequence_and_non_contiguous_input(impl):
    """A strided view (as K/V are, inside the QKV output) and w >= s."""
    gen = torch.Generator().manual_seed(267)  # a draw where fp32 sums differ in order
    mixed = torch.randn(2, 3, 2, 24, generator=gen)  # [s, b, groups, (q|k|v) * d]
    k = mixed[..., 8:16]
    coef = torch.randn(2, 4, generator=gen)
    doc_ids = torch.tensor([[0], [1]]).expand(2, 3)  # stride 0 on batch
    for ids in (None, doc_ids):
        assert_shift_matches(impl, k, coef, ids)


@pytest.mark.parametrize("impl", CPU_KERNELS)
@pytest.mark.parametrize("mode", ["free", "gate", "clamp"])
def test_coefficient_modes_through_effective_coefficients(mode, impl):
    """The Function takes effective coefficients; gradients reach the stored parameter."""
    x = torch.randn(9, 2, 2, 4)
    doc_ids = documents(9, 2, "starts")
    n = 2 if mode == "gate" else 3  # window 2
    param = torch.rand(2, n) * 1.4 - 0.2  # clamp mode: some outside [0, 1]
    grads = []
    for fn in (partial(fused_shift, impl=impl), shift_tokens):
        p = param.clone().requires_grad_()
        xx = x.clone().requires_grad_()
        y = fn(xx, effective_coefficients(p, mode), doc_ids)
        y.square().sum().backward()
        grads.append((y, xx.grad, p.grad))
    (y, dx, dp), (y_ref, dx_ref, dp_ref) = grads
    torch.testing.assert_close(y, y_ref, **FP32)
    torch.testing.assert_close(dx, dx_ref, **FP32)
    # the parameter's gradient sums s*b*d products in fp32 in another order: to its scale
    assert_close_to_scale(dp, dp_ref, 1e-6)


@pytest.mark.parametrize("impl", CPU_KERNELS)
def test_gradcheck_float64(impl):
    x = torch.randn(6, 2, 2, 3, dtype=torch.float64, requires_grad=True)
    coef = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    doc_ids = documents(6, 2, "starts")
    assert torch.autograd.gradcheck(lambda a, c: fused_shift(a, c, doc_ids, impl), (x, coef))
    assert torch.autograd.gradcheck(lambda a, c: fused_shift(a, c, impl=impl), (x, coef))
    mixed = torch.randn(5, 2, 2, 10, dtype=torch.float64, requires_grad=True)
    coefs = [torch.randn(2, 2, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    assert torch.autograd.gradcheck(
        lambda m, a, c: fused_shift_qkv(m, a, c, doc_ids[:5], 4, impl), (mixed, *coefs))


@pytest.mark.parametrize("docs", ["none", "starts"])
def test_bf16_within_bf16_tolerance(docs):
    """bf16 inputs: fused and reference agree within bf16 rounding of the fp32 truth."""
    s, b, h, d = 64, 2, 2, 16
    x = torch.randn(s, b, h, d).bfloat16()
    coef = torch.randn(h, 3).bfloat16()
    doc_ids = documents(s, b, docs)
    truth = values_and_grads(shift_tokens, x.float(), coef.float(), doc_ids)
    got = values_and_grads(fused_shift, x, coef, doc_ids)
    assert all(g.dtype == torch.bfloat16 for g in got)
    for g, t in zip(got, truth):
        assert_close_to_scale(g.float(), t, 2e-2)


@pytest.mark.parametrize("impl", CPU_KERNELS)
@pytest.mark.parametrize("docs", ["none", "starts"])
def test_qkv_shift_bf16_within_bf16_tolerance(docs, impl):
    """Q/K/V in one node, bf16 (the native kernel leaves bf16 to torch ops): within
    bf16 rounding of the fp32 truth."""
    s, b, g, q, d = 64, 2, 2, 16, 16
    mixed = torch.randn(s, b, g, q + 2 * d).bfloat16()
    coefs = [torch.randn(g, 3).bfloat16() for _ in range(2)]
    doc_ids = documents(s, b, docs)
    grads = [torch.randn(s, b, g, q), torch.randn(s, b, g, d), torch.randn(s, b, g, d)]
    truth = qkv_run(qkv_reference, mixed.float(), [c.float() for c in coefs], doc_ids, q, grads)
    got = qkv_run(fused_shift_qkv, mixed, coefs, doc_ids, q, grads, impl)
    assert all(t.dtype == torch.bfloat16 for t in got)
    for mine, want in zip(got, truth):
        assert_close_to_scale(mine.float(), want, 2e-2)


@pytest.mark.parametrize("impl", CPU_KERNELS)
def test_coefficients_without_grad_and_inputs_without_grad(impl):
    x = torch.randn(5, 1, 2, 3, requires_grad=True)
    coef = torch.randn(2, 2)
    (dx,) = torch.autograd.grad(fused_shift(x, coef, impl=impl).sum(), (x,))
    (dx_ref,) = torch.autograd.grad(shift_tokens(x, coef).sum(), (x,))
    torch.testing.assert_close(dx, dx_ref, **FP32)
    coef.requires_grad_()
    (dc,) = torch.autograd.grad(fused_shift(x.detach(), coef, impl=impl).sum(), (coef,))
    (dc_ref,) = torch.autograd.grad(shift_tokens(x.detach(), coef).sum(), (coef,))
    torch.testing.assert_close(dc, dc_ref, **FP32)


def test_unknown_implementation_is_refused():
    with pytest.raises(ValueError, match="unknown shift implementation"):
        fused_shift(torch.zeros(2, 1, 1, 1), torch.ones(1, 2), impl="cuda")


# ----------------------------------------------------------------------------- what is saved
def saved_storages(fn):
    """Storages (data pointer -> bytes) that autograd saves while ``fn()`` runs, and
    how many tensors it saves."""
    seen: dict[int, int] = {}
    packed = []

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        packed.append(1)
        return t.detach()  # a saved output itself would keep its graph (and groups) alive

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, seen, len(packed)


@pytest.mark.parametrize("impl", CPU_KERNELS)
def test_saves_only_its_input_coefficients_and_doc_ids(impl):
    mixed = torch.randn(16, 2, 2, 24, requires_grad=True)  # [s, b, groups, (q|k|v) * d]
    v = mixed[..., 16:]  # a view: the raw V inside the QKV output
    coef = torch.randn(2, 3, requires_grad=True)
    doc_ids = documents(16, 2, "starts")
    y, seen, packed = saved_storages(lambda: fused_shift(v, coef, doc_ids, impl))
    if impl == "torch":
        assert isinstance(y.grad_fn, FusedShift._backward_cls)
    else:
        assert "Shift" in y.grad_fn.name()
    assert set(seen) == {p.untyped_storage().data_ptr() for p in (mixed, coef, doc_ids)}
    assert packed == 3
    # The reference saves per op: x and the coefficients again and again, and masks.
    assert saved_storages(lambda: shift_tokens(v, coef, doc_ids))[2] > 3


def sdpa_layer(mixed: torch.Tensor, shift) -> torch.Tensor:
    """The attention of a flash-style backend: split Q/K/V views, (shift), rotate, SDPA."""
    q, k, v = mixed.split([16, 8, 8], dim=-1)  # [s, b, groups, .]
    q = q.reshape(*q.shape[:2], -1, 8)  # [s, b, heads, d]
    if shift is not None:  # learned coefficients (they need the raw K/V for their gradient)
        coefs = [torch.full((2, 2), 0.5, requires_grad=True) for _ in range(2)]
        k, v = shift(k, coefs[0]), shift(v, coefs[1])
    q, k = q * 1.5, k * 1.5  # stands for RoPE: new tensors that attention saves
    return F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                          is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("impl", CPU_KERNELS)
def test_flash_style_layer_keeps_only_the_shifted_v_beyond_vanilla(impl):
    """Where attention saves its V input (SDPA, flash kernels), vanilla already keeps
    the QKV output; the shift then adds the shifted V alone (and the coefficients)."""
    mixed = torch.randn(32, 2, 2, 32, requires_grad=True)
    vanilla = saved_storages(lambda: sdpa_layer(mixed, None))[1]
    shifted = saved_storages(lambda: sdpa_layer(mixed, partial(fused_shift, impl=impl)))[1]
    v_bytes = 32 * 2 * 2 * 8 * 4
    coef_bytes = 2 * 2 * 4 * 2
    assert sum(shifted.values()) - sum(vanilla.values()) == v_bytes + coef_bytes


def sdpa_qkv_layer(mixed: torch.Tensor, query_width: int, impl) -> torch.Tensor:
    """``sdpa_layer`` with Q, K and V from ``fused_shift_qkv`` (impl None: vanilla's split)."""
    d = (mixed.shape[-1] - query_width) // 2
    if impl is None:
        q, k, v = mixed.split([query_width, d, d], dim=-1)
    else:  # learned coefficients (they need the raw K/V for their gradient)
        coef = torch.full((mixed.shape[2], 2), 0.5, device=mixed.device, dtype=mixed.dtype,
                          requires_grad=True)
        q, k, v = fused_shift_qkv(mixed, coef, coef, None, query_width, impl=impl)
    q = q.reshape(*q.shape[:2], -1, d)  # [s, b, heads, d]
    q, k = q * 1.5, k * 1.5  # stands for RoPE: new tensors that attention saves
    return F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                          is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("impl", CPU_KERNELS)
@pytest.mark.parametrize("heads_per_group", [1, 2])
def test_flash_style_layer_through_the_qkv_shift_keeps_no_more_than_vanilla(heads_per_group,
                                                                              impl):
    """Vanilla's attention saves V, a view that keeps the whole QKV output alive. The
    Q/K/V shift keeps the raw K and V (a copy: the QKV output is freed once Q and K
    are rotated), the shifted V (a tensor of its own: the shifted K is freed after
    RoPE) and the coefficients: with MHA as much as vanilla, with GQA less."""
    s, b, g, d = 32, 2, 2, 8
    q_width = heads_per_group * d
    mixed = torch.randn(s, b, g, q_width + 2 * d, requires_grad=True)
    vanilla = sum(saved_storages(lambda: sdpa_qkv_layer(mixed, q_width, None))[1].values())
    shifted = saved_storages(lambda: sdpa_qkv_layer(mixed, q_width, impl))[1]
    assert mixed.untyped_storage().data_ptr() not in shifted
    one = s * b * g * d * 4  # bytes of one K or V, fp32
    coef_bytes = 2 * 2 * 4
    assert sum(shifted.values()) - vanilla == one - q_width // d * one + coef_bytes


@pytest.mark.parametrize("impl", CPU_KERNELS)
def test_fixed_coefficients_keep_no_raw_copy(impl):
    """The raw K/V copy serves the coefficients' gradient alone: fixed coefficients
    (``heads.fixed``, buffers) keep none, and the QKV output's gradient is unchanged."""
    mixed = torch.randn(16, 2, 2, 24, requires_grad=True)
    fixed = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    (q, k, v), seen, _ = saved_storages(
        lambda: fused_shift_qkv(mixed, fixed, fixed, None, 8, impl=impl))
    assert sum(seen.values()) <= fixed.untyped_storage().nbytes()  # no [s, b, g, 2, d] copy
    grads = [torch.randn_like(t) for t in (q, k, v)]
    got = torch.autograd.grad((q, k, v), mixed, grads)[0]
    want = torch.autograd.grad(qkv_reference(mixed, fixed, fixed, None, 8), mixed, grads)[0]
    torch.testing.assert_close(got, want, **FP32)


@pytest.mark.parametrize("impl", CPU_KERNELS)
def test_fixed_coefficients_keep_no_input_per_tensor(impl):
    """The per-tensor shift (MLA, one-tensor variants, CP) keeps its input for the
    coefficients' gradient alone: none with fixed ones, so the input (often a view
    that holds the QKV output) is not pinned; dx is unchanged."""
    x = torch.randn(16, 2, 2, 8, requires_grad=True)
    fixed = torch.tensor([[0.25, 0.75], [1.0, 0.0]])
    y, seen, _ = saved_storages(lambda: fused_shift(x, fixed, None, impl=impl))
    assert x.untyped_storage().data_ptr() not in seen
    assert sum(seen.values()) <= fixed.untyped_storage().nbytes()
    grad = torch.randn_like(y)
    got = torch.autograd.grad(y, x, grad)[0]
    want = torch.autograd.grad(shift_tokens(x, fixed, None), x, grad)[0]
    torch.testing.assert_close(got, want, **FP32)


def one_layer(attention: str, mask: torch.Tensor, s: int, b: int) -> dict[int, int]:
    cfg = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      vocab_size=64, max_position_embeddings=s, attention=attention,
                      backend="local")
    attn = build_gpt(cfg, transformer_config(cfg)).decoder.layers[0].self_attention
    hidden = torch.randn(s, b, 64, requires_grad=True)
    seen = saved_storages(lambda: attn(hidden, mask))[1]
    params = {p.untyped_storage().data_ptr() for p in attn.parameters()}
    return {ptr: n for ptr, n in seen.items() if ptr not in params}


def test_local_layer_saves_at_most_the_qkv_output_more(mp1):
    """megatron's local attention copies V (GQA expansion), so the raw K/V views the
    shift saves keep the QKV output alive: that, and nothing more, is the extra."""
    s, b = 32, 2
    mask = ~torch.ones(s, s, dtype=torch.bool).tril()[None, None]
    mask[..., 20:, :20] = True  # two documents
    vanilla = sum(one_layer("vanilla", mask, s, b).values())
    shifted = sum(one_layer("kv_shift", mask, s, b).values())
    qkv_bytes = s * b * (4 + 2 * 2) * 16 * 4  # [s, b, (heads + 2 groups) * d] fp32
    assert 0 < shifted - vanilla <= qkv_bytes + 1024  # + coefficients and doc ids


# ----------------------------------------------------------------------------- through the model
def grad_fns(out: torch.Tensor) -> list:
    """Every node of ``out``'s autograd graph."""
    seen, stack = [], [out.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.append(fn)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return seen


@pytest.mark.parametrize("kernel", ["auto", *CPU_KERNELS])
@pytest.mark.parametrize("shift,window,mode", [
    (["k", "v"], 1, "free"), (["q", "k", "v"], 2, "gate"), (["v"], 3, "clamp"),
])
def test_model_with_fused_shift_equals_reference(mp1, monkeypatch, shift, window, mode, kernel):
    """Logits and every gradient (incl. the coefficients) of a packed two-document
    batch: the module's fused shift (each CPU kernel) against the reference shift_tokens."""
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                      vocab_size=64, max_position_embeddings=32, attention="kv_shift",
                      kv_shift=KVShiftConfig(shift=shift, window=window, mode=mode,
                                             kernel=kernel))
    model = build_gpt(cfg, transformer_config(cfg))
    tokens = torch.randint(0, 64, (2, 24))
    pos = torch.arange(24)[None].expand_as(tokens)
    mask = ~torch.ones(24, 24, dtype=torch.bool).tril()[None, None]
    mask[..., 9:, :9] = True

    def run():
        model.zero_grad()
        out = model(tokens, pos, mask)
        out.float().pow(2).mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    fused_out, fused_grads = run()
    in_place = sorted(shift) == ["k", "v"]  # K and V shifted in one node, in the QKV output
    nodes = [f.name() for f in grad_fns(model(tokens, pos, mask))]
    node = "QKVShiftBackward" if kernel == "torch" else "ShiftQKV"  # auto: native here
    assert in_place == any(node in n for n in nodes), nodes
    monkeypatch.setattr(kv_shift_module, "fused_shift",
                        lambda x, c, ids, impl=None: shift_tokens(x, c, ids))
    monkeypatch.setattr(kv_shift_module, "fused_shift_qkv", qkv_reference)
    ref_out, ref_grads = run()
    torch.testing.assert_close(fused_out, ref_out, atol=1e-5, rtol=1e-5)
    assert any(n.endswith(f"shift_{shift[0]}") for n in fused_grads)
    for name, grad in ref_grads.items():  # at init some gradients are ~1e-7: relative
        assert_close_to_scale(fused_grads[name], grad, 1e-5, msg=name)


# ----------------------------------------------------------------------------- GPU: the Triton kernels
@pytest.fixture
def triton_kernels():
    from kvtrain.model.shift_kernels import triton_available

    if not triton_available():  # CUDA builds of torch ship Triton: an install to mend
        pytest.fail("triton is not importable on this GPU machine: the Triton shift kernels "
                    "would go unchecked (auto would run torch ops)")


@pytest.mark.gpu
@pytest.mark.parametrize("docs", ["none", "starts"])
@pytest.mark.parametrize("window", [1, 2, 3])
def test_triton_matches_shift_tokens_fp32(triton_kernels, window, docs):
    s, b, h, d = 300, 2, 3, 40  # several token blocks, d not a power of two
    mixed = torch.randn(s, b, h, 3 * d, device="cuda")
    x = mixed[..., d:2 * d]  # a strided view, as K/V inside the QKV output
    coef = torch.randn(h, window + 1, device="cuda")
    doc_ids = documents(s, b, docs)
    doc_ids = doc_ids.cuda() if doc_ids is not None else None
    y, dx, dcoef = values_and_grads(lambda *a: fused_shift(*a, impl="triton"), x, coef, doc_ids)
    y_ref, dx_ref, _ = values_and_grads(shift_tokens, x, coef, doc_ids)
    torch.testing.assert_close(y, y_ref, **FP32)
    torch.testing.assert_close(dx, dx_ref, **FP32)
    dcoef_64 = values_and_grads(shift_tokens, x.double(), coef.double(), doc_ids)[2]
    torch.testing.assert_close(dcoef.double(), dcoef_64, atol=1e-4, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("docs", ["none", "starts"])
def test_triton_bf16_within_bf16_tolerance(triton_kernels, docs):
    s, b, h, d = 512, 2, 4, 64
    x = torch.randn(s, b, h, d, device="cuda").bfloat16()
    coef = torch.randn(h, 3, device="cuda").bfloat16()
    doc_ids = documents(s, b, docs)
    doc_ids = doc_ids.cuda() if doc_ids is not None else None
    truth = values_and_grads(shift_tokens, x.float(), coef.float(), doc_ids)
    got = values_and_grads(fused_shift, x, coef, doc_ids)  # Triton is the default on CUDA
    assert all(g.dtype == torch.bfloat16 for g in got)
    for g, t in zip(got, truth):
        assert_close_to_scale(g.float(), t, 2e-2)


def cuda_documents(s: int, b: int, kind: str):
    ids = documents(s, b, kind)
    return ids.cuda() if ids is not None else None


@pytest.mark.gpu
@pytest.mark.parametrize("docs", ["none", "starts"])
@pytest.mark.parametrize("window", [1, 3])
def test_triton_qkv_shift_matches_shift_tokens_fp32(triton_kernels, window, docs):
    """The compiled Q/K/V kernels (the interpreter checks their source on the CPU)."""
    s, b, g, q, d = 300, 2, 2, 3 * 40, 40
    mixed = torch.randn(s, b, g, q + 2 * d, device="cuda")
    coefs = [torch.randn(g, window + 1, device="cuda") for _ in range(2)]
    doc_ids = cuda_documents(s, b, docs)
    grads = [torch.randn(s, b, g, q, device="cuda"), torch.randn(s, b, g, d, device="cuda"),
             torch.randn(b, s, g, d, device="cuda").transpose(0, 1)]
    assert_qkv_matches("triton", mixed, coefs, doc_ids, q, grads, coef_atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("docs", ["none", "starts"])
def test_triton_qkv_shift_bf16_within_bf16_tolerance(triton_kernels, docs):
    s, b, g, q, d = 512, 2, 4, 64, 64
    mixed = torch.randn(s, b, g, q + 2 * d, device="cuda").bfloat16()
    coefs = [torch.randn(g, 2, device="cuda").bfloat16() for _ in range(2)]
    doc_ids = cuda_documents(s, b, docs)
    grads = [torch.randn(s, b, g, w, device="cuda").bfloat16() for w in (q, d, d)]
    truth = qkv_run(qkv_reference, mixed.float(), [c.float() for c in coefs], doc_ids, q, grads)
    got = qkv_run(fused_shift_qkv, mixed, coefs, doc_ids, q, grads)  # auto: Triton on CUDA
    assert all(t.dtype == torch.bfloat16 for t in got)
    for mine, t in zip(got, truth):
        assert_close_to_scale(mine.float(), t, 2e-2)


@pytest.mark.gpu
def test_flash_attention_layer_through_the_triton_qkv_shift_keeps_no_more_than_vanilla(
        triton_kernels):
    """The CPU memory test with CUDA's own SDPA kernels (bf16, MHA: flash or cuDNN;
    with GQA the kernel CUDA picks decides what attention keeps, in both arms)."""
    s, b, g, d = 256, 2, 2, 64
    heads_per_group = 1
    q_width = heads_per_group * d
    mixed = torch.randn(s, b, g, q_width + 2 * d, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
    vanilla = sum(saved_storages(lambda: sdpa_qkv_layer(mixed, q_width, None))[1].values())
    shifted = saved_storages(lambda: sdpa_qkv_layer(mixed, q_width, "triton"))[1]
    assert mixed.untyped_storage().data_ptr() not in shifted
    one = s * b * g * d * 2  # bytes of one K or V, bf16
    assert sum(shifted.values()) - vanilla <= one - heads_per_group * one + 2 * 2 * 2


# the native operators take fp32 and fp64 (auto picks torch ops for bf16)
@pytest.mark.parametrize("impl, dtype", [("torch", torch.float32), ("torch", torch.bfloat16),
                                         ("native", torch.float32)])
def test_the_coefficients_take_the_nodes_gradients_without_a_copy(impl, dtype):
    """``coef_k.grad`` and ``coef_v.grad`` are the tensors the node returned: laid out
    as the parameters, so AccumulateGrad takes them as they are. Views such as
    ``dcoef[:, 0]`` of a ``[g, 2, n]`` sum it copies, each (on the lent H200 two copy
    kernels and ~8 host operations a layer, in a step that waits on the host)."""
    s, b, g, d = 9, 2, 3, 8
    mixed = torch.randn(s, b, g, 3 * d, dtype=dtype, requires_grad=True)
    coefs = [torch.rand(g, 2, dtype=dtype, requires_grad=True) for _ in range(2)]
    returned = {}
    for name, c in zip("kv", coefs):  # the address only: a reference would force the copy
        c.register_hook(lambda grad, name=name: returned.__setitem__(name, grad.data_ptr()))
    q, k, v = fused_shift_qkv(mixed, *coefs, query_width=d, impl=impl)
    (q.float().sum() + k.float().square().sum() + v.float().sum()).backward()
    assert [c.grad.data_ptr() for c in coefs] == [returned["k"], returned["v"]]


def test_the_k_v_nodes_coefficient_gradients_are_laid_out_as_the_parameters():
    """``coefficient_gradients`` (the K+V nodes' fp32 sums -> both gradients), for the
    Triton kernels' contiguous ``[2, g, w+1]`` and torch ops' transposed ``[g, 2, w+1]``:
    each gradient contiguous, in the parameters' dtype, one cast for both (none where
    the sums already are both)."""
    from kvtrain.model.coefficient_grads import coefficient_gradients

    total = torch.randn(2, 3, 4)  # [2, g, w+1]
    for sums in (total, total.transpose(0, 1).contiguous().transpose(0, 1)):
        for dtype in (torch.float32, torch.bfloat16):
            dk, dv = coefficient_gradients(sums, dtype, None)
            for grad, i in ((dk, 0), (dv, 1)):
                assert grad.is_contiguous() and grad.dtype == dtype and grad.shape == (3, 4)
                assert torch.equal(grad, total[i].to(dtype))
            same = dtype == torch.float32 and sums.is_contiguous()
            assert (dk.untyped_storage().data_ptr() == sums.untyped_storage().data_ptr()) == same


def test_the_coefficient_gradients_go_into_megatrons_main_grad():
    """Parameters with megatron's ``main_grad`` (and its ``grad_added_to_main_grad``):
    the fp32 sums are added there, the flag is set, and autograd gets placeholders of
    the parameters' shape and dtype (zeros for ``zero_out_wgrad``); anything else, or a
    parameter that does not learn, is left to autograd."""
    from kvtrain.model.coefficient_grads import coefficient_gradients, main_grad_params

    params = [torch.nn.Parameter(torch.rand(3, 2, dtype=torch.bfloat16)) for _ in range(2)]
    assert main_grad_params(*params) is None  # no DDP
    for p in params:
        p.main_grad = torch.full((3, 2), 0.5)
        p.grad_added_to_main_grad = False
    params[1].zero_out_wgrad = True
    assert main_grad_params(*params) == tuple(params)
    sums = torch.randn(2, 3, 2)
    dk, dv = coefficient_gradients(sums, torch.bfloat16, main_grad_params(*params))
    for p, i in zip(params, (0, 1)):
        assert torch.equal(p.main_grad, 0.5 + sums[i]) and p.grad_added_to_main_grad
    assert dk.shape == dv.shape == (3, 2) and dk.dtype == dv.dtype == torch.bfloat16
    assert torch.equal(dv, torch.zeros(3, 2, dtype=torch.bfloat16))
    params[0].requires_grad_(False)
    assert main_grad_params(*params) is None
    assert main_grad_params(params[1], params[1] * 1) is None  # a derived coefficient


def test_untracked_coefficient_gradients_go_into_main_grad_alone():
    """Coefficients a node took outside autograd (``in_autograd=False``): the sums are
    added into ``main_grad``, nothing is flagged and autograd gets nothing."""
    from kvtrain.model.coefficient_grads import coefficient_gradients

    params = [torch.nn.Parameter(torch.rand(3, 2)) for _ in range(2)]
    for p in params:
        p.main_grad = torch.full((3, 2), 0.5)
        p.grad_added_to_main_grad = False
    sums = torch.randn(2, 3, 2)
    assert coefficient_gradients(sums, torch.float32, tuple(params),
                                 in_autograd=False) == (None, None)
    for p, i in zip(params, (0, 1)):
        assert torch.equal(p.main_grad, 0.5 + sums[i]) and not p.grad_added_to_main_grad