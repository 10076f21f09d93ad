"""kiln.runtime.server: the OpenAI-compatible HTTP front end of the runtime (`kiln serve`).

app: routes; admission: prompts to queued engine requests, against the queue bound; bodies and
offload: request bodies decoded, templates rendered and prompts tokenized on a worker pool (short
ones on the event loop); limits: the request-size and body-time bounds; connections: connection
hygiene under uvicorn (limit, read timeouts, slowloris, lingering close); streams: engine
streams, SSE, the shutdown deadline; protocol: the wire format (pydantic models); errors:
APIError; auth: the API key; metrics: Prometheus; web: the chat page; launch: `serve` under
uvicorn. The policy core never imports this
package.
"""
