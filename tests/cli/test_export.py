"""``gradsync export``: a run's model as one plain state_dict that loads into the unsharded module."""

import pytest
import torch

from gradsync.cli.main import main
from gradsync.recipes import DigitsClassifier

pytestmark = pytest.mark.timeout(120)


def test_export_writes_the_checkpoints_weights_as_a_plain_state_dict(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["fit", "--recipe", "digits", "--accelerator", "cpu", "--max-steps", "3", "--output-dir", str(out)]) == 0
    capsys.readouterr()
    assert main(["export", str(out)]) == 0
    assert f"wrote {out / 'model.pt'}" in capsys.readouterr().out
    state = torch.load(out / "model.pt", weights_only=True)  # plain tensors only
    trained = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert state.keys() == trained.keys() and all(torch.equal(state[k], trained[k]) for k in state)
    model = DigitsClassifier()
    model.load_state_dict(state)  # strict: every key of the unsharded module, nothing else
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters())
    untrained = DigitsClassifier().state_dict()
    assert any(not torch.equal(state[k], untrained[k]) for k in state)  # the trained weights, not a fresh model
    # a checkpoint file and another destination
    assert main(["export", str(out / "checkpoints" / "last.ckpt"), "--output", str(tmp_path / "x" / "m.pt")]) == 0
    again = torch.load(tmp_path / "x" / "m.pt", weights_only=True)
    assert all(torch.equal(again[k], state[k]) for k in state)


def test_export_of_nothing_is_one_line(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no checkpoint there" in err
