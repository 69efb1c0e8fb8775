"""Tolerances for comparing two computations of the same float tensor, element by element.

Every element must satisfy |actual - expected| <= atol + rtol * |expected| (torch.testing's
rule), with both parts given by the test from what it compares, not from the tensors themselves:
- rtol: the rounding of the element itself, a few units in the last place (ulps) of its dtype;
- atol: the rounding an element keeps when it cancels to near zero. A sum computed in another
  order (another kernel, a fusion, a split over ranks) differs by rounding of the terms summed,
  not of the result: terms of either sign that add up to at most M are each about M / sqrt(n),
  and n roundings of them in another order differ by about eps x M. So an element near zero
  carries an error of a few ulps of M, the largest value the sums reach, whatever its own size.
`reordered` gives both for that case; other cases (a bf16 step against an fp32 one) say theirs.
`assert_close` checks the premise too: the expected tensor stays within the magnitude the bound
was written for."""

from __future__ import annotations

import torch


def reordered(magnitude: float, dtype: torch.dtype = torch.float32, ulps: int = 8) -> dict:
    """Bounds for the same arithmetic in another order, in `dtype`, over sums that reach at most
    `magnitude`: `ulps` of the element (rtol) and of `magnitude` (atol). 8 ulps leave room for
    the tail of n roundings' walk (measured: 1-2 ulps of the magnitude on x86-64)."""
    eps = torch.finfo(dtype).eps
    return {"atol": ulps * eps * magnitude, "rtol": ulps * eps, "magnitude": magnitude}


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    atol: float,
    rtol: float,
    magnitude: float | None = None,
    what: str = "",
) -> None:
    """|actual - expected| <= atol + rtol * |expected| for every element; `magnitude`: the
    largest |expected| the bounds were written for (checked). On failure: what, and torch's
    report of the worst element."""
    if magnitude is not None and expected.numel():
        largest = float(expected.detach().abs().max())
        assert largest <= magnitude, (
            f"{what}: |expected| reaches {largest:.3g}, above the {magnitude:g} its tolerance "
            "was written for"
        )
    try:
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}" if what else str(e)) from None
