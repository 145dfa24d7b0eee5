"""The kernels built for the portable CPU variant (basert._ext picks one at import)."""
