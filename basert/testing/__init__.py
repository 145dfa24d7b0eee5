"""Support shared by the tests and the tools: a real `basert serve` subprocess on a loopback port
(`launcher`), servers reused between tests (`pool`), requests to them (`client`), and a /health watcher
(`health`)."""
