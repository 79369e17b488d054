"""What every worker process runs, whatever its role: the gRPC server with the cluster secret
(``server``), the engine loop and its publishing of prefix-cache events, tracing, stats and
start/stop (``runtime``), and how failed calls end (``errors``). The roles' packages
(prefill_worker/, decode_worker/) keep only their Prefill and Generate logic."""
