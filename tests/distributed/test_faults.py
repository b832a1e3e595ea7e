"""Non-finite gradients are handled identically on every rank."""

import re

import lightning as L
import pytest
import torch

from gradsync.recipes import DigitsClassifier, DigitsData
from gradsync.strategies import LocalSGDStrategy, SyncStrategy
from harness import fit, max_abs_diff

pytestmark = pytest.mark.timeout(120)

BAD_STEP = 3


class NaNOnRank1(DigitsClassifier):
    """Rank 1 produces a NaN loss at one optimizer step; rank 0 never does."""

    def compute_loss(self, batch):
        loss = super().compute_loss(batch)
        if self.trainer.global_rank == 1 and self.trainer.global_step == BAD_STEP:
            loss = loss * float("nan")
        return loss


def model():
    L.seed_everything(0, verbose=False)
    return NaNOnRank1(lr=0.1, momentum=0.0)


@pytest.mark.parametrize("strategy_cls, options", [(SyncStrategy, {}), (LocalSGDStrategy, {"period": 4})])
def test_skip_is_taken_by_every_rank_together(tmp_path, strategy_cls, options):
    ranks = fit(model(), DigitsData(batch_size=8), strategy=strategy_cls(nonfinite_grads="skip", **options),
                devices=2, max_steps=8, out=tmp_path)
    for r in ranks:
        assert r["global_step"] == 8
        for v in r["params"].values():
            assert torch.isfinite(v).all()
    # both ranks skipped the same step and nothing else: they end on the same model after the last round
    assert max_abs_diff(ranks[0]["params"], ranks[1]["params"]) == 0.0
    assert [r["skipped"] for r in ranks] == [[BAD_STEP], [BAD_STEP]]


def test_without_protection_the_nan_spreads(tmp_path):
    ranks = fit(model(), DigitsData(batch_size=8), strategy=SyncStrategy(), devices=2, max_steps=5, out=tmp_path)
    assert not torch.isfinite(ranks[0]["params"]["head.weight"]).all()


def test_stop_names_the_step_on_every_rank(tmp_path):
    with pytest.raises(Exception, match=re.escape(f"non-finite gradient (NaN/Inf) at optimizer step {BAD_STEP}")):
        fit(model(), DigitsData(batch_size=8), strategy=SyncStrategy(nonfinite_grads="stop"), devices=2,
            max_steps=8, out=tmp_path)


def test_async_ps_drops_only_the_bad_push(tmp_path):
    from gradsync.strategies import AsyncPSStrategy

    ranks = fit(model(), DigitsData(batch_size=8), strategy=AsyncPSStrategy(max_staleness=2, nonfinite_grads="skip"),
                devices=2, max_steps=8, out=tmp_path)
    for r in ranks:
        assert r["global_step"] == 8 and all(torch.isfinite(v).all() for v in r["params"].values())
    assert max_abs_diff(ranks[0]["params"], ranks[1]["params"]) == 0.0  # both end with the server's model
    # asynchronous: only the worker with the NaN drops its push; the other's gradients all count
    assert [r["skipped"] for r in ranks] == [[], [BAD_STEP]]
