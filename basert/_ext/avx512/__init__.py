"""The kernels built for the avx512 CPU variant (basert._ext picks one at import)."""
