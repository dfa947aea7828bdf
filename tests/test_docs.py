"""The line links of docs/algorithm.md still point at the lines they describe."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_algorithm_page_is_up_to_date():
    result = subprocess.run([sys.executable, str(ROOT / "docs" / "make_algorithm.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
