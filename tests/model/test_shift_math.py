"""The pure shift function, document resets, coefficient modes and init."""

from __future__ import annotations

import pytest
import torch

from kvtrain.model.documents import doc_ids_from_attention_mask, doc_ids_from_cu_seqlens
from kvtrain.model.kv_shift import (
    KVShiftOptions,
    effective_coefficients,
    initial_parameter,
    shift_tokens,
)


def naive(x, coef, doc_of=None):
    s, b, h, d = x.shape
    out = torch.zeros_like(x)
    for t in range(s):
        for bi in range(b):
            for i in range(coef.shape[1]):
                if t - i < 0:
                    continue
                if doc_of is not None and doc_of[t][bi] != doc_of[t - i][bi]:
                    continue
                out[t, bi] += coef[:, i, None] * x[t - i, bi]
    return out


@pytest.mark.parametrize("window", [1, 2, 3])
def test_shift_matches_naive_loop(window):
    x = torch.randn(7, 2, 3, 4)
    coef = torch.randn(3, window + 1)
    torch.testing.assert_close(shift_tokens(x, coef), naive(x, coef))


def test_paper_equation_window_one():
    """K̂_t = α1·K_t + α2·K_{t-1}, K_{-1} = 0."""
    k = torch.arange(1.0, 5.0).view(4, 1, 1, 1)
    out = shift_tokens(k, torch.tensor([[0.25, 0.75]])).flatten()
    assert out.tolist() == [0.25, 0.25 * 2 + 0.75 * 1, 0.25 * 3 + 0.75 * 2, 0.25 * 4 + 0.75 * 3]


def test_window_longer_than_sequence():
    x = torch.randn(2, 1, 1, 3)
    coef = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    torch.testing.assert_close(shift_tokens(x, coef), naive(x, coef))


@pytest.mark.parametrize("window", [1, 3])
def test_document_reset_from_cu_seqlens(window):
    """Packed sequences: the token before a document start counts as zero."""
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    ids = doc_ids_from_cu_seqlens(cu, 9)
    assert ids.flatten().tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2]
    x = torch.randn(9, 1, 2, 4)
    coef = torch.randn(2, window + 1)
    out = shift_tokens(x, coef, ids)
    torch.testing.assert_close(out, naive(x, coef, ids.tolist()))
    # Each document alone gives the same values as inside the pack.
    for a, b in [(0, 3), (3, 4), (4, 9)]:
        torch.testing.assert_close(out[a:b], shift_tokens(x[a:b], coef))


def test_document_reset_from_attention_mask():
    """megatron's reset_attention_mask: a token that cannot see its predecessor starts a doc."""
    s, b = 6, 2
    mask = ~torch.ones(s, s, dtype=torch.bool).tril()  # True = masked
    mask = mask[None, None].repeat(b, 1, 1, 1)
    mask[1, 0, 3:, :3] = True  # batch row 1: a document starts at position 3
    ids = doc_ids_from_attention_mask(mask, s, b)
    assert ids[:, 0].tolist() == [0] * 6
    assert ids[:, 1].tolist() == [0, 0, 0, 1, 1, 1]
    # A plain causal mask has no document starts.
    assert doc_ids_from_attention_mask(mask[:1], s, 1) is None


def test_coefficient_modes():
    p = torch.tensor([[0.3, 0.7], [1.5, -0.2]])
    assert torch.equal(effective_coefficients(p, "free"), p)
    torch.testing.assert_close(effective_coefficients(p, "clamp"), torch.tensor([[0.3, 0.7], [1.0, 0.0]]))
    a = torch.tensor([[0.4]])
    gate = effective_coefficients(a, "gate")
    assert gate[0, 0].item() == pytest.approx(torch.sigmoid(torch.tensor(0.4)).item())
    assert gate.sum().item() == pytest.approx(1.0)
    g3 = effective_coefficients(torch.randn(5, 3), "gate")
    torch.testing.assert_close(g3.sum(1), torch.ones(5))


def test_init_is_paper_distribution_and_layout_invariant():
    opts = KVShiftOptions(seed=3)
    p = initial_parameter(4096, opts, layer_number=2, tensor="k")
    # α1 ~ U(0, 1), α2 = 1 - α1
    assert p.shape == (4096, 2)
    assert 0 <= p[:, 0].min() and p[:, 0].max() <= 1
    assert abs(p[:, 0].mean().item() - 0.5) < 0.03 and abs(p[:, 0].var().item() - 1 / 12) < 0.01
    torch.testing.assert_close(p.sum(1), torch.ones(4096))
    # Same seed, same values; other layer/tensor/seed, other values.
    assert torch.equal(p, initial_parameter(4096, opts, 2, "k"))
    assert not torch.equal(p, initial_parameter(4096, opts, 3, "k"))
    assert not torch.equal(p, initial_parameter(4096, opts, 2, "v"))
    assert not torch.equal(p, initial_parameter(4096, KVShiftOptions(seed=4), 2, "k"))


def test_init_longer_window_footnote_10():
    """Window 2: α1, α2 ~ U(0,1) and α3 = 1 - α1 - α2."""
    p = initial_parameter(1000, KVShiftOptions(window=2), 1, "v")
    assert p.shape == (1000, 3)
    assert (p[:, :2] >= 0).all() and (p[:, :2] <= 1).all()
    torch.testing.assert_close(p.sum(1), torch.ones(1000))


def test_gate_init_gives_uniform_alpha1():
    p = initial_parameter(4096, KVShiftOptions(mode="gate"), 1, "k")
    assert p.shape == (4096, 1)
    a1 = effective_coefficients(p, "gate")[:, 0]
    assert abs(a1.mean().item() - 0.5) < 0.03 and abs(a1.var().item() - 1 / 12) < 0.01


def test_num_params():
    assert KVShiftOptions().num_params() == 4
    assert KVShiftOptions(shift=("q", "k", "v"), window=2).num_params() == 9
    assert KVShiftOptions(mode="gate").num_params() == 2
