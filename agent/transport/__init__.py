"""The transport layer: HTTP/1.1 (over TLS when configured) and who may call.

Beneath both apps that serve HTTP (agent.api: the JSON API, /metrics and the
probes; agent.traces: the OTLP/HTTP receiver) and beside the OTLP/gRPC
receiver, which takes its TLS and credentials from the same web configuration.
An app hands the server an HttpApp and gets requests; it never reaches into
another app for the server. Nothing here imports another agent package but
agent.errors.
"""
