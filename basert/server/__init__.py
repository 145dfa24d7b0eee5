"""HTTP layer: quart-trio app, schemas, auth, errors, SSE, metrics, files store."""
