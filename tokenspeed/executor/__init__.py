"""What runs on the device: `Executor` (`executor.py`) behind the `ModelExecutor` interface (`interface.py`).

Import the modules directly; the package imports nothing itself, so the
interface (which needs no torch) can be imported without loading the rest.
"""
