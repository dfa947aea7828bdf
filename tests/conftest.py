import os
import sys

# The repository is a set of top-level files, not a package: let tests import main, reference, bench.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
