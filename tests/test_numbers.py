"""How changes and ratios print: a percentage while it reads, a factor beyond 10x, powers of ten beyond 10,000."""

from __future__ import annotations

import pytest

from tb_gradhealth.numbers import format_change, format_ratio

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("change", "text"), [
    (0.38, "+38%"), (-0.62, "-62%"), (0.0001, "0%"), (-0.0001, "0%"), (9.0, "+900%"), (0.0, "0%"),
    (11.0, "x12"), (7.0535602186242e19 - 1.0, "x7.1e19"), (-0.9988, "x0.0012"), (-0.999999, "x1e-6"),
    (float("nan"), "-"), (None, "-"),
])
def test_a_change_is_a_percentage_up_to_ten_times_and_a_factor_beyond(change: float | None, text: str) -> None:
    assert format_change(change) == text


@pytest.mark.parametrize(("ratio", "text"), [
    (1.03, "x1.03"), (2.414, "x2.41"), (0.51, "x0.51"), (12.3, "x12"), (341.0, "x340"), (9999.0, "x10000"),
    (7.0535602186242e19, "x7.1e19"), (1.2e-5, "x1.2e-5"), (0.0012, "x0.0012"), (float("inf"), "-"),
])
def test_a_ratio_reads_in_significant_figures_and_powers_of_ten_beyond_ten_thousand(ratio: float, text: str) -> None:
    assert format_ratio(ratio) == text
