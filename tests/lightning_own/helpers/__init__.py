# Vendored from Lightning 2.6.5's tests/tests_pytorch/helpers (Apache-2.0): see tests/README.md.
from lightning.pytorch.demos.boring_classes import (  # noqa: F401
    BoringDataModule,
    BoringModel,
    ManualOptimBoringModel,
    RandomDataset,
)
