"""Hugging Face TGI's native API."""
