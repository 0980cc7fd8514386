"""tests/asserts.py: the comparison to a reference's own scale."""

from __future__ import annotations

import pytest
import torch

from tests.asserts import assert_close_to_scale


def test_small_gradients_are_held_to_their_scale():
    want = torch.tensor([3e-7, -1e-7, 2e-7])
    assert_close_to_scale(want * (1 + 5e-6), want)  # fp32 noise passes
    torch.testing.assert_close(want / 2, want, atol=1e-5, rtol=1e-5)  # what an atol let by
    with pytest.raises(AssertionError, match="^q: Tensor-likes are not close"):
        assert_close_to_scale(want / 2, want, msg="q")


def test_zero_reference_must_be_matched_exactly():
    assert_close_to_scale(torch.zeros(3), torch.zeros(3))
    with pytest.raises(AssertionError):
        assert_close_to_scale(torch.tensor([0.0, 1e-30, 0.0]), torch.zeros(3))


def test_non_finite_reference_does_not_widen_the_tolerance():
    want = torch.tensor([float("inf"), 1.0])
    assert_close_to_scale(want.clone(), want)
    with pytest.raises(AssertionError):
        assert_close_to_scale(torch.tensor([float("inf"), 2.0]), want)
