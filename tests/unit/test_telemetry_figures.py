"""One value for samples/s everywhere: rounded once, where RunTelemetry computes it."""

from gradsync.platform.progress import step_stats
from gradsync.platform.tracking import RunTelemetry


def test_samples_per_second_is_rounded_once_where_it_is_computed():
    t = RunTelemetry()
    # 761.4995 samples/s: rounded to 2 decimals it is 761.5, which the progress line shows as 762; a
    # progress line fed the raw value would show 761 next to summary.json's 761.5 (read as 762)
    t.samples_offset, t.train_offset = 1_522_999, 2000.0
    sps = t.samples_per_second()
    assert sps == 761.5
    line = step_stats({"perf/samples_per_second": sps})
    assert f"samples/s {sps:,.0f}" in line  # what a reader of summary.json formats the same way
