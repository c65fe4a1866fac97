"""The OpenAI-compatible HTTP API: `protocol` (the request and response bodies), `body`
(an HTTP body read into its model), `serving` (bodies to GenerateInput, StreamDeltas to
responses and SSE events), `api` (the aiohttp routes) and `schema` (/openapi.json)."""
