"""The run summary's largest-process memory figures are the largest process's, on processes of different sizes."""

import pytest
import torch

from gradsync.platform.memory import MemoryProbe
from harness import run_gloo

pytestmark = pytest.mark.timeout(60)


class _Module(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(width, width, bias=False)


def summary_of_a_process_of_its_own_size(rank: int, world: int) -> dict:
    module = _Module(width=4 * (rank + 1))  # rank r holds (4(r+1))^2 fp32 parameters: sizes differ
    probe = MemoryProbe()
    algorithm = {"residual": torch.zeros(10 * (world - rank))}  # and the algorithm state the other way round
    return probe.summary(trainer=None, pl_module=module, algorithm_state=algorithm)


@pytest.mark.parametrize("world", [2, 3])
def test_largest_process_figures_are_the_maximum_over_processes(tmp_path, world):
    out = run_gloo(summary_of_a_process_of_its_own_size, world, tmp=tmp_path)
    totals = [(4 * (r + 1)) ** 2 * 4 + 10 * (world - r) * 4 for r in range(world)]
    for r, figures in enumerate(out):
        assert figures["parameter_bytes"] == (4 * (r + 1)) ** 2 * 4 and figures["total_bytes"] == totals[r]
        assert figures["max_total_bytes_any_process"] == max(totals)
        assert figures["max_peak_rss_bytes_any_process"] == max(f_["max_peak_rss_bytes_any_process"] for f_ in out)
    assert len(set(totals)) == world  # the processes really differ (the smallest is not the largest)
