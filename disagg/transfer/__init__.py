"""KV handoff between a prefill engine and a decode engine, without passing KV through the orchestrator."""
