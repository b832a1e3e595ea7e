"""The schedule and the state registry of gradsync.algorithms: pure torch, no processes."""

import pytest
import torch

from gradsync.algorithms import Schedule, StateRegistry, strided_fragments
from gradsync.algorithms.state import mean_of
from gradsync.errors import OptionError


def test_schedule_counts_warmup_period_and_fragments():
    s = Schedule(period=8, warmup_steps=3, fragments=4, sync_delay=1)
    seen = []
    for _ in range(3 + 16):
        seen.append((s.num_steps, s.in_warmup))
        s.num_steps += 1
    assert [w for _, w in seen[:4]] == [True, True, True, False]  # steps 0, 1, 2 are warm-up steps
    assert s.local_steps == 16 and s.steps_in_period == 0
    # fragment k after local steps 2k, 2k + 8 (offset k * period / fragments), landing one step later
    due = [(t, s.due_fragment(t)) for t in range(1, 17) if s.due_fragment(t) is not None]
    assert due == [(2, 1), (4, 2), (6, 3), (8, 0), (10, 1), (12, 2), (14, 3), (16, 0)]
    assert [s.fragment_offset(k) for k in range(4)] == [0, 2, 4, 6]
    assert not s.lands(8, 8) and s.lands(8, 9)


@pytest.mark.parametrize("options, option", [
    ({"period": 0}, "period"), ({"period": 2.5}, "period"), ({"warmup_steps": -1}, "warmup_steps"),
    ({"period": 8, "fragments": 3}, "fragments"), ({"period": 8, "fragments": 4, "sync_delay": 2}, "sync_delay"),
    ({"sync_delay": -1}, "sync_delay"),
])
def test_schedule_refuses_bad_options_in_one_line(options, option):
    with pytest.raises(OptionError) as e:
        Schedule(**options)
    assert e.value.option == option and "\n" not in str(e.value)


def test_strided_fragments_spread_the_depth():
    names = [f"blocks.{i}.{w}" for i in range(4) for w in ("weight", "bias")] + ["head.weight"]
    assert strided_fragments(names, 2) == [[0, 1, 4, 5, 8], [2, 3, 6, 7]]


def test_registry_saves_loads_and_reshards_by_kind():
    box = {"steps": 5, "local": torch.tensor([1.0, 3.0]), "residual": torch.ones(2), "count": torch.tensor(7)}
    reg = StateRegistry()
    reg.register("steps", "replicated", lambda: box["steps"], lambda v: box.update(steps=v))
    reg.register("local", "averaged", lambda: box["local"], lambda v: box.update(local=v))
    reg.register("residual", "per_rank", lambda: box["residual"], lambda v: box.update(residual=v),
                 label="error-feedback residuals")
    saved = reg.state_dict()
    box.update(steps=0)
    reg.load_state_dict(saved)
    assert box["steps"] == 5
    parts = [{"steps": 5, "local": torch.tensor([1.0, 3.0]), "residual": torch.ones(2)},
             {"steps": 5, "local": torch.tensor([3.0, 5.0]), "residual": torch.zeros(2)}]
    out = reg.reshard(parts)
    assert out.state["steps"] == 5 and torch.equal(out.state["local"], torch.tensor([2.0, 4.0]))
    assert "residual" not in out.state
    assert (out.kept, out.averaged, out.reset) == (["steps"], ["local"], ["error-feedback residuals"])
    with pytest.raises(ValueError, match="twice"):
        reg.register("steps", "replicated", lambda: 0, lambda v: None)


def test_mean_of_nested_state():
    a = {"w": torch.tensor([1.0]), "n": torch.tensor(3), "xs": [torch.tensor([2.0])]}
    b = {"w": torch.tensor([2.0]), "n": torch.tensor(9), "xs": [torch.tensor([4.0])]}
    m = mean_of([a, b])
    assert torch.equal(m["w"], torch.tensor([1.5])) and int(m["n"]) == 3 and torch.equal(m["xs"][0], torch.tensor([3.0]))


def test_codec_change_is_detected_once_for_every_strategy():
    from gradsync.algorithms.state import codec_change

    int8 = {"name": "int8", "error_feedback": True, "chunk_size": 512}
    assert codec_change(None, int8) is None  # nothing saved: nothing to refuse
    assert codec_change(dict(int8), int8) is None
    said = codec_change(int8, {**int8, "chunk_size": 256})
    assert said == ("checkpoint was written with codec int8 (error_feedback True, chunk_size 512), "
                    "this run uses int8 (error_feedback True, chunk_size 256)")
    # compressed: residuals of velocities are not residuals of gradients
    assert "momentum_correction False" in codec_change({"name": "topk", "momentum_correction": False},
                                                       {"name": "topk", "momentum_correction": True})
