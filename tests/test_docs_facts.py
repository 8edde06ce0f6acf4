"""What the docs say of the code, checked against the code: evaluation's KV cache, the times the
docs quote (only those a results file holds, through `python -m benchmarks readme`), the docs
speaking to users on their own machines, and a changelog of a first release."""

import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAINER_README = ROOT / "examples" / "dflash_trainer" / "README.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples" / "dflash_trainer").glob("*.md")),
         ROOT / "benchmarks" / "README.md", ROOT / "CHANGELOG.md"]
# a duration: a number and its unit
DURATION = re.compile(r"\b\d+(?:\.\d+)?(?:\s*-\s*\d+(?:\.\d+)?)?\s*(?:s|min|minutes?|seconds?|hours?|h)\b")


def prose(path: Path) -> str:
    """A page without its generated sections (rendered from the results files) and code blocks."""
    text = re.sub(r"<!-- ([\w-]+):begin -->.*?<!-- \1:end -->", "", path.read_text(), flags=re.S)
    return re.sub(r"```.*?```", "", text, flags=re.S)


def test_the_trainer_readme_says_evaluation_keeps_the_kv_cache_as_it_does():
    from examples.dflash_trainer import eval as evaluation

    assert inspect.signature(evaluation.acceptance_length).parameters["kv_cache"].default is True
    assert "kv_cache" not in inspect.getsource(evaluation.Evaluator)  # the trainer's evaluation takes the default
    text = " ".join(TRAINER_README.read_text().split())
    assert "no KV cache" not in text
    assert "Evaluation keeps the target's KV cache of the accepted tokens" in text


@pytest.mark.parametrize("path", [ROOT / "docs" / "gpu-testing.md", TRAINER_README], ids=lambda p: p.name)
def test_no_hand_written_duration_outside_the_generated_sections(path):
    """Durations the code sets (a flag's default, how often a line is printed) are no measurement."""
    from examples.dflash_trainer.config import TrainConfig

    set_by_code = {f"{TrainConfig().compile_warmer_timeout_s:.0f} s"}  # --compile-warmer-timeout-s
    main = (ROOT / "examples" / "dflash_trainer" / "__main__.py").read_text()
    assert ">= 10:  # a line every 10 s" in main
    set_by_code.add("10 s")  # the startup line
    found = [d for d in DURATION.findall(" ".join(prose(path).split())) if d not in set_by_code]
    assert found == []


def test_the_build_time_the_trainer_logs_quotes_no_unmeasured_figure():
    from examples.dflash_trainer.assets.assets import BUILD_TIME

    assert not re.search(r"\d", BUILD_TIME) and "trainer's README" in BUILD_TIME


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_docs_speak_to_users_on_their_own_machines(path):
    text = " ".join(prose(path).split())
    found = re.findall(r"\b(?:run|verified|measured|tested|built|ran) here\b|\bthese machines\b|\bthis session\b", text)
    assert found == []


def test_the_changelog_of_the_first_release_says_what_it_contains():
    text = (ROOT / "CHANGELOG.md").read_text()
    first = text.split("\n## ")[1]
    assert "The first release." in first
    assert not re.search(r"before this release|compared with|no longer|any more|is gone|in the same round", first, re.I)
