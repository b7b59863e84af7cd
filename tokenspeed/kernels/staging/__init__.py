"""Staging kernels: turning a step's uploaded index arrays into the device inputs its forward reads."""
