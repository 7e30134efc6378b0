"""The pick: ``picker`` (the runner of filters, cost terms and the pair picker), ``extension``
(the extension-point Protocols), ``filters`` and ``producers`` (the ones shipped), and
``costmodel`` (the pure maths: every term in seconds, the cost matrix, the pair pickers)."""
