"""The paired CI's Student's t quantile against published values, and the interval it gives at small n."""

from __future__ import annotations

import pytest

from eogym_sft.metrics.scoring import LARGE_DF, paired_stats, t_quantile_975, t_two_sided_mass

# Student's t 97.5% quantiles (scipy.stats.t.ppf(0.975, df), to 15 digits; tables give the first 4)
KNOWN_T975 = {
    1: 12.706204736174694, 2: 4.302652729749462, 3: 3.1824463052837078, 4: 2.7764451051977934, 5: 2.5705818356363146,
    9: 2.262157162798205, 29: 2.045229642132703, 99: 1.9842169515864174, 999: 1.9623414611334493, LARGE_DF: 1.960201239890626, 10**6: 1.959966356814107,
}


@pytest.mark.parametrize("df, quantile", KNOWN_T975.items())
def test_the_t_quantile_matches_published_values(df, quantile):
    assert t_quantile_975(df) == pytest.approx(quantile, abs=1e-11)


def test_the_two_sided_mass_in_closed_form():
    assert t_two_sided_mass(1.0, 1) == pytest.approx(0.5)  # Cauchy: atan(1) * 2 / pi
    assert t_two_sided_mass(1.0, 2) == pytest.approx(1 / 3**0.5)  # df 2: t / sqrt(2 + t^2)
    with pytest.raises(ValueError, match="at least one degree of freedom"):
        t_quantile_975(0)


def test_the_paired_ci_at_three_questions_is_students_t():
    """diffs 0, 0, 2/3 (of values past [0, 1], so nothing is clipped): SE 0.2222; the normal approximation's
    half-width was 0.436, Student's t gives 0.956."""
    out = paired_stats([0.0, 0.0, 5.0], [0.0, 0.0, 5 + 2 / 3])
    low, high = out["ci95"]
    assert out["ci_method"] == "paired t" and "ci95_normal_approx" not in out
    assert (high - low) / 2 == pytest.approx(4.302652729749462 * out["se"], rel=1e-12)
    assert round((high - low) / 2, 3) == 0.956 and round(out["se"], 4) == 0.2222
    assert paired_stats([1.0], [0.0])["ci95"] is None


@pytest.mark.parametrize("a, b, ci", [
    ([0, 0, 0], [0, 0, 2 / 3], [2 / 9 - 4.302652729749462 * 2 / 9, 1.0]),  # passes +1
    ([0, 0, 2 / 3], [0, 0, 0], [-1.0, -2 / 9 + 4.302652729749462 * 2 / 9]),  # passes -1
    ([0] * 20, [1] * 19 + [0], None),  # +0.950 over 20 questions: the t interval passes +1
])
def test_a_difference_of_proportions_never_leaves_minus_one_to_one(a, b, ci):
    """The probe's ``+0.953 [+0.883, +1.023]``: values in [0, 1] make a difference in [-1, 1], and so its interval;
    where the cut happens the record names it."""
    out = paired_stats([float(x) for x in a], [float(y) for y in b])
    assert -1 <= out["ci95"][0] <= out["ci95"][1] <= 1 and out["ci_method"] == "paired t, clipped to [-1, 1]"
    if ci is not None:
        assert out["ci95"] == pytest.approx(ci, rel=1e-12)
    assert paired_stats([0.0, 0.5, 1.0], [0.5, 0.5, 1.0])["ci_method"] == "paired t"  # inside: as it was
    wide = paired_stats([0.0, 0.0, 2.0], [3.0, 3.0, 3.0])  # counts, not proportions: never cut
    assert wide["ci_method"] == "paired t" and wide["ci95"][1] > 1
