"""``error_feedback`` means one thing under every strategy: carry what a lossy codec dropped."""

import pytest

from gradsync.comm import LOSSY
from gradsync.comm.error_feedback import ErrorFeedback
from gradsync.errors import OptionError
from gradsync.strategies import CompressedStrategy, DiLoCoStrategy, LocalSGDStrategy


def _feedback(strategy) -> bool:
    if isinstance(strategy, CompressedStrategy):
        return isinstance(strategy._new_reducer(), ErrorFeedback)
    return strategy.error_feedback


@pytest.mark.parametrize("cls", [CompressedStrategy, LocalSGDStrategy, DiLoCoStrategy])
@pytest.mark.parametrize("codec", ["fp16", "int8", "int4", "sign", "topk"])
def test_set_on_or_off_it_is_on_or_off_for_every_lossy_codec(cls, codec):
    assert codec in LOSSY
    assert _feedback(cls(codec=codec, error_feedback=True)) is True
    assert _feedback(cls(codec=codec, error_feedback=False)) is False


def test_defaults_differ_by_strategy_and_are_documented():
    # compressed: on where a codec needs it to converge (biased codecs), off for unbiased rounding
    assert [_feedback(CompressedStrategy(codec=c)) for c in ("int8", "fp16", "sign", "topk", "powersgd")] == \
        [False, False, True, True, True]
    # local_sgd / diloco: on for every lossy codec (a round's rounding error is a whole period's)
    assert all(_feedback(cls(codec=c)) for cls in (LocalSGDStrategy, DiLoCoStrategy) for c in ("int8", "sign"))


@pytest.mark.parametrize("cls", [CompressedStrategy, LocalSGDStrategy, DiLoCoStrategy])
def test_the_exact_codec_refuses_it_in_one_line(cls):
    with pytest.raises(OptionError, match="error_feedback.*exact") as info:
        cls(codec="identity", error_feedback=True)
    assert "\n" not in str(info.value)
