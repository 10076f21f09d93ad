"""kiln.runtime.server: the OpenAI-compatible HTTP front end of the runtime (`kiln serve`).

app: routes, admission against the queue bound; streams: engine streams, SSE, the shutdown
deadline; protocol: the wire format (pydantic models); auth: the API key; metrics: Prometheus;
launch: `serve` under uvicorn. The policy core never imports this package.
"""
