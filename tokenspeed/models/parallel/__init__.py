"""A model's weights under a parallel layout: which tensors a checkpoint holds, how each is split, what one rank
reads (only its slices) and holds, and the `tokenspeed placement` report.

These need the model's own knowledge (tensor names per family, `ModelConfig`), so they sit in `models/`, above
`placement/`, which stays model-agnostic: placements, module specs, the compiler and the collectives.
"""
