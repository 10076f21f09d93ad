"""kiln.runtime.server: the OpenAI-compatible HTTP front end of the runtime (`kiln serve`).

app: routes and request handling; protocol: the wire format (pydantic models); metrics: Prometheus.
The policy core never imports this package.
"""
