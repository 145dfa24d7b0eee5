"""The synchronous engine: model loading, forward passes, KV blocks, recurrent state, sampling."""
