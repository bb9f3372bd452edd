"""The README's first example is a train function of 15 lines or fewer, the one the quickstart runs."""

from __future__ import annotations

from pathlib import Path

from tests._doc_blocks import blocks

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_shows_the_quickstarts_train_function_before_the_configuration_way() -> None:
    readme = (ROOT / "README.md").read_text()
    (train,) = [b for b in blocks(ROOT / "README.md") if b.text.lstrip().startswith("def train(ctx)")]
    lines = train.text.strip().splitlines()
    assert len(lines) <= 15, len(lines)
    quickstart = [b for b in blocks(ROOT / "docs" / "quickstart.md") if b.mode == "file" and "my_loop.py" in b.args]
    assert quickstart and train.text.strip() in quickstart[0].text, "the README's train function is not the quickstart's"
    assert readme.index("def train(ctx)") < readme.index('model = "'), "the train function comes first"
