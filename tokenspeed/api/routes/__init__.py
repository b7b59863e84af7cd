"""HTTP routes, one module per API surface."""
