"""The prefix-cache index in Redis: which worker holds which prefix-cache blocks.

``keys`` is the one key schema, ``publisher`` the workers' writer (one thread per worker,
fed by the engine loop after each step) and ``reader`` the router's lookup (one Redis round
trip per prompt). The engine knows nothing of Redis; it records its block pool's events and
the publisher ships them.
"""
