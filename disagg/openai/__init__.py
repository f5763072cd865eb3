"""An OpenAI-compatible HTTP API in front of the served ensembles: `/v1/completions`,
`/v1/chat/completions` and `/v1/models`, each request one gRPC stream to `ensemble` or `aggregated`."""
