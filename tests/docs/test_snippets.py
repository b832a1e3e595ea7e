"""Code blocks in the docs that are meant to run do run.

A page marks such a block with an HTML comment on the line before its fence:

    <!-- runs in tests/docs/test_snippets.py: ... -->
    ```python
    ...
    ```

Every marked block must be claimed by a test here, so marking a block and forgetting to test it
fails too. (The plugin example of the strategy guide is a file included into its page; it is run by
test_examples.py.)
"""

import os
import re
import shlex
import sys
from pathlib import Path

import cli_process
import pytest

from harness import fit

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MARK = "<!-- runs in tests/docs/test_snippets.py"
pytestmark = pytest.mark.timeout(180)


def marked_blocks(page: str) -> list[str]:
    """The python blocks of ``docs/<page>`` that follow a run marker, in page order."""
    lines = (DOCS / page).read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.startswith(MARK):
            assert lines[i + 1].strip() == "```python", f"{page}:{i + 2}: a run marker must precede a ```python fence"
            end = lines.index("```", i + 2)
            blocks.append("\n".join(lines[i + 2:end]) + "\n")
    return blocks


# page -> how many marked blocks the tests below run
CLAIMED = {"getting-started.md": 2, "index.md": 1}


def test_every_marked_block_is_claimed():
    found = {p.relative_to(DOCS).as_posix(): len(marked_blocks(p.relative_to(DOCS).as_posix()))
             for p in DOCS.rglob("*.md") if MARK in p.read_text()}
    assert found == CLAIMED


def test_home_page_snippet_is_the_one_run_below():
    assert marked_blocks("index.md") == [marked_blocks("getting-started.md")[1]]


def test_getting_started_own_model_trains_and_its_command_parses(tmp_path, monkeypatch):
    import lightning as L

    from gradsync.cli.main import parse_run, validate_spec
    from gradsync.recipes.digits import DigitsData

    source = marked_blocks("getting-started.md")[0]
    package = tmp_path / "my_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    from my_pkg.models import Tiny

    # the command the page shows right after the block
    page = (DOCS / "getting-started.md").read_text()
    command = re.search(r"^gradsync fit --model my_pkg\.models\.Tiny .*$", page, re.M).group(0)
    spec = parse_run("fit", shlex.split(command)[2:])
    assert spec.model_class is Tiny and spec.model_options["hidden"] == 64 and spec.devices == 2
    validate_spec(spec)  # builds model, data and strategy as the launched processes would

    L.seed_everything(0, verbose=False)
    model = Tiny(hidden=64, lr=0.1)
    ranks = fit(model, DigitsData(batch_size=32), devices=1, max_steps=30, out=tmp_path / "run")
    assert ranks[0]["global_step"] == 30
    # it learns: from ln(10) = 2.30 for a uniform guess to well below it in 30 steps
    assert ranks[0]["metrics"]["train_loss"] < 1.0, ranks[0]["metrics"]


def test_plain_lightning_snippet_runs_on_two_processes(tmp_path):
    source = marked_blocks("getting-started.md")[1]
    assert 'strategy="sync"' in source and "devices=2" in source
    script = tmp_path / "train.py"
    # Lightning's ddp launcher re-runs this script for rank 1; print the outcome from rank 0.
    script.write_text(source + "\nif trainer.is_global_zero:\n"
                      "    print('RESULT', type(trainer.strategy).__name__, trainer.world_size, trainer.global_step)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("MASTER_PORT", None)
    env.pop("MASTER_ADDR", None)
    done = cli_process.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RESULT SyncStrategy 2 100" in done.stdout, done.stdout[-2000:]
