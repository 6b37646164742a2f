"""The correctness gate: does the DCP arm decode like the off arm?

In fp32 the two arms must agree bitwise: the same tokens and the same accept count at
every verify step.  In bf16 or fp16 they cannot: the DCP arm merges fp32 partials where
the off arm runs one low-precision attention over the whole cache, the last bits
differ, and now and then a near-tie flips a token.  There the criterion is the one the
speculative-decoding literature reports, the mean accept length, compared pairwise:

- per request ``i``, ``a_i`` and ``b_i`` are the mean accept lengths (tokens per verify
  step) of the DCP and off arms on the same prompt;
- the paired differences ``d_i = a_i - b_i`` give ``mean(d) +- 1.96 sd(d) / sqrt(n)``;
- the ratio ``mean(a) / mean(b)`` has the 95% interval ``1 + (mean(d) +- half) / mean(b)``
  (first order in the difference), which must lie inside ``[0.99, 1.01]``;
- and the two arms' histograms of accept counts must be alike: a chi-square test of
  homogeneity at p = 0.001.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

RATIO_BOUNDS = (0.99, 1.01)
CHI2_CRITICAL_P001 = (10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124, 27.877, 29.588)
"""Chi-square critical values at p = 0.001 for 1..10 degrees of freedom."""
EXACT_DTYPES = ("float32", "float64")


@dataclass(frozen=True)
class GateResult:
    dtype: str
    rule: str
    """``"exact"`` (fp32) or ``"paired"`` (bf16 / fp16)."""
    requests: int
    accept_len_dcp: float
    accept_len_off: float
    ratio: float
    ratio_interval: tuple[float, float]
    paired_difference: float
    paired_halfwidth: float
    token_identity_rate: float
    accept_counts_identical: bool
    histogram_dcp: list[int]
    histogram_off: list[int]
    chi2: float
    chi2_critical: float
    passed: bool
    why: str
    """What failed, with the numbers; empty when the gate passed."""

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        low, high = self.ratio_interval
        return (
            f"{self.rule} gate ({self.dtype}), {self.requests} requests: accept length DCP {self.accept_len_dcp:.3f} "
            f"vs off {self.accept_len_off:.3f}, ratio {self.ratio:.4f} (95% [{low:.4f}, {high:.4f}]), paired "
            f"difference {self.paired_difference:+.3f} +- {self.paired_halfwidth:.3f}, tokens identical in "
            f"{self.token_identity_rate:.0%} of requests, histograms chi2 {self.chi2:.1f} (critical "
            f"{self.chi2_critical:.1f}): {'PASS' if self.passed else 'FAIL: ' + self.why}"
        )


def _mean_accept(accepted: Sequence[int]) -> float:
    return sum(a + 1 for a in accepted) / len(accepted) if accepted else 0.0


def histogram(accept_lists: Sequence[Sequence[int]], k: int) -> list[int]:
    counts = [0] * (k + 1)
    for accepted in accept_lists:
        for a in accepted:
            counts[a] += 1
    return counts


def homogeneity_chi2(first: Sequence[int], second: Sequence[int]) -> tuple[float, int]:
    """Chi-square statistic that two histograms come from one distribution, and its
    degrees of freedom (bins that neither arm used are dropped)."""
    bins = [(x, y) for x, y in zip(first, second) if x + y > 0]
    n1, n2 = sum(x for x, _ in bins), sum(y for _, y in bins)
    if len(bins) < 2 or n1 == 0 or n2 == 0:
        return 0.0, 0
    total = n1 + n2
    chi2 = 0.0
    for x, y in bins:
        column = x + y
        for observed, row in ((x, n1), (y, n2)):
            expected = row * column / total
            chi2 += (observed - expected) ** 2 / expected
    return chi2, len(bins) - 1


def evaluate(
    tokens_dcp: Sequence[Sequence[int]],
    accepted_dcp: Sequence[Sequence[int]],
    tokens_off: Sequence[Sequence[int]],
    accepted_off: Sequence[Sequence[int]],
    *,
    k: int,
    dtype: str,
) -> GateResult:
    """The gate over per-request outputs of both arms (the same prompts, in order)."""
    if not (len(tokens_dcp) == len(accepted_dcp) == len(tokens_off) == len(accepted_off)) or not tokens_dcp:
        raise ValueError(
            f"the gate pairs requests: expected the same positive number of requests from both arms, got "
            f"{len(tokens_dcp)} / {len(accepted_dcp)} (DCP) and {len(tokens_off)} / {len(accepted_off)} (off)"
        )
    n = len(tokens_dcp)
    a = [_mean_accept(x) for x in accepted_dcp]
    b = [_mean_accept(x) for x in accepted_off]
    d = [x - y for x, y in zip(a, b)]
    mean_a, mean_b, mean_d = sum(a) / n, sum(b) / n, sum(d) / n
    sd = math.sqrt(sum((x - mean_d) ** 2 for x in d) / (n - 1)) if n > 1 else (0.0 if mean_d == 0 else math.inf)
    half = 1.96 * sd / math.sqrt(n)
    ratio = mean_a / mean_b if mean_b else math.inf
    interval = (1 + (mean_d - half) / mean_b, 1 + (mean_d + half) / mean_b) if mean_b else (math.inf, math.inf)
    identity = sum(x == y for x, y in zip(tokens_dcp, tokens_off)) / n
    counts_identical = all(list(x) == list(y) for x, y in zip(accepted_dcp, accepted_off))
    hist_a, hist_b = histogram(accepted_dcp, k), histogram(accepted_off, k)
    chi2, dof = homogeneity_chi2(hist_a, hist_b)
    critical = CHI2_CRITICAL_P001[min(dof, len(CHI2_CRITICAL_P001)) - 1] if dof else 0.0
    if dtype in EXACT_DTYPES:
        rule = "exact"
        failures = []
        if identity < 1:
            failures.append(f"tokens differ in {n - round(identity * n)} of {n} requests")
        if not counts_identical:
            failures.append("accept counts differ")
    else:
        rule = "paired"
        failures = []
        if not (RATIO_BOUNDS[0] <= interval[0] and interval[1] <= RATIO_BOUNDS[1]):
            failures.append(
                f"the ratio's 95% interval [{interval[0]:.4f}, {interval[1]:.4f}] is not inside "
                f"[{RATIO_BOUNDS[0]}, {RATIO_BOUNDS[1]}] (more requests narrow it)"
            )
        if dof and chi2 > critical:
            failures.append(f"the accept-count histograms differ (chi2 {chi2:.1f} > {critical:.1f})")
    return GateResult(
        dtype=dtype, rule=rule, requests=n, accept_len_dcp=mean_a, accept_len_off=mean_b, ratio=ratio,
        ratio_interval=interval, paired_difference=mean_d, paired_halfwidth=half, token_identity_rate=identity,
        accept_counts_identical=counts_identical, histogram_dcp=hist_a, histogram_off=hist_b, chi2=chi2,
        chi2_critical=critical, passed=not failures, why="; ".join(failures),
    )
