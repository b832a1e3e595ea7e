"""Hints name an option as the user in front of them sets it: the constructor argument under plain
Python / L.Trainer, the flag under the `gradsync` command."""

import pytest

from gradsync.cli.main import main
from gradsync.errors import OptionError, spell
from gradsync.strategies.async_ps import AsyncPSStrategy
from gradsync.strategies.compressed import CompressedStrategy


def test_spell_follows_the_entry_point(monkeypatch):
    monkeypatch.delenv("GRADSYNC_ENTRY", raising=False)
    assert spell("find_unused_parameters", True) == "find_unused_parameters=True"
    assert spell("codec", "sign") == "codec='sign'"
    monkeypatch.setenv("GRADSYNC_ENTRY", "cli")
    assert spell("find_unused_parameters", True) == "--strategy.find_unused_parameters true"
    assert spell("codec", "sign") == "--strategy.codec sign"


def test_python_users_are_not_told_cli_flags(monkeypatch):
    monkeypatch.delenv("GRADSYNC_ENTRY", raising=False)
    for build in (lambda: CompressedStrategy(codec="powersgd", warmup_steps=0),
                  lambda: CompressedStrategy(codec="int8", momentum_correction=False),
                  lambda: AsyncPSStrategy(num_servers=0),
                  lambda: AsyncPSStrategy(max_staleness=-1)):
        with pytest.raises(OptionError) as err:
            build()
        assert "--strategy" not in str(err.value), str(err.value)
    with pytest.raises(OptionError, match=r"set warmup_steps=2 or more, or error_feedback=False warm_start=False"):
        CompressedStrategy(codec="powersgd", warmup_steps=0)


def test_cli_users_are_told_flags(capsys):
    assert main(["fit", "--strategy", "compressed", "--strategy.codec", "powersgd", "--strategy.warmup_steps", "0",
                 "--accelerator", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "set --strategy.warmup_steps 2 or more, or --strategy.error_feedback false --strategy.warm_start false" \
        in err, err
