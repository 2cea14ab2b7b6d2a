"""`python -m lightning_trn.healthcheck` with one rank made faulty at the device boundary (tests/test_healthcheck.py).

`FAULT=wrong`: rank `FAULT_RANK`'s matmuls return a wrong result, as a broken core would. `FAULT=hang`: its device
never finishes (`sync(wait=True)` does not return), as a hung core would. Other ranks are unchanged.
"""

import os
import sys
import time

import torch

from lightning_trn.healthcheck.__main__ import main
from lightning_trn.runtime import get_runtime


def _faulty() -> bool:
    return os.environ.get("LOCAL_RANK", "0") == os.environ["FAULT_RANK"]


if os.environ["FAULT"] == "wrong":
    matmul = torch.Tensor.__matmul__

    def wrong_matmul(self, other):
        result = matmul(self, other)
        return result + 1 if _faulty() and result.device.type != "cpu" else result

    torch.Tensor.__matmul__ = wrong_matmul
elif os.environ["FAULT"] == "hang":
    runtime_class = type(get_runtime())
    sync = runtime_class.sync

    def hung_sync(self, wait=False):
        while wait and _faulty():
            time.sleep(1)
        sync(self, wait)

    runtime_class.sync = hung_sync

sys.exit(main())
