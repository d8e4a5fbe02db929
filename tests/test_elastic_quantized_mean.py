"""The elastic DiLoCo's quantized mean (``tests/elastic_quantized_mean_cases.py``), run in a pytest of its own.

Those cases build real torchft memberships and gloo groups in the test process. Their native threads outlive the
cases, and a later test that forks its ranks (``start_method="fork"``: tests/test_lightning_features.py,
tests/test_reliability.py) then hangs in the child (reproduced: the manual-optimization test hung after them in one
process). A child pytest keeps those threads out of this process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("elastic_quantized_mean_cases.py")


@pytest.mark.timeout(600)
def test_the_elastic_quantized_mean_cases_pass_in_a_process_of_their_own():
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                             str(CASES)], cwd=CASES.parent.parent, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout, result.stdout[-2000:]
