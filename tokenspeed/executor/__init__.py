"""What runs on the device: `Executor` (`executor.py`) behind the `ModelExecutor` interface (`interface.py`).

Import the modules directly; this package imports nothing itself, so the
torch-free parts of the engine never load torch through it.
"""
