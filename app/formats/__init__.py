"""Readers that turn one file format into a `Document` (see `app/documents.py`, the public face).

Each module holds one concept: `errors`, `limits`, `document` (the result type and its builder),
`sniff` (which format a file really is), `archive` (zip opened safely), `cleaning` (text repair),
and one reader per format: `pdf`, `epub`, `markup` (HTML), `plain` (TXT, Markdown), `docx`.
"""
