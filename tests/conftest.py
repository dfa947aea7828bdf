import os
import sys

import torch

# The repository is a set of top-level files, not a package: let tests import main, reference, bench.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The tests' yardstick is the error of PyTorch's SDPA in the same dtype. Its cuDNN backend, SDPA's first choice on
# an H100, builds a plan for every new shape (about 60 ms a call, and on a fresh machine it compiles kernels too),
# and the tests meet hundreds of shapes. So here SDPA chooses among its other backends: flash, or memory-efficient
# where a mask or fp32 rules flash out. bench.py, which times SDPA's default, runs in a process of its own.
torch.backends.cuda.enable_cudnn_sdp(False)
