"""The item scheduler and the cache are plain Python: importing them must not import torch."""
import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["epd.encoder.item_scheduler", "epd.encoder.cache", "epd.config"])
def test_module_does_not_import_torch(module):
    code = f"import sys, {module}; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
