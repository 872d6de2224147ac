import os
import sys

import torch

# Tests measure behaviour, not speed: one thread keeps parallel ranks from fighting over 2 cores.
torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))
