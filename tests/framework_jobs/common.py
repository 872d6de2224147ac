"""What the framework jobs share: the same learnable data (4 Gaussian blobs in 16 dimensions)."""

import torch
from torch.utils.data import DataLoader, TensorDataset


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(4, 16, generator=g) * 2
    y = torch.randint(0, 4, (1024,), generator=g)
    x = centres[y] + torch.randn(1024, 16, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=32)
