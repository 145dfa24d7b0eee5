"""Compiled kernels (Cython + C with AVX2/FMA/F16C or scalar fallbacks). No policy here."""
