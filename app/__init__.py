"""The product around the engine: ingestion (documents), library, one open book (session), the UI."""
