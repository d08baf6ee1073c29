"""Puts work in. Must install and run without torch (`pip install '.[producer]'`)."""
