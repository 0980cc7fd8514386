"""Comparisons shared by the tests."""

from __future__ import annotations

import torch


def assert_close_to_scale(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5,
                          msg=None) -> None:
    """``got`` equals ``want`` to ``rtol`` of ``want``'s largest magnitude (and ``rtol``
    elementwise): ``atol = rtol * max|want|``.

    For gradients: at init many are ~1e-7, so a fixed ``atol`` such as 1e-5 passes
    a halved gradient; held to its own scale, the same tolerance catches it.

    The scale is taken over ``want``'s finite entries, so an inf or NaN there cannot
    make ``atol`` infinite (and pass everything); those entries are still compared
    by ``assert_close`` itself. An all-zero ``want`` (a clamped coefficient, a
    gradient nothing flows into) has no scale to be relative to: the tolerance is
    then zero and ``got`` must be exactly zero too, since any nonzero value is the
    very leak such a reference exists to rule out.

    ``msg`` (a name) is put before ``assert_close``'s own report, not in its place.
    """
    finite = want[torch.isfinite(want)]
    scale = finite.abs().max().item() if finite.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * scale,
                               msg=None if msg is None else lambda report: f"{msg}: {report}")
