"""Keep third-party import chatter (CUDA kernel probes, version warnings, progress bars) off the CLI."""

from __future__ import annotations

import logging
import os
import warnings

NOISY = ("torchao", "torch.utils._pytree", "transformers", "coremltools", "executorch")


def quiet_third_party() -> None:
    for name in NOISY:
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("TQDM_DISABLE", "1")  # coremltools' pass-pipeline progress bars
    warnings.filterwarnings("ignore", message=".*has not been tested with coremltools.*")
    for module in ("coremltools", "executorch", "torchao", "torch.utils._pytree", "torch.export", "copyreg"):
        warnings.filterwarnings("ignore", module=module)  # version and deprecation notices the user cannot act on
