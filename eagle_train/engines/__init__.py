"""Serving engines as a second opinion: run a head in a real engine (vLLM) and compare."""
