"""Data: ShareGPT loading and normalisation, chat templates with assistant loss masks, batching."""
