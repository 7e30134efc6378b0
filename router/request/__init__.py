"""A request's first stage: the OpenAI body and headers parsed into a ``RouteRequest`` (``parse``),
the model-name rewrite, the typed rejections and their statuses, and the meter that reads the
engine's answer as it passes."""
