"""The server's HTTP routes, one blueprint per area: OpenAI endpoints, slots, files, and operations."""
