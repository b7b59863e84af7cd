"""Training of the embedded models (issue 14): data, trainable networks, loop, metrics, command.

Nothing here runs at serve time. `run.py` is the command (`scripts/train_embedded.py`
wraps it); its outputs are Hugging Face checkpoint folders that `materialize.py`
ships and the engine loads like any other checkpoint.

- `corpus.py`: Python sources available offline, split by file, tokenised.
- `blocks.py`, `qwen3_net.py`, `deepseek_net.py`: trainable networks whose
  parameter names are the Hugging Face checkpoint names.
- `eagle.py`: the EAGLE draft head of the dense model (format in its docstring).
- `loop.py`: optimiser, schedule, time budget, JSON-lines log.
- `metrics.py`: held-out bits per byte, top-1 and next-next-token accuracy.
"""
