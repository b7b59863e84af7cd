"""Model building blocks (nn.Modules) whose hot ops resolve through `tokenspeed.kernels` once, at build time.

Import the concrete modules directly (`tokenspeed.layers.attention`, ...): this
package stays import-light so unrelated layers (e.g. the sampler) load alone.
"""
