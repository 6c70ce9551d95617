"""The doctor report: one document, its Markdown rendering, and redaction of private data."""
