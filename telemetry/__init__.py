"""Tracing and logging setup (OpenTelemetry spans, W3C traceparent, JSON log lines) that the gateway, the backend
and ops share: its own package, beside protocol's torch-free contracts (telemetry/observability.py). Imports no
other package of ours."""
