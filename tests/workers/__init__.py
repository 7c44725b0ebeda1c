"""Worker loading (processes and threads): differential against torch, options, zero-copy."""
