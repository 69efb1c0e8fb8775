"""Tolerances that follow the scale of what is compared.

Two computations of the same float tensor in another order (a different summation order, kernel
or CPU) differ by rounding that grows with the magnitudes summed into each element, not with the
element itself: an element near zero of a gradient whose other elements are near 4 carries an
error of about 4 x eps x sqrt(terms). A fixed absolute tolerance is then too tight on large
tensors (and fails on another CPU) or too loose on small ones (and proves nothing).
`assert_close_at_scale` takes the absolute tolerance as `rel` times the largest magnitude of the
expected tensor, and the relative one as `rel` (or `rtol`)."""

from __future__ import annotations

import torch


def assert_close_at_scale(
    actual: torch.Tensor,
    expected: torch.Tensor,
    rel: float,
    rtol: float | None = None,
    msg: str | None = None,
) -> None:
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(
        actual,
        expected,
        rtol=rel if rtol is None else rtol,
        atol=rel * scale or rel,  # an all-zero tensor: rel itself
        msg=msg,
    )
