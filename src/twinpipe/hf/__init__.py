"""Hugging Face ``transformers`` causal LMs under twinpipe's schedules."""
