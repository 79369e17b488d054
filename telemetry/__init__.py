"""OpenTelemetry tracing and Prometheus metrics shared by the router and the workers."""
