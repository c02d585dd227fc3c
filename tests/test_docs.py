"""The docs against the result files they cite."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.one_backend
def test_every_number_of_the_guides_short_answer_recomputes_from_the_committed_results():
    """tools/check_guide.py recomputes each number the short answer states from
    docs/study-results/ and finds it in the text."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "check_guide.py")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "numbers found as computed" in done.stdout
