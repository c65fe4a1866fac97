"""The gateway: the `bucketserve.v1` gRPC API and OpenAI-compatible HTTP (`openai/`) over one
backend.

`GatewayServer(backend, GatewayConfig(...), TenantRegistry.from_dict(...))` serves a started
`bucketserve.controller.controller.Controller`; both front ends go through one `Admission`
(auth, validation, tokenization, limits, tenant quota). The client SDK is `Client` /
`AsyncClient` (re-exported by `bucketserve`); the CLI is `bucketserve.gateway.cli`.
"""
