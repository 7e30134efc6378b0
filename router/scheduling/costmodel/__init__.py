"""The cost model, pure numpy: ``view`` (what every term reads), ``prefix`` and ``link`` (the
locality and KV-transfer parts of the model), ``terms/`` (one module per cost term), ``matrix`` (the
(route, decode pod) cost matrix), ``policies`` (the pair pickers), ``registry`` (terms by name)."""
