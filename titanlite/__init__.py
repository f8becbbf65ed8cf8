"""titanlite: PyTorch-native LLM pretraining, from a laptop CPU to GPU clusters."""

import time as _time

__version__ = "0.1.0"

# When this process began importing titanlite: the start of the trainer's start-up record.
IMPORT_STARTED = _time.time()

# The config reads what the components offer (their sections, names, checks) through the
# catalog this installs; importing it here puts it in place for every use of titanlite.
from titanlite import components  # noqa: E402, F401
