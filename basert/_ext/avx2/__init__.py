"""The kernels built for the avx2 CPU variant (basert._ext picks one at import)."""
