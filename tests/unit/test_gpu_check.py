"""`make gpu-check`'s report plugin on CPU: a run of a passing, a failing, a skipped and an
erroring check ends with one row each, the reason of each failure and skip, and the totals."""

import subprocess
import sys

from tests.conftest import REPO

CHECKS = '''
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_ok():
    pass

def test_wrong():
    assert 1 + 1 == 3, "one and one is not three"

@pytest.mark.skip(reason="needs 2 GPUs")
def test_two_gpus():
    pass

def test_setup_fails(broken):
    pass
'''


def test_the_report_has_a_row_per_check_with_why_and_the_totals(tmp_path):
    (tmp_path / "test_checks.py").write_text(CHECKS)
    result = subprocess.run([sys.executable, "-m", "pytest", str(tmp_path / "test_checks.py"), "-p", "tests.gpu.check",
                             "-q", "-p", "no:cacheprovider", f"--rootdir={tmp_path}"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout
    start = result.stdout.index("gpu-check: ")
    report = result.stdout[start:result.stdout.index("\n", result.stdout.index("gpu-check: ", start + 1))]
    rows = {line.split()[0].rsplit("::", 1)[-1]: line for line in report.splitlines() if "::" in line}
    assert set(rows) == {"test_ok", "test_wrong", "test_two_gpus", "test_setup_fails"}
    assert rows["test_ok"].split()[1] == "passed"
    assert rows["test_wrong"].split()[1] == "failed" and "one and one is not three" in rows["test_wrong"]
    assert rows["test_two_gpus"].split()[1] == "skipped" and "needs 2 GPUs" in rows["test_two_gpus"]
    assert "error (setup)" in rows["test_setup_fails"] and "fixture broke" in rows["test_setup_fails"]
    assert "no CUDA device; torch 2.13.0" in report.splitlines()[0]
    assert "gpu-check: 1 error, 1 failed, 1 passed, 1 skipped in " in report
