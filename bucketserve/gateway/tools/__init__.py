"""Tool calling, shared by the OpenAI and gRPC front ends: a request's tools and tool_choice
(`RequestTools`), readers that find calls in a choice's text as it grows (`call_reader`,
`tool_parsers`, over `json_scan`), and `ToolStream`, which splits that text into content
and tool-call deltas."""
