import os
import sys

import torch

# The repository is a set of top-level files, not a package: let tests import main, reference, bench.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The tests' yardstick is the error of PyTorch's SDPA in the same dtype. Its cuDNN backend, SDPA's first choice on
# an H100, builds a plan for every new shape (about 60 ms a forward call on an H200, several times that on a fresh
# machine), and the tests meet hundreds of shapes. So here SDPA chooses among its other backends: flash, or
# memory-efficient where a mask or fp32 rules flash out. The timed runs of bench.py (test_bench) start processes of
# their own, where SDPA keeps its default.
torch.backends.cuda.enable_cudnn_sdp(False)
