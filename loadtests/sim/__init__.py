"""The simulated vLLM engines (OpenAI API, vLLM metrics and KV events, P/D roles) and their cluster."""
