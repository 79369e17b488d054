"""Native CPU kernels, compiled on first use and cached."""
